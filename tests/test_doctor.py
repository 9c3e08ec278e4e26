"""The doctor (``utilities.doctor.diagnose`` and ``fsdp-course doctor``): silent on every lesson's
own wrapping, FSDP1 and FSDP2, built with the lessons' own functions; and each mistake it knows
made on purpose and caught, on a one-rank gloo group in this process."""

from __future__ import annotations

import copy
import functools
import json
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import cli_here, lesson_module
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from utilities import doctor, doctor_units
from utilities.doctor import diagnose, findings_text
from utilities.doctor_parts import COLUMNS, Finding
from utilities.models import get_model_spec, init_weights
from utilities.precision import fsdp1_policy, fsdp2_policy
from utilities.wrapping import shard_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """One gloo rank on an in-process store, as the root README's snippet makes it."""
    from utilities.distributed import teardown

    if dist.is_initialized():  # another test's group: use it
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")  # FSDP1 at world size 1
    yield
    teardown()


@functools.cache
def _template(name: str) -> nn.Module:
    torch.manual_seed(0)
    return get_model_spec(name).build()


def build(name: str = "t5-tiny") -> nn.Module:
    """A fresh course model: a copy of one built once per test module (its init is the slow part;
    a deep copy keeps its tied weights tied)."""
    return copy.deepcopy(_template(name))


def block(name: str = "t5-tiny") -> type[nn.Module]:
    return get_model_spec(name).block_class()


def checks(findings: list[Finding]) -> list[str]:
    return [f.check for f in findings]


def ids(name: str = "t5-tiny") -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, get_model_spec(name).config().vocab_size, (2, 16))}


# -- every lesson's own wrapping: nothing to report ------------------------------------------------

def _l01(api):
    lesson = lesson_module("01")
    wrap = lesson.variants(block(), 100_000, CPU)[f"{api}-per-block"]
    return wrap(build()), "t5-tiny"


def _l02(api):
    lesson = lesson_module("02")
    if api == "fsdp2":
        return lesson.fsdp2_checkpointed(build(), block(), 2), "t5-tiny"
    return lesson.fsdp1_checkpointed(build(), block(), 1, CPU), "t5-tiny"


def _l03_08(api):  # lessons 03 and 08 shard through shard_model
    return shard_model(build(), api=api, block_class=block(), policy="block", device=CPU), "t5-tiny"


def _l04(api):
    lesson = lesson_module("04")
    if api == "fsdp2":
        model = build()
        lesson.prefetch_ahead(lesson.shard_blocks(model, block()), 2)
        return model, "t5-tiny"
    from torch.distributed.fsdp import BackwardPrefetch

    return lesson.wrap_fsdp1(build(), block(), CPU, BackwardPrefetch.BACKWARD_PRE, True), "t5-tiny"


def _l06(api):
    lesson = lesson_module("06")
    mesh = lesson.hsdp_mesh("cpu", 1, 1)
    name = {"fsdp2": "fsdp2-hsdp", "fsdp1": "fsdp1-shard-grad-op"}[api]
    return lesson.wrap(name, build(), block(), CPU, mesh, None), "t5-tiny"


def _l06_reshard(api):
    lesson = lesson_module("06")
    name = {"fsdp2": "fsdp2-reshard-false", "fsdp1": "fsdp1-hybrid-shard"}[api]
    return lesson.wrap(name, build(), block(), CPU, lesson.hsdp_mesh("cpu", 1, 1), None), "t5-tiny"


def _l07(api):
    lesson = lesson_module("07")
    if api == "fsdp2":
        return lesson.shard_fsdp2(build(), block(), fsdp2_policy("bf16")), "t5-tiny"
    return lesson.shard_fsdp1(build(), block(), fsdp1_policy("fp16"), CPU), "t5-tiny"


def _l09(api):
    lesson = lesson_module("09")
    model = build()
    lesson.freeze(model, lesson.ENCODER)
    if api == "fsdp2":
        return lesson.wrap_fsdp2(model, block()), "t5-tiny"
    return lesson.wrap_fsdp1(model, block(), CPU, use_orig_params=True), "t5-tiny"


