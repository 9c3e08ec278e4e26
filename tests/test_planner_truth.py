"""The planner's model states are exact at any scale (16 bytes per parameter over the ranks that
shard them, on either device's AdamW path), it plans the user's own model from a Hugging Face
config.json or an nn.Module factory, and it refuses what it cannot plan in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import cli_here
from torch import nn

from utilities.errors import UsageError
from utilities.measure import fake_step, plan_cli, plan_sweep
from utilities.measure import planner as P
from utilities.models import custom_model_spec, get_model_spec
from utilities.torch_internals import clear_dtensor_sharding_cache

# The 7.5B llama of the planner's overcount report: Psi = 7,501,778,944
LLAMA_7_5B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
              "intermediate_size": 12992, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "tie_word_embeddings": False}

FAMILIES = {  # small configs of five families, as a user would write them
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 3,
             "n_head": 4, "vocab_size": 500, "n_positions": 256, "bos_token_id": 0, "eos_token_id": 0},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 500, "max_position_embeddings": 256},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 500, "max_position_embeddings": 256},
    "bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
             "vocab_size": 500, "max_position_embeddings": 256},
    "t5": {"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2,
           "num_heads": 4, "d_kv": 16, "vocab_size": 500, "decoder_start_token_id": 0,
           "pad_token_id": 0},
}
BLOCKS = {"gpt2": "GPT2Block", "qwen2": "Qwen2DecoderLayer", "mistral": "MistralDecoderLayer",
          "bert": "BertLayer", "t5": "T5Block"}
CLASSES = {"gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
           "bert": "BertForMaskedLM", "t5": "T5ForConditionalGeneration"}


def write_config(folder, values: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values))
    return str(folder)


def states_total(p: P.Plan) -> int:
    return sum(p.model_states[k] for k in ("parameters", "gradients", "optimizer"))


def test_full_shard_holds_16_bytes_per_parameter_over_64_gpus(tmp_path):
    """The 7.5B config given as a file: ZeRO-3's 16 Psi / N = 1.875 GB at N = 64, and the
    optimizer at the peak 8 Psi / 64 (it was booked 7.3 GB when the warm-up step's ops missed
    DTensor's sharding cache)."""
    clear_dtensor_sharding_cache()
    p = P.plan(write_config(tmp_path / "llama", LLAMA_7_5B), 64, 80 * 2**30, "full_shard", "bf16",
               "none", 1, 128, "cuda")
    psi = p.parameters_total
    assert psi == 7_501_778_944
    assert states_total(p) == pytest.approx(16 * psi / 64, rel=0.01)
    assert p.peak_bytes["optimizer"] == pytest.approx(8 * psi / 64, rel=0.01)
    assert p.theory["zero"]["total"] == pytest.approx(16 * psi / 64, rel=0.001)


@pytest.mark.parametrize("foreach", [False, True], ids=["cpu-adamw", "gpu-adamw-foreach"])
@pytest.mark.parametrize("gpus", [8, 1024])
def test_model_states_are_exact_on_either_devices_adamw_path(tmp_path, monkeypatch, foreach, gpus):
    """Both AdamW paths (CPU's per-tensor, CUDA's foreach) from a cold sharding cache: states
    16 Psi / N and the optimizer at the peak 8 Psi / N, at 8 and 1,024 GPUs."""
    monkeypatch.setattr(fake_step, "adamw_foreach", lambda device: foreach)
    fake_step.clear_cache()  # the same configuration, traced again on the other path
    clear_dtensor_sharding_cache()
    two_layers = dict(LLAMA_7_5B, num_hidden_layers=2)
    p = P.plan(write_config(tmp_path / "llama2", two_layers), gpus, 80 * 2**30, "full_shard", "bf16",
               "none", 1, 64, "cuda")
    psi = p.parameters_total
    assert states_total(p) == pytest.approx(16 * psi / gpus, rel=0.01)
    assert p.peak_bytes["optimizer"] == pytest.approx(8 * psi / gpus, rel=0.01)


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard"])
def test_other_strategies_match_their_formulas(strategy):
    """shard_grad_op keeps 16 Psi / N between steps and holds every unit unsharded at its peak
    (the bf16 copies FSDP adds: about 2 Psi); no_shard holds 16 Psi plus DDP's 4 Psi buckets."""
    clear_dtensor_sharding_cache()
    p = P.plan("llama-tiny", 8, 10**12, strategy, "bf16", "none", 2, 64, "cpu")
    psi = p.parameters_total
    formula = P.model_state_formulas(psi, strategy, 8)["fsdp2"]["total"]
    assert states_total(p) == pytest.approx(formula, rel=0.01)
    if strategy == "shard_grad_op":
        assert formula == pytest.approx(16 * psi / 8, rel=0.01)
        assert p.detail["unsharded_parameters"] == pytest.approx(2 * psi, rel=0.02)
    else:
        assert formula == 20 * psi


def test_eight_to_128_gpus_drops_what_the_sharded_state_arithmetic_says(tmp_path):
    """At a peak in the forward (gradients freed by zero_grad(set_to_none=True)), a rank holds its
    parameter shard and AdamW state: 12 bytes per parameter over N. The drop from 8 to 128 GPUs
    is that arithmetic, within 5%."""
    cfg = write_config(tmp_path / "llama4", dict(LLAMA_7_5B, num_hidden_layers=4))
    eight, many = (P.plan(cfg, n, 10**12, "full_shard", "bf16", "full", 2, 1024, "cuda")
                   for n in (8, 128))
    psi = eight.parameters_total
    assert eight.peak_bytes["gradients"] == 0
    drop = eight.peak_bytes["total"] - many.peak_bytes["total"]
    assert drop == pytest.approx(12 * psi * (1 / 8 - 1 / 128), rel=0.05)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_config_json_of_each_family_plans(tmp_path, family):
    """parameters_total is what transformers builds from the file; the block class comes from the
    model's _no_split_modules; the plan's states are the formula's."""
    import transformers

    folder = write_config(tmp_path / family, FAMILIES[family])
    spec = get_model_spec(folder)
    assert spec.block_class().__name__ == BLOCKS[family]
    config = transformers.AutoConfig.for_model(**FAMILIES[family])
    with torch.device("meta"):
        built = getattr(transformers, CLASSES[family])(config)
    assert spec.num_parameters == sum(p.numel() for p in built.parameters())
    p = P.plan(folder + "/config.json", 2, 10**12, "full_shard", "fp32", "none", 2, 32, "cpu")
    assert p.parameters_total == spec.num_parameters
    assert states_total(p) == pytest.approx(16 * spec.num_parameters / 2, rel=0.02)


def test_an_nn_module_factory_plans():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = nn.Linear(64, 64)

        def forward(self, x):
            return x + torch.relu(self.ff(x))

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(64, 100)

        def forward(self, input_ids, attention_mask=None, labels=None):
            x = self.embed(input_ids)
            for b in self.blocks:
                x = b(x)
            logits = self.head(x)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return type("Out", (), {"loss": loss})()

    spec = custom_model_spec("tiny", Tiny, Block, vocab_size=100, seq_len=16)
    p = P.plan(spec, 2, 10**12, "full_shard", "fp32", "none", 2, 16, "cpu")
    psi = sum(x.numel() for x in Tiny().parameters())
    assert p.parameters_total == psi and p.model == "tiny"
    assert states_total(p) == pytest.approx(16 * psi / 2, rel=0.02)


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ("{not json", "not a readable JSON file"),
    ('{"hidden_size": 64}', "no \"model_type\""),
    ('{"model_type": "no-such-family"}', "cannot be built"),
])
def test_a_config_it_cannot_build_is_one_line(tmp_path, content, says):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    proc = cli_here("plan", "--model", str(path), "--gpus", "2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error:") and proc.stderr.strip().count("\n") == 0
    assert says in proc.stderr and str(path) in proc.stderr


