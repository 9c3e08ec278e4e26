"""The names the classic FSDP tutorials had users import behave as that code expects.

The classic idiom is ``if verify_bfloat_support: mp_policy = bfSixteen`` with ``verify_bfloat_support``
a module-level bool (a function there would always be truthy). These tests use the classic lines
literally, on this machine and on faked GPUs.
"""

from __future__ import annotations

import pytest
import torch

import utilities
import utilities.bf16 as B
from utilities import Memory_Maximizer, verify_bfloat_support


def _fake_gpu(monkeypatch, capability: tuple[int, int], cuda: str | None = "12.4") -> None:
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(B, "nccl_version", lambda: (2, 21, 5))


def _classic_pick():
    """The classic tutorial's lines, verbatim in spirit: a bool test, then a policy name."""
    from utilities import bfSixteen, fp32_policy

    if verify_bfloat_support:
        return bfSixteen
    return fp32_policy


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_classic_if_is_false_on_this_cpu_build():
    assert not verify_bfloat_support
    assert verify_bfloat_support() is False  # today's callable use still works
    assert verify_bfloat_support == False  # noqa: E712 - the classic code may compare to a bool
    assert _classic_pick() is utilities.fp32_policy


@pytest.mark.parametrize("capability, cuda, ready", [
    ((7, 0), "12.4", False),   # V100: emulated bf16 only
    ((7, 5), "12.4", False),   # T4
    ((8, 0), "12.4", True),    # A100
    ((9, 0), "12.4", True),    # H100
    ((9, 0), None, False),     # a CPU build of torch
])
def test_both_uses_agree_with_bf16_ready(monkeypatch, capability, cuda, ready):
    _fake_gpu(monkeypatch, capability, cuda)
    assert bool(verify_bfloat_support) is ready
    assert verify_bfloat_support() is ready
    assert _classic_pick() is (utilities.bfSixteen if ready else utilities.fp32_policy)
    assert str(ready) in repr(verify_bfloat_support)


def test_it_is_asked_now_not_at_import(monkeypatch):
    """The answer follows the process's device: a value frozen at import would not."""
    _fake_gpu(monkeypatch, (8, 0))
    assert verify_bfloat_support
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    assert not verify_bfloat_support


def test_classic_policy_names_have_the_tutorial_dtypes():
    from torch.distributed.fsdp import MixedPrecision

    bf, fp, f32 = torch.bfloat16, torch.float16, torch.float32
    expected = {
        "fpSixteen": (fp, fp, fp),
        "bfSixteen": (bf, bf, bf),
        "bfSixteen_working": (f32, bf, bf),
        "fp32_policy": (f32, f32, f32),
    }
    for name, dtypes in expected.items():
        policy = getattr(utilities, name)
        assert isinstance(policy, MixedPrecision), name
        assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == dtypes, name
        assert name in utilities.__all__
        from utilities import precision
        assert getattr(precision, name) is policy


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_classic_policy_wraps_a_model_with_fsdp1(world1):
    """``FSDP(model, mixed_precision=fp32_policy)``, as the tutorial wrote it, runs a step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(torch.nn.Linear(4, 4), mixed_precision=utilities.fp32_policy,
                 device_id=torch.device("cpu"))  # the tutorial ran on GPUs; CPU needs the id
    model(torch.randn(2, 4)).sum().backward()
    assert model.mixed_precision.param_dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_memory_maximizer_classic_calls_on_cpu(capsys, monkeypatch):
    """The classic usage: ``Memory_Maximizer()``, ``start()``, ``update()``, ``stop(verbose=...)``,
    ``summary()``, and its ``m_*`` attributes read after training."""
    monkeypatch.setattr(Memory_Maximizer, "_said_no_gpu", False)  # as in a fresh process
    memmax = Memory_Maximizer()
    memmax.start()
    memmax.update()
    memmax.stop(verbose=True)
    memmax.stop()
    memmax.summary()
    assert memmax.m_num_retries == 0 and memmax.m_cuda_ooms == 0 and memmax.m_total_ooms == 0
    assert memmax.m_reserved_memory_list == [] and memmax.m_max_reserved == 0
    assert memmax.m_total_gpu_memory == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1  # "no CUDA GPU", said once


def test_memory_maximizer_classic_stop_and_attributes_with_a_fake_gpu(fake_allocator, capsys):
    import utilities.memory_maximizer as M

    stats = fake_allocator([1, 2], max_reserved_gib=2, retries=1)
    memmax = M.Memory_Maximizer(verbose=False)
    memmax.start()
    memmax.update()
    memmax.update()
    stats["num_alloc_retries"] = 4
    memmax.stop(verbose=True)  # the classic signature: prints even though verbose=False above
    out = capsys.readouterr().out
    assert "cudaMalloc retries: 3" in out and "every update (GB): [1.0, 2.0]" in out
    assert memmax.m_num_retries == 3 and memmax.m_reserved_memory_list == [1.0, 2.0]
    assert memmax.m_total_gpu_memory == 80.0 and memmax.m_max_reserved == 2.0


def test_every_public_name_imports_and_the_command_starts_without_torch():
    """``from utilities import *`` gives every name in ``__all__`` (they load on first use), and
    ``python -m utilities`` plans a CPU launch without importing torch (seconds per command)."""
    import subprocess
    import sys

    namespace: dict = {}
    exec("from utilities import *", namespace)
    assert set(utilities.__all__) <= set(namespace) and set(utilities.__all__) == set(utilities._EXPORTS)
    with pytest.raises(AttributeError, match="no attribute 'Memory_Maximiser'"):
        utilities.Memory_Maximiser  # noqa: B018
    code = ("import sys; from utilities.course import cli; cli._parser(); "
            "cli.decide_launch(None, cli.resolve_device('cpu')); cli.get_model_spec('t5-tiny'); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