def _l10(api):
    lesson = lesson_module("10")
    from train_config import Config

    cfg = Config(model="llama-tiny", api=api, precision="bf16", activation_checkpointing=True,
                 ac_every=2, prefetch=2)
    return lesson.parallelize(build("llama-tiny"), cfg, CPU), "llama-tiny"


def _l10_meta(api):
    """Lesson 10's way with a model too large for one host: built on meta, sharded, then
    ``to_empty`` and the model's init (FSDP2); FSDP1's ``param_init_fn`` (lesson 01's)."""
    model = get_model_spec("llama-tiny").build("meta")
    if api == "fsdp2":
        from train_config import Config

        lesson_module("10")
        return lesson_module("10").parallelize(model, Config(model="llama-tiny", precision="fp32"),
                                                CPU), "llama-tiny"
    return lesson_module("01").wrap_fsdp1(model, lesson_module("01").block_policy(block("llama-tiny")),
                                          CPU), "llama-tiny"


def _l11(api):
    lesson = lesson_module("11")
    if api == "fsdp2":
        return lesson.wrap_fsdp2(build(), block()), "t5-tiny"
    return lesson.wrap_fsdp1(build(), block(), CPU, limit_all_gathers=False), "t5-tiny"


def _l12(api):
    lesson = lesson_module("12")
    return lesson.apply_2d(build("llama-tiny"), lesson.mesh_2d("cpu", 1, 1)), "llama-tiny"