def test_a_bare_gpu_memory_number_is_refused():
    proc = cli_here("plan", "--gpu-memory", "80")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "'80'" in proc.stderr and "GiB" in proc.stderr
    with pytest.raises(UsageError):
        P.parse_memory("24e9")


def test_the_table_prints_the_formulas_beside_the_trace():
    text = plan_cli.format_plan(P.plan("llama-tiny", 2, 10**12, "full_shard", "fp32", "none", 1, 32, "cpu"))
    assert "FSDP2 formula" in text and "ZeRO paper" in text and "traced between steps" in text
    assert "GPU memory used" not in text


def test_max_batch_takes_three_traced_steps_on_a_line(monkeypatch):
    """Where memory is a line in the batch (a big model: 1 GiB fixed + 3 GiB per sample here),
    batches 1 and 2 draw it and the third plan checks the batch it names: 3 traced steps."""
    base = P.plan("llama-tiny", 2, 10**12, "full_shard", "fp32", "none", 1, 64, "cpu")
    traced = []

    def linear_plan(model, config, memory, **options):
        batch = config.batch
        traced.append(batch)
        total = 2**30 + 3 * 2**30 * batch
        budget = int(memory * 0.9)
        return P.Plan(**dict(base.as_dict(), batch=batch, budget_bytes=budget, fits=total <= budget,
                             peak_bytes=dict(base.peak_bytes, total=total)))

    monkeypatch.setattr(P, "plan", linear_plan)
    best, best_plan = P.largest_batch("x", 8, int((2**30 + 3 * 2**30 * 37.5) / 0.9))
    assert best == 37 and traced == [1, 2, 37] and "line through batches 1 and 2" in best_plan.notes[-1]


