"""The GPU catalogue and the time model's fitted constants.

``GPUS`` / ``get_gpu(name)``: each GPU part's datasheet peaks, HBM and link bandwidth
(``GPU.memory_bytes`` for a memory plan). ``Efficiencies``: the fractions of those peaks kernels
and NCCL reach, with ``CALIBRATED`` the set fitted by ``benchmarks/time_model_check.py --fit``
(``Efficiencies.per_gpu``: a part's own tensor-core fraction). The host side of ``--offload``:
``PCIE_BYTES_PER_S`` and ``HOST_ADAMW_PARAMS_PER_S``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from utilities.errors import bad_value


@dataclass(frozen=True)
class GPU:
    """One GPU part: what the time model needs, dense (not 2:4 sparse) datasheet peaks."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]  # dense FLOP/s: "fp32", "tf32", "bf16", "fp8" (absent: no FP8)
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # per GPU, one direction, to the other GPUs of its node
    link: str  # "NVLink" or "PCIe"
    source: str
    clock_factor: float = 1.0  # sustained tensor-core clock vs the datasheet's, where it is capped
    notes: tuple[str, ...] = ()


_H100_PEAKS = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp8": 1978.9e12}


_A100_PEAKS = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12}


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100", 81559 * 2**20, _H100_PEAKS, 3.35e12, 450e9, "NVLink",
        "NVIDIA H100 SXM5 80GB datasheet (dense peaks: the datasheet's sparse figures / 2; NVLink "
        "900 GB/s total = 450 GB/s each way); memory as nvidia-smi reports it"),
    GPU("h100-96gb", 96 * 10**9, _H100_PEAKS, 2.4e12, 450e9, "NVLink",
        "H100 96GB HBM2e (torchtitan's Grand Teton part, anchors.md): 96 GB, 2.4 TB/s, 500 W "
        "power limit; peaks and NVLink as the NVIDIA H100 SXM5 datasheet (what it sustains at "
        "500 W: CALIBRATED.per_gpu, fitted on torchtitan's runs on it)"),
    GPU("h200", 143771 * 2**20, _H100_PEAKS, 4.8e12, 450e9, "NVLink",
        "NVIDIA H200 SXM datasheet (141 GB HBM3e, 4.8 TB/s, dense peaks as H100 SXM, NVLink "
        "900 GB/s total)"),
    GPU("a100-80gb", 81920 * 2**20, _A100_PEAKS, 2.039e12, 300e9, "NVLink",
        "NVIDIA A100 SXM4 80GB datasheet (2,039 GB/s, NVLink 600 GB/s total); no FP8"),
    GPU("a100-40gb", 40960 * 2**20, _A100_PEAKS, 1.555e12, 300e9, "NVLink",
        "NVIDIA A100 SXM4 40GB datasheet (1,555 GB/s, NVLink 600 GB/s total); no FP8"),
    GPU("l4", 23034 * 2**20, {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp8": 242e12},
        300e9, 32e9, "PCIe",
        "NVIDIA L4 datasheet (24 GB GDDR6, 300 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s total)"),
)}


def get_gpu(name: str | GPU) -> GPU:
    if isinstance(name, GPU):
        return name
    key = str(name).strip().lower()
    if key not in GPUS:
        raise bad_value("--gpu", name, GPUS)
    return GPUS[key]