def _l13(api):
    lesson = lesson_module("13")
    model = build("llama-tiny")
    lesson.shard(model, block("llama-tiny"), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    return model, "llama-tiny"


def _l14(api):
    lesson = lesson_module("14")
    return lesson.shard(build("llama-tiny"), block("llama-tiny"), "full_shard", "bf16", "full"), "llama-tiny"


LESSON_WRAPPINGS = {
    "01": (_l01, ("fsdp2", "fsdp1")), "02": (_l02, ("fsdp2", "fsdp1")),
    "03-08": (_l03_08, ("fsdp2", "fsdp1")), "04": (_l04, ("fsdp2", "fsdp1")),
    "06": (_l06, ("fsdp2", "fsdp1")), "06-reshard": (_l06_reshard, ("fsdp2", "fsdp1")),
    "07": (_l07, ("fsdp2", "fsdp1")), "09": (_l09, ("fsdp2", "fsdp1")),
    "10": (_l10, ("fsdp2", "fsdp1")), "10-meta": (_l10_meta, ("fsdp2", "fsdp1")),
    "11": (_l11, ("fsdp2", "fsdp1")), "12": (_l12, ("fsdp2",)), "13": (_l13, ("fsdp2",)),
    "14": (_l14, ("fsdp2",)),
}
CASES = [(lesson, api) for lesson, (_, apis) in LESSON_WRAPPINGS.items() for api in apis]


@pytest.mark.parametrize(("lesson", "api"), CASES, ids=[f"{lesson}-{api}" for lesson, api in CASES])
def test_no_finding_on_a_lessons_own_wrapping(lesson, api):
    model, name = LESSON_WRAPPINGS[lesson][0](api)
    trainable = [p for p in model.parameters() if p.requires_grad]  # lesson 09 trains only these
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    assert diagnose(model, optimizer, ids(name)) == []


def test_the_readme_way_is_clean_and_says_so():
    model = shard_model(build("llama-tiny"), api="fsdp2", block_class=block("llama-tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert findings_text(diagnose(model, optimizer)) == "no problems found"


STATES = ("no-grad-forward", "eval", "after-step", "after-checkpoint-load")


def _into_state(model: nn.Module, optimizer: torch.optim.Optimizer, name: str, state: str) -> None:
    """Take a correctly sharded model where training takes it: an evaluation forward under
    no_grad (the root stays unsharded), eval mode, optimizer steps, a checkpoint loaded back."""
    batch = ids(name)
    batch = dict(batch, labels=batch["input_ids"])
    if state == "no-grad-forward":
        with torch.no_grad():
            model(**batch)
    elif state == "eval":
        model.eval()
    else:
        model(**batch).loss.backward()
        optimizer.step()
    if state == "after-checkpoint-load":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
        full = StateDictOptions(full_state_dict=True)
        weights, moments = get_state_dict(model, optimizer, options=full)
        set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=moments, options=full)


STATE_CASES = [("03-08", api, state) for api in ("fsdp2", "fsdp1") for state in STATES] + [
    (lesson, "fsdp2", state) for lesson in ("07", "10") for state in ("no-grad-forward", "eval")]  # bf16


@pytest.mark.parametrize(("lesson", "api", "state"), STATE_CASES,
                         ids=[f"{lesson}-{api}-{state}" for lesson, api, state in STATE_CASES])
def test_no_finding_in_any_state_training_leaves_a_correct_model_in(lesson, api, state):
    model, name = LESSON_WRAPPINGS[lesson][0](api)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _into_state(model, optimizer, name, state)
    found = checks(diagnose(model, optimizer, ids(name)))
    if state == "eval" and api == "fsdp2" and name == "t5-tiny":
        assert found == ["unregistered-method"]  # true: T5's generate runs its encoder directly
    else:
        assert found == []


def test_a_method_is_reported_only_where_the_call_fails():
    """llama's generate goes through forward and works unregistered: nothing said; T5's runs its
    encoder (holding the root's shared embedding) directly and fails: said, naming it."""
    llama = shard_model(build("llama-tiny"), api="fsdp2", block_class=block("llama-tiny")).eval()
    prompt = ids("llama-tiny")["input_ids"][:, :4]
    assert llama.generate(input_ids=prompt, max_new_tokens=2).shape == (2, 6)  # it works
    assert diagnose(llama, methods=["generate"]) == []
    t5 = shard_model(build(), api="fsdp2", block_class=block()).eval()
    found = diagnose(t5)
    assert checks(found) == ["unregistered-method"] and "encoder" in found[0].problem
    assert "encoder.embed_tokens" in found[0].problem

    class Net(nn.Module):  # a model of its own, whose method calls modules of the root directly
        def __init__(self):
            super().__init__()
            self.embed, self.blocks = nn.Embedding(4, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            return self.decode(x)

        def decode(self, x):
            return self.blocks[1](self.blocks[0](self.embed(x)))

        def embed_only(self, x):
            return self.forward(x)

    net = Net()
    for layer in net.blocks:
        fully_shard(layer)
    fully_shard(net)
    found = diagnose(net, methods=["decode", "embed_only"])
    assert checks(found) == ["unregistered-method"] and "net.decode" not in found[0].problem
    assert "model.decode" in found[0].problem and "embed" in found[0].problem
    with pytest.raises(RuntimeError, match="DTensor"):
        net.decode(torch.zeros(1, 3, dtype=torch.long))
    net2 = Net()  # the root holds nothing itself: every module gathered by its own unit
    for layer in [*net2.blocks, net2.embed]:
        fully_shard(layer)
    fully_shard(net2)
    assert diagnose(net2, methods=["decode"]) == []
    assert net2.decode(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 8)


# -- each mistake, caught --------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_optimizer_built_before_sharding(api):
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = shard_model(model, api=api, block_class=block(), device=CPU)
    found = diagnose(model, optimizer)
    assert checks(found) == ["optimizer-before-sharding"]
    assert ("DTensors" if api == "fsdp2" else "flat parameters") in found[0].problem


def test_an_optimizer_built_while_the_root_is_unsharded():
    """After a no-grad forward FSDP2 leaves the root unsharded: model.parameters() are then plain
    gathered tensors, which never get a gradient."""
    model = shard_model(build("llama-tiny"), api="fsdp2", block_class=block("llama-tiny"))
    with torch.no_grad():
        model(**ids("llama-tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert checks(diagnose(model, optimizer)) == ["optimizer-before-sharding"]


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_model_cast_to_bf16_instead_of_a_policy(api):
    model = shard_model(build().to(torch.bfloat16), api=api, block_class=block(), device=CPU)
    found = diagnose(model, torch.optim.AdamW(model.parameters()))
    assert checks(found) == ["low-precision-weights"]
    assert "bfloat16" in found[0].problem and "master weights" in found[0].why


def test_tied_weights_split_fsdp2():
    model = build()  # t5: shared embedding tied to lm_head
    fully_shard(model.lm_head)  # the head its own unit: it takes the tied weight away
    shard_model(model, api="fsdp2", block_class=block())
    assert checks(diagnose(model)) == ["tie-broken"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_tied_weights_split_fsdp1(use_orig_params):
    policy = ModuleWrapPolicy({block(), nn.Embedding})  # the embeddings units of their own
    model = FSDP(build(), auto_wrap_policy=policy, device_id=CPU, use_orig_params=use_orig_params)
    expected = "tied-weights-split" if use_orig_params else "tie-broken"
    assert expected in checks(diagnose(model))


def test_meta_init_leftovers():
    model = get_model_spec("llama-tiny").build("meta")
    shard_model(model, api="fsdp2", block_class=block("llama-tiny"))
    assert checks(diagnose(model)) == ["meta-tensors"]
    model.to_empty(device="cpu")  # and no init: parameters and buffers hold whatever memory held
    with torch.no_grad():  # what fresh pages from the OS hold; reused ones hold anything
        for module in model.modules():
            for name in ("inv_freq", "original_inv_freq"):
                if hasattr(module, name):
                    getattr(module, name).zero_()
    assert "uninitialised-rotary" in checks(diagnose(model))
    init_weights(model)  # the fix
    assert diagnose(model) == []


def test_non_finite_parameters_and_buffers():
    model = shard_model(build("llama-tiny"), api="fsdp2", block_class=block("llama-tiny"))
    with torch.no_grad():
        model.model.norm.weight.to_local()[0] = float("nan")
    assert checks(diagnose(model)) == ["bad-parameter-values"]
    with torch.no_grad():
        model.model.norm.weight.to_local()[0] = 1.0
        model.model.rotary_emb.original_inv_freq[3] = float("nan")
    assert checks(diagnose(model)) == ["bad-buffer-values"]


def test_fsdp1_frozen_and_trainable_in_one_unit():
    refused = build()
    refused.shared.weight.requires_grad_(False)  # the root unit: mostly the frozen embedding
    with pytest.raises(ValueError, match="uniform"):  # without use_orig_params FSDP1 refuses it
        FSDP(refused, auto_wrap_policy=ModuleWrapPolicy({block()}), device_id=CPU)
    model = build()
    model.shared.weight.requires_grad_(False)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({block()}), device_id=CPU,
                   use_orig_params=True)
    found = diagnose(wrapped)
    assert checks(found) == ["fsdp1-frozen-gradients"] and "(root)" in found[0].problem


def test_fsdp1_mixed_unit_without_use_orig_params_where_torch_lets_it_through(monkeypatch):
    model = build()
    model.shared.weight.requires_grad_(False)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({block()}), device_id=CPU,
                   use_orig_params=True)
    monkeypatch.setattr(doctor_units, "fsdp1_uses_orig_params", lambda unit: False)
    assert checks(diagnose(wrapped)) == ["fsdp1-mixed-unit"]


def test_generate_not_registered():
    model = shard_model(build(), api="fsdp2", block_class=block())
    assert diagnose(model) == []  # training: generate is not checked unless named
    assert checks(diagnose(model, methods=["generate"])) == ["unregistered-method"]
    model.eval()  # set up to generate: checked
    found = diagnose(model)
    assert checks(found) == ["unregistered-method"] and "model.generate" in found[0].problem
    with pytest.raises(RuntimeError):  # what the user meets: mixed torch.Tensor and DTensor
        model.generate(input_ids=ids()["input_ids"], max_new_tokens=2)
    register_fsdp_forward_method(model, "generate")  # the fix
    assert diagnose(model) == []
    assert model.generate(input_ids=ids()["input_ids"], max_new_tokens=2).shape[0] == 2


@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_whole_model_in_the_root_unit(api):
    model = shard_model(build(), api=api, block_class=block(), policy="whole", device=CPU)
    found = diagnose(model)
    assert checks(found) == ["root-holds-most"]
    assert "100%" in found[0].problem and "4 T5Block blocks" in found[0].problem


def test_the_roots_own_parameters_are_named_when_every_block_is_a_unit():
    model = nn.Sequential(nn.Embedding(4096, 16), *(nn.Linear(16, 16) for _ in range(4)))
    for layer in model[1:]:
        fully_shard(layer)
    fully_shard(model)
    found = diagnose(model)
    assert checks(found) == ["root-holds-most"]
    assert "0.weight (4,096 x 16: 100%)" in found[0].problem
    assert "fully_shard(model[0])" in found[0].fix and "each" not in found[0].fix


def test_the_recommended_policy_reduces_in_fp32():
    model = shard_model(build().to(torch.bfloat16), api="fsdp2", block_class=block())
    (found,) = diagnose(model)
    assert "param_dtype=torch.bfloat16, reduce_dtype=torch.float32" in found.fix


def test_parameters_outside_every_unit():
    model = build("llama-tiny")
    for layer in model.model.layers:
        fully_shard(layer)  # and no fully_shard(model): embeddings, norm and head are left out
    found = checks(diagnose(model))
    assert found == ["unmanaged-parameters"]


def test_a_unit_far_larger_than_the_others():
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)), nn.Linear(256, 16),
                          nn.Linear(16, 16))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    found = diagnose(model)
    assert checks(found) == ["uneven-units"] and "'4'" not in found[0].problem
    assert "the largest, 4," in found[0].problem


def test_no_mixed_precision_on_a_gpu_with_bf16(monkeypatch):
    monkeypatch.setattr(doctor, "_bf16_gpu", lambda model: "NVIDIA H100 80GB HBM3")
    plain = shard_model(build(), api="fsdp2", block_class=block())
    assert checks(diagnose(plain)) == ["no-mixed-precision"]
    with_policy = shard_model(build(), api="fsdp2", block_class=block(), mp_policy=fsdp2_policy("bf16"))
    assert diagnose(with_policy) == []
    fsdp1 = shard_model(build(), api="fsdp1", block_class=block(), device=CPU)
    assert checks(diagnose(fsdp1)) == ["no-mixed-precision"]
    fsdp1_bf16 = shard_model(build(), api="fsdp1", block_class=block(), device=CPU,
                             mixed_precision=fsdp1_policy("bf16"))
    assert diagnose(fsdp1_bf16) == []


def test_the_batch():
    model = shard_model(build("llama-tiny"), api="fsdp2", block_class=block("llama-tiny"))
    assert checks(diagnose(model, batch={"input_ids": torch.full((2, 4), 999)})) == ["token-ids"]
    assert checks(diagnose(model, batch=[torch.zeros(2, 4, device="meta")])) == ["batch-device"]


def test_an_unsharded_model_is_said_to_be_one():
    assert checks(diagnose(build())) == ["not-sharded"]


def test_every_finding_prints_in_80_columns():
    model = build()
    optimizer = torch.optim.AdamW(model.parameters())
    model = shard_model(model.to(torch.bfloat16), api="fsdp2", block_class=block(), policy="whole")
    model.eval()
    findings = diagnose(model, optimizer, {"input_ids": torch.full((1, 2), 10**6)})
    assert len(findings) >= 4
    for finding in findings:
        text = str(finding)
        assert all(len(line) <= COLUMNS for line in text.splitlines()), text
        assert finding.line.count("\n") == 0 and "Fix: " in finding.line


RANKS_SCRIPT = """
import json, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from utilities.doctor import diagnose, same_build_findings

dist.init_process_group("gloo")
rank = dist.get_rank()

def build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(64, 32), *(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))
                                                  for _ in range(5)), nn.Linear(32, 64))
    model.register_buffer("scale", torch.rand(4))  # a buffer every rank holds in full
    return model

def shard(model, **options):
    for layer in model[1:-1]:
        fully_shard(layer, **options)
    return fully_shard(model, **options)

out = {}
for name, seed in (("seed_plus_rank", rank), ("same_seed", 0)):
    model = build(seed)
    out[name] = [f.line for f in same_build_findings(model)]
    out[name + "_after_sharding"] = [f.check for f in diagnose(shard(model), every_rank=True)]

ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(rank))
grads = {}
for name, policy in (("unset", MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                     ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
                     ("fp32", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
    model = shard(build(0), mp_policy=policy)
    model(ids).float().square().mean().backward()
    grads[name] = torch.cat([p.grad.full_tensor().float().flatten() for p in model.parameters()])
    out[name] = [f.line for f in diagnose(model)]
for name in ("unset", "bf16"):
    out[name + "_rel_error"] = float((grads[name] - grads["fp32"]).norm() / grads["fp32"].norm())
print(json.dumps(out))
"""


def test_on_two_ranks_a_divergent_build_and_a_bf16_reduction_are_caught():
    from conftest import run_ranks

    for out in run_ranks(RANKS_SCRIPT):
        (divergent,) = out["seed_plus_rank"]
        assert divergent.startswith("rank-divergent-build: ") and "torch.manual_seed(seed)" in divergent
        assert out["seed_plus_rank_after_sharding"] == ["rank-divergent-build"]  # the buffer differs
        assert out["same_seed"] == [] and out["same_seed_after_sharding"] == []
        for name in ("unset", "bf16"):  # gradients summed in bf16: measurably off an fp32 reduction
            (line,) = out[name]
            assert line.startswith("low-precision-reduce: ") and "reduce_dtype=torch.float32" in line
            assert out[name + "_rel_error"] > 1e-4
        assert "unset" in out["unset"][0] and out["fp32"] == []


# -- fsdp-course doctor ---------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_cli_on_a_course_model(api):
    proc = cli_here("doctor", "--model", "t5-tiny", "--api", api)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "no problems found" in lines and "(none materialised)" in proc.stdout
    assert lines[lines.index("no problems found") + 1].startswith("needs a run, not checked here: non-finite")


def test_cli_on_a_config_file(tmp_path):
    config = get_model_spec("llama-tiny").config().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = cli_here("doctor", "--model", str(tmp_path))
    assert proc.returncode == 0 and "no problems found" in proc.stdout, proc.stderr


def test_cli_finding_lines():
    proc = cli_here("doctor", "--model", "llama-tiny", "--policy", "whole")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[2].startswith("root-holds-most: ")
    assert all(len(line) <= COLUMNS for line in proc.stdout.splitlines())


@pytest.mark.parametrize(("sizes", "api"), [
    (dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
          intermediate_size=53248, vocab_size=128256, head_dim=128), "fsdp2"),  # Llama 3.1 405B's shape
    (dict(vocab_size=2**31), "fsdp1")])