def test_max_batch_off_the_line_still_finds_the_edge(monkeypatch):
    """llama-tiny's peak is not quite a line in the batch: the search narrows by secant steps and
    returns a batch that fits while the next one does not, in a few traced steps."""
    traced = []
    real = P.plan
    monkeypatch.setattr(P, "plan", lambda *a, **k: traced.append(a[1].batch) or real(*a, **k))
    one, two = (real("llama-tiny", 2, 10**12, "full_shard", "fp32", "none", b, 64, "cpu") for b in (1, 2))
    slope = two.peak_bytes["total"] - one.peak_bytes["total"]
    memory = int((one.peak_bytes["total"] + 6.5 * slope) / 0.9)
    best, best_plan = P.largest_batch("llama-tiny", 2, memory, strategy="full_shard", precision="fp32",
                                      ac="none", seq=64, device_type="cpu")
    assert best_plan.fits and best_plan.batch == best and len(traced) <= 5
    assert not real("llama-tiny", 2, memory, "full_shard", "fp32", "none", best + 1, 64, "cpu").fits


def test_a_sweep_re_shards_by_arithmetic_exactly(monkeypatch):
    """A sweep traces no_shard once and full_shard / shard_grad_op at both ends; the counts between
    come from arithmetic, which matches a trace of the same count to the byte."""
    traced = []
    real = P.plan
    monkeypatch.setattr(plan_sweep, "plan", lambda *a, **k: traced.append(a[1]) or real(*a, **k))
    plans = plan_sweep.sweep("llama-tiny", gpu_counts=(2, 4, 8), gpu_memory_bytes=10**12, precision="fp32",
                    batch=2, seq=64, device_type="cpu")
    assert len(plans) == 9 and len(traced) == 5
    middle = next(p for p in plans if p.strategy == "full_shard" and p.gpus == 4)
    assert middle.method.startswith("re-sharded by arithmetic")
    assert middle.peak_bytes == real("llama-tiny", 4, 10**12, "full_shard", "fp32", "none", 2, 64,
                                     "cpu").peak_bytes
    text = plan_cli.format_sweep(plans)
    assert "full_shard" in text and max(len(line) for line in text.splitlines()[1:5]) <= 80