@dataclass(frozen=True)
class Efficiencies:
    """The fractions of the datasheet peaks that kernels reach, and the interconnect's constants.
    One set for every model, GPU and configuration."""

    matmul: float  # GEMMs, fraction of the dense peak of their dtype
    attention: float  # fused (flash) attention, fraction of the bf16 dense peak
    memory: float  # memory-bound ops, fraction of the HBM bandwidth
    compile_memory: float  # torch.compile: memory-bound time left after fusion (fraction)
    fp8_matmul: float  # Float8 GEMMs, fraction of the FP8 dense peak
    kernel_floor_s: float  # the shortest kernel: launch and tail, or eager PyTorch's issue time
    link: float  # NCCL bus bandwidth / link bandwidth, inside a node
    network: float  # the same across nodes
    base_latency_s: float  # per collective
    hop_latency_link_s: float  # per ring step inside a node
    hop_latency_network_s: float  # per ring step when the ring spans nodes
    unit_overhead_s: float = 0.0  # FSDP's per-unit hooks, per forward and backward of each unit
    compile_floor_s: float = 2e-6  # torch.compile: the shortest fused kernel (one per run of ops)
    hop_latency_pcie_s: float = 5.7e-6  # per ring step inside a node over PCIe
    net_overhead_s: float = 3e-6  # least time per intra-node step of a ring that spans nodes
    tree_latency_link_s: float = 4.0e-6  # per tree level inside a node (all-reduce)
    tree_latency_network_s: float = 14e-6  # per tree level across nodes (all-reduce)
    per_gpu: dict[str, dict[str, float]] = field(default_factory=dict, compare=False)
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def part(self, name: str) -> dict[str, float]:
        """``per_gpu``'s entry for part ``name`` (an extrapolated part's: its source part's)."""
        return dict(self.per_gpu.get(name, self.per_gpu.get(_EXTRAPOLATED_FROM.get(name, ""), {})))

    def for_gpu(self, name: str) -> Efficiencies:
        """The efficiencies on one GPU part. ``per_gpu[name]["tensor"]`` scales the tensor-core
        fractions (matmul, attention, fp8_matmul: the clock and power the part sustains against
        the reference H100 SXM's); its other keys replace fields outright."""
        over = self.part(name)
        if not over:
            return self
        t = over.pop("tensor", 1.0)
        changes = {"matmul": self.matmul * t, "attention": self.attention * t,
                   "fp8_matmul": self.fp8_matmul * t}
        changes.update(over)
        return replace(self, per_gpu={}, **changes)


# Parts without a published run of their own take another part's efficiencies (assumptions, say so)
_EXTRAPOLATED_FROM = {"a100-40gb": "a100-80gb"}


CALIBRATED = Efficiencies(
    matmul=0.626,
    attention=0.35,
    memory=0.95,
    compile_memory=0.239,
    fp8_matmul=0.518,
    kernel_floor_s=1.66e-5,
    link=370 / 450,
    network=0.80,
    base_latency_s=8.4e-6,
    hop_latency_link_s=3.4e-6,
    hop_latency_network_s=14e-6,
    unit_overhead_s=1.89e-3,
    compile_floor_s=0.5e-6,
    hop_latency_pcie_s=5.7e-6,
    net_overhead_s=3e-6,
    tree_latency_link_s=4.0e-6,
    tree_latency_network_s=14e-6,
    per_gpu={
        "h100-96gb": {"tensor": 0.834},
        "h200": {"tensor": 1.09},
        "a100-80gb": {"tensor": 1.19, "attention": 0.62, "link": 240 / 300},
    },
    sources={
        "matmul, memory, compile_memory, compile_floor_s, fp8_matmul, kernel_floor_s, "
        "unit_overhead_s, per_gpu tensor": "fitted by `python benchmarks/time_model_check.py "
        "--fit` from the fixed starting values in benchmarks/time_model_rows.json, on its rows "
        "marked fit only (least squares of log(predicted / published), and of the compile and "
        "Float8 effects of the matched pairs among them); the held-out rows are never read by the "
        "fit (benchmarks/results/time_model_check.json)",
        "per-GPU parts": "H100 SXM (h100) is the reference part: the course's plain-loop H100 runs "
        "and accelerate's 8x H100 SXM pair; h100-96gb (500 W): its tensor-core fraction fitted on "
        "torchtitan's Table 1 (8 GPUs) and torchao's pair; h200: fitted on Trainy's 4-node "
        "torchtitan run; a100-80gb: fitted on fms-fsdp's 128-A100 Llama 2 7B run; a100-40gb: "
        "extrapolated (a100-80gb's); l4: extrapolated (H100 SXM's)",
        "attention": "not fitted: FlashAttention-2 on H100 reaches about 350 of 989 TFLOP/s "
        "(the FlashAttention-3 paper's FA2 baseline, head dim 128); on A100 0.62, the middle of "
        "the FlashAttention-2 paper's 50-73% of the A100's peak (forward + backward)",
        "link": "NCCL's NVLink bus bandwidth (nccl src/graph/topo.h: 20.6 GB/s per link on sm90 x "
        "18 links = 370 GB/s of H100's 450; 20.0 x 12 = 240 GB/s of A100's 300)",
        "network": "assumed: 80% of the NIC's line rate for large messages",
        "latencies": "NCCL's Simple-protocol tuning constants (nccl src/graph/tuning.cc): base 8.4 "
        "us; ring 3.4 us per NVLink step, 5.7 us per PCIe step, 14 us per network step, network "
        "steps nNodes - 1 per ring (2 (nNodes - 1) for all-reduce), intra-node steps at least "
        "3 x the 1 us network overhead on a ring that spans nodes; tree (all-reduce only) 4.0 us "
        "per NVLink level, 14 us per network level, bandwidth x 0.92 x 1/2",
    },
)