def test_cli_inspects_any_size_without_materialising_it(tmp_path, sizes, api):
    import resource
    import time

    config = dict(get_model_spec("llama-tiny").config().to_dict(), **sizes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    t0, rss0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    proc = cli_here("doctor", "--model", str(tmp_path), "--api", api)
    seconds = time.perf_counter() - t0
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024  # Linux: KiB
    assert proc.returncode in (0, 1), proc.stderr
    assert "needs a run" in proc.stdout and ("meta" if api == "fsdp2" else "fake") in proc.stdout
    assert seconds < 60  # seconds on a laptop; this box runs beside other tests
    assert grown < 2**30  # 405B parameters in fp32 would be 1.6 TB


def test_cli_a_config_that_cannot_be_built_is_one_line(tmp_path):
    config = dict(get_model_spec("llama-tiny").config().to_dict(), hidden_size=100, num_attention_heads=3,
                  head_dim=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = cli_here("doctor", "--model", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")


@pytest.mark.parametrize("args", [("--model", "gpt-17"), ("--api", "fsdp3"), ("--policy", "layers"),
                                  ("--api", "fsdp2", "--policy", "size"), ("--bogus",)])
def test_cli_bad_input_is_one_line(args):
    proc = cli_here("doctor", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")


def test_cli_help_names_every_flag():
    proc = cli_here("doctor", "--help")
    assert proc.returncode == 0
    for flag in ("--model", "--api", "--policy"):
        assert flag in proc.stdout
    assert "    for finding in diagnose(model, optimizer):" in proc.stdout


def test_registration_is_not_guessed_on_an_unchecked_torch(monkeypatch):
    from utilities import torch_internals

    model = shard_model(build(), api="fsdp2", block_class=block())
    assert torch_internals.fsdp2_forward_method_registered(model, "generate") is False
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert torch_internals.fsdp2_forward_method_registered(model, "generate") is None
    assert diagnose(model, methods=["generate"]) == []  # cannot tell: nothing said
