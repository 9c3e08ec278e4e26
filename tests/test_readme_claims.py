"""The tolerances a committed run's claims are compared with (``readme_claims``): what another
machine's rounding explains passes, a real change does not. No lesson is run: each case edits a
copy of a committed run's claims."""

from __future__ import annotations

import copy
import json

import pytest
from readme_claims import MODEL_ARITHMETIC_RTOL, Loss, claim_differences, claims, loss_tolerance, ulp

from utilities.course import readme_tables


def committed_claims(lesson: str) -> dict:
    return claims(lesson, json.loads((readme_tables.lesson_dir(lesson) / "results_cpu.json").read_text()))


def test_the_differences_other_machines_showed_pass():
    """Lesson 03's next loss 6e-6 apart (fp32, after 3 steps) and lesson 14's bf16 loss one half
    step apart (averaged over two ranks), as a learner's 2-core AMD EPYC ran them; lesson 14's
    bf16 loss a whole step apart, as this project's 2-core machine ran it with one thread per rank."""
    committed = committed_claims("03")
    ran = copy.deepcopy(committed)
    assert committed["fsdp2"]["next_loss_a"] == 4.729997634887695
    ran["fsdp2"]["next_loss_a"] = ran["fsdp2"]["next_loss_b"] = 4.730003833770752
    assert claim_differences(ran, committed) == []

    committed = committed_claims("14")
    ran = copy.deepcopy(committed)
    assert committed["full_shard-bf16-ac"]["losses"] == [6.421875, 5.171875, 4.984375]
    for seen in (5.0, 5.015625):
        ran["full_shard-bf16-ac"]["losses"] = [6.421875, 5.171875, seen]
        assert claim_differences(ran, committed) == []
    ran["full_shard-bf16-ac"]["losses"] = [6.421875, 5.171875, 5.046875]  # two steps: outside
    assert len(claim_differences(ran, committed)) == 1


@pytest.mark.parametrize("lesson, name, key", [
    ("03", "fsdp2", "next_loss_a"),
    ("10", "fsdp2", "losses"),  # fp32, 30 steps: the widest fp32 tolerance
    ("13", "eager", "losses"),  # bf16 autocast
    ("14", "full_shard-bf16-ac", "losses"),  # bf16 losses averaged over two ranks
    ("14", "full_shard-fp32", "losses"),
])
def test_a_loss_one_percent_off_is_caught(lesson, name, key):
    committed = committed_claims(lesson)
    for index in range(len(committed[name][key]) if key == "losses" else 1):
        ran = json.loads(json.dumps(committed))  # plain floats, as a run's results.json holds
        if key == "losses":
            ran[name][key][index] *= 1.01
        else:
            ran[name][key] *= 1.01
        problems = claim_differences(ran, committed)
        assert len(problems) == 1 and problems[0].startswith(f"{name} {key}"), (index, problems)


@pytest.mark.parametrize("lesson, name, key", [
    ("01", "fsdp2-per-block", "unsharded"),
    ("06", "fsdp2-reshard-true", "resident_bytes"),
    ("09", "frozen-encoder", "gradient_bytes_per_rank"),
    ("12", "tp2-llama", "weight_bytes_per_rank"),
    ("14", "full_shard-fp32", "planned"),
])
def test_a_byte_count_one_parameter_off_is_caught(lesson, name, key):
    """Parameter, gradient, optimizer and planned bytes are exact: 4 bytes (one fp32 parameter)
    more is a different model."""
    committed = committed_claims(lesson)
    ran = json.loads(json.dumps(committed))
    if isinstance(ran[name][key], dict):
        part = next(iter(ran[name][key]))
        ran[name][key][part] += 4
    else:
        ran[name][key] += 4
    assert [p.split(":")[0].startswith(f"{name} {key}") for p in claim_differences(ran, committed)] == [True]
    ran = json.loads(json.dumps(committed))
    ran[name]["peak"]["parameters"] += 4
    assert len(claim_differences(ran, committed)) == 1


def test_each_tolerance_says_what_it_allows():
    assert ulp(5.0, 7) == ulp(4.0, 7) == 2**-5 and ulp(3.99, 7) == 2**-6  # bf16 spacing
    assert ulp(4.73, 23) == 2**-21  # fp32 spacing
    assert loss_tolerance(Loss(4.0, "bf16", 2)) == 2**-5 == ulp(4.0, 7)  # one step, at least
    assert loss_tolerance(Loss(7.5, "bf16", 20)) == 7.5 * 2**-7 < 2 * ulp(7.5, 7)  # under two
    assert loss_tolerance(Loss(3.99, "bf16", 0), 4.02) == 4.02 * 2**-7 > ulp(4.02, 7)  # across 4
    assert loss_tolerance(Loss(4.73, "fp32", 0)) == 64 * 2**-21
    assert loss_tolerance(Loss(4.73, "fp32", 3)) == 4 * 64 * 2**-21
    for loss in (Loss(4.0, "bf16", 0), Loss(7.99, "bf16", 5), Loss(3.3, "fp32", 29), Loss(0.5, "fp16", 1)):
        assert loss_tolerance(loss) < 0.01 * loss, loss  # a 1% change is always outside
    assert MODEL_ARITHMETIC_RTOL < 1e-5