def test_plan_json_carries_the_predicted_time_and_refuses_bad_time_flags():
    """`fsdp-course plan --json` has `time` beside the memory (the step-time model's prediction,
    with its assumptions); the time flags answer bad values in one line."""
    proc = cli_here("plan", "--model", "llama-tiny", "--gpus", "16", "--gpu", "a100-80gb", "--batch",
                    "2", "--seq", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert set(p["time"]) >= {"step_s", "compute_s", "comm_s", "exposed_comm_s", "tokens_per_s_per_gpu",
                              "mfu", "assumptions"}
    assert p["time"]["gpu"] == "a100-80gb" and p["gpu_memory_bytes"] == 80 * 2**30
    assert p["time"]["step_s"] >= p["time"]["compute_s"] > 0
    for flag, value in (("--gpu", "h999"), ("--network-gbps", "nan"), ("--network-gbps", "-1"),
                        ("--gpus-per-node", "0")):
        bad = cli_here("plan", "--model", "llama-tiny", flag, value)
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and flag in bad.stderr


def test_a_sweep_prints_predicted_tokens_per_gpu_per_strategy():
    proc = cli_here("plan", "--model", "llama-tiny", "--sweep", "--batch", "2", "--seq", "64",
                    "--gpu-memory", "80GiB")
    assert proc.returncode == 0, proc.stderr
    assert "PREDICTED" in proc.stdout and proc.stdout.count("full_shard") == 2
    assert max(len(line) for line in proc.stdout.splitlines() if not line.startswith("method")) <= 100


# -- a config file is checked before it is planned -----------------------------------------------

def _refusal(tmp_path, values: dict, *flags: str) -> str:
    """The one line ``plan --model`` answers a config with (exit 2, nothing on stdout)."""
    proc = cli_here("plan", "--model", write_config(tmp_path, values) + "/config.json", "--gpus", "2",
                    "--no-time", *flags)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr.startswith("error:") and proc.stderr.strip().count("\n") == 0, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("family, names", [
    ("llama", "hidden_size, num_hidden_layers, num_attention_heads, vocab_size, intermediate_size"),
    ("gpt2", "n_embd, n_layer, n_head, vocab_size, n_inner"),
    ("t5", "d_model, num_layers, num_heads, vocab_size, d_ff"),
])
def test_a_config_without_its_sizes_is_refused_naming_its_familys_fields(tmp_path, family, names):
    """A config naming only its family is refused: planned with transformers' defaults, a typo in
    every key would give a confident plan of a model nobody wrote."""
    err = _refusal(tmp_path, {"model_type": family, "hidden_sise": 64})
    assert f"none of the sizes a {family} model needs ({names})" in err


def test_a_config_missing_some_sizes_says_which_were_defaulted(tmp_path):
    values = {k: v for k, v in FAMILIES["qwen2"].items() if k != "intermediate_size"}
    p = P.plan(write_config(tmp_path, values), 2, 10**12, "full_shard", "fp32", "none", 1, 16, "cpu")
    defaulted = [w for w in p.warnings if "intermediate_size" in w]
    assert len(defaulted) == 1 and "does not give intermediate_size" in defaulted[0]
    assert f"intermediate_size={transformers.Qwen2Config().intermediate_size}" in defaulted[0]
    assert "warning: " + defaulted[0] in plan_cli.format_plan(p)
    complete = P.plan(write_config(tmp_path / "all", FAMILIES["qwen2"]), 2, 10**12, "full_shard",
                      "fp32", "none", 1, 16, "cpu")
    assert complete.warnings == []


def test_an_unknown_model_type_names_a_few_close_ones(tmp_path):
    """It printed the 822 types transformers knows on one line of 12,001 characters."""
    err = _refusal(tmp_path, {"model_type": "lama", "hidden_size": 64})
    assert "'lama' is not one transformers" in err and "the closest: llama" in err
    assert len(err) < 300 and err.count(",") <= 3
    assert "the closest" not in _refusal(tmp_path / "x", {"model_type": "zzzzqqqq"})


@pytest.mark.parametrize("field, value, allowed", [
    ("hidden_size", 0, "integers >= 1"),  # was a ZeroDivisionError about negative powers
    ("num_hidden_layers", -2, "integers in [1, 256]"),  # was "no repeated transformer block"
    ("num_attention_heads", "4", "integers >= 1"),
    ("vocab_size", 1.5, "integers >= 1"),
    ("num_hidden_layers", 200_000, "integers in [1, 256]"),  # was minutes of building
])
def test_a_size_no_model_has_names_the_field_and_what_is_allowed(tmp_path, field, value, allowed):
    err = _refusal(tmp_path, dict(FAMILIES["qwen2"], **{field: value}))
    assert f"{field} {value!r} is not allowed; allowed: {allowed}" in err


def test_a_gpt2_layer_count_is_checked_under_gpt2s_name(tmp_path):
    err = _refusal(tmp_path, dict(FAMILIES["gpt2"], n_layer=-1))
    assert "n_layer -1 is not allowed" in err


def test_a_sequence_past_the_context_is_warned_and_one_no_gpu_holds_is_refused(tmp_path):
    folder = write_config(tmp_path, FAMILIES["qwen2"])  # max_position_embeddings 256
    p = P.plan(folder, 2, 10**12, "full_shard", "fp32", "none", 1, 512, "cpu")
    assert any("--seq 512 is past the model's context (max_position_embeddings 256)" in w
               for w in p.warnings)
    assert not P.plan(folder, 2, 10**12, "full_shard", "fp32", "none", 1, 256, "cpu").warnings
    err = _refusal(tmp_path, FAMILIES["qwen2"], "--seq", "1000000000")
    assert "--seq 1000000000 is not allowed" in err and "more than any GPU holds" in err
    assert "allowed: batch x seq <=" in err


@pytest.mark.parametrize("flag", ["--gpus", "--batch", "--seq"])
def test_a_twenty_digit_size_is_one_line(flag):
    proc = cli_here("plan", "--model", "llama-tiny", "--no-time", flag, "9" * 20)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert flag in proc.stderr and "9" * 20 in proc.stderr


def test_a_throughput_is_never_printed_as_0_beside_an_mfu():
    from utilities.text import rate_text

    assert rate_text(0.004) == "0.004" and rate_text(12.345) == "12.3" and rate_text(123456) == "123,456"
    time = {"step_s": 250.0, "compute_s": 250.0, "comm_s": 0.0, "exposed_comm_s": 0.0,
            "tokens_per_s_per_gpu": 0.4, "mfu": 0.59, "assumptions": []}
    assert "tokens/s per GPU 0.4, MFU 59.0%" in plan_cli.format_time(time)
