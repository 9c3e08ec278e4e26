"""MFU is computed against the right GPU's peak: exact names, never a substring match."""

from __future__ import annotations

import pytest
import torch

from utilities import training


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),   # SXM
    ("NVIDIA H100 PCIe", 756e12),        # once given the SXM peak through "H100" in the name
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A10G", None),               # not an A10: unknown, so no MFU rather than a wrong one
    ("Some Future GPU", None),
])
def test_peak_flops_by_exact_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert training.peak_flops(torch.device("cuda", 0)) == peak


def test_no_peak_on_cpu():
    assert training.peak_flops(torch.device("cpu")) is None