# Host-device bandwidth per GPU, one direction: the PCIe link of the part (datasheet, theoretical).
PCIE_BYTES_PER_S = {"h100": 64e9, "h100-96gb": 64e9, "h200": 64e9, "a100-80gb": 32e9,
                    "a100-40gb": 32e9, "l4": 32e9}


PCIE_SOURCE = "PCIe Gen5 x16 (H100, H200) / Gen4 x16 (A100, L4): 64 / 32 GB/s each way per GPU"


# AdamW on the host, parameters per second per rank: torch.optim.AdamW (foreach=False, the default
# for CPU tensors) on ONE thread, because torchrun sets OMP_NUM_THREADS=1 for each process when
# --nproc-per-node > 1 (torch/distributed/run.py). Measured, not assumed: 64 M parameters in 64
# tensors, the best of 3 builds' median step, AMD EPYC (Zen 5) KVM guest, torch 2.13
# (benchmarks/plan_options_check.py --only host_adamw: fp32 0.325-0.34 G/s, bf16 0.80 G/s). A host
# with more threads per rank (OMP_NUM_THREADS set) is faster until the node's DRAM bandwidth binds.
HOST_ADAMW_PARAMS_PER_S = {"fp32": 0.33e9, "bf16": 0.80e9}


HOST_ADAMW_SOURCE = ("torch.optim.AdamW on one CPU thread per rank (torchrun's OMP_NUM_THREADS=1), "
                     "measured on an AMD EPYC (Zen 5) core, torch 2.13: "
                     + ", ".join(f"{k} {v / 1e9:.2f} G parameters/s"
                                 for k, v in HOST_ADAMW_PARAMS_PER_S.items()))


def efficiency_note(name: str) -> str:
    """Where this part's efficiencies come from: its own published runs, or another part's."""
    if name in CALIBRATED.per_gpu:
        return (f"efficiencies for {name}: the reference H100 SXM fractions with this part's own, "
                "fitted on its published runs (CALIBRATED.per_gpu)")
    if name in _EXTRAPOLATED_FROM:
        return (f"efficiencies for {name}: extrapolated, {_EXTRAPOLATED_FROM[name]}'s (no published "
                "run of this part in the check)")
    if name == "h100":
        return "efficiencies for h100: the reference part, fitted on published H100 SXM runs"
    return (f"efficiencies for {name}: extrapolated, H100 SXM's (no published run of this part in "
            "the check)")


def with_efficiencies(eff: Efficiencies, **changes) -> Efficiencies:
    """A copy of ``eff`` with some fields changed (what a calibration run produces)."""
    return replace(eff, **changes)
