"""The hardware catalog: memory, dense peak FLOP/s per dtype, bandwidths and node size.

Numbers are the vendors' data-sheet values for dense math (no 2:4 sparsity). Link bandwidths
are per device and per direction, which is what a ring collective's time is proportional to
(NCCL's "bus bandwidth"). Achieved fractions of these peaks (`*_eff`) are the planner's
calibration: for GPUs the defaults below are typical of large bf16 GEMMs and NCCL rings
(cuBLAS reaches ~70% of dense peak on LLM-sized GEMMs; nccl-tests ~80% of link bandwidth);
`cpu` measures its own on the spot (calibrate.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass

from shardwise.errors import ConfigError
from shardwise.plan.calibrate import calibration, ram_bytes

GiB = 2**30
GB = 10**9


@dataclass(frozen=True)
class Hardware:
    name: str
    memory: int  # bytes of device memory
    peak: dict[str, float]  # dense FLOP/s by compute dtype (fp32 = non-tensor-core FP32)
    hbm_bw: float  # bytes/s device memory bandwidth
    intra_bw: float  # bytes/s per device per direction inside a node (NVLink, IF, PCIe)
    inter_bw: float  # bytes/s per device per direction between nodes (IB / RoCE NIC)
    host_bw: float  # bytes/s device <-> host (PCIe), for offload
    per_node: int  # devices per node
    host_memory: int  # bytes of host memory per device (a node's RAM / per_node)
    host_mem_bw: float = 25e9  # bytes/s of host RAM per device (a ~200 GB/s server / 8)
    # bytes/s of local disk per device for optimizer+nvme: an assumption, not measured (one
    # PCIe 4 NVMe drive's ~6-7 GB/s shared by the 8 devices of a node, rounded down)
    disk_bw: float = 1e9
    # bytes of local disk (NVMe) per device that optimizer+nvme / params+nvme may fill: none
    # unless declared (--hardware.nvme_bytes=...), and the search then leaves them out
    nvme_bytes: int = 0
    matmul_eff: float = 0.7  # achieved / peak for a training step's compute
    comm_eff: float = 0.8  # achieved / peak link bandwidth for ring collectives
    mem_eff: float = 0.8  # achieved / peak memory bandwidth for element-wise kernels
    overlap: float = 1.0  # fraction of communication that can hide behind compute
    reserve: int = 2 * GiB  # CUDA context, cuBLAS workspace, allocator fragmentation
    # device bytes NCCL allocates for each communicator a rank uses (its channels' buffers,
    # outside PyTorch's allocator), after one all-reduce, measured on four A100s over NVLink
    # with PyTorch (NVIDIA/nccl issue #964): 688 MB a group of more than two ranks, 544 MB a
    # pair. NCCL's maintainers (NVIDIA/nccl #864, #986): linear in the channels, no larger beyond
    # two nodes. 0 on CPUs (gloo's buffers are host memory)
    comm_buffer_bytes: int = 0
    pair_buffer_bytes: int = 0
    cores: int = 0  # CPU: ranks beyond this many share cores (0 = a device per rank)
    memory_shared: bool = False  # CPU: all ranks of a node share `memory` (RAM)
    calibrated: str = "data sheet"
    eff: dict[str, float] | None = None  # per-precision compute efficiency (calibrated CPUs)
    # fixed seconds per transformer layer per micro-batch (forward + backward): eager PyTorch
    # launches ~60 kernels at ~5 us each on a GPU; measured on CPUs
    block_overhead: float = 3e-4
    # seconds every collective call costs whatever its size (the alpha of an alpha-beta
    # model): nccl-tests' small-message all-reduce inside a node is ~10-20 us; measured on CPUs
    latency: float = 2e-5
    # seconds per step of a ring that spans nodes, whatever the message size: an all-gather or
    # reduce-scatter over n ranks on k nodes takes n - 1 steps, k - 1 of them between nodes (an
    # all-reduce twice as many). NCCL's own tuning model (src/graph/tuning.cc, `hwLat`, ring,
    # Simple protocol: the large messages of training) charges 9.6 us a step through the
    # network and 3.4 us a step over NVLink. Not fitted: the calibration rows run on one node,
    # where the per-call `latency` covers the ring
    hop_s: float = 9.6e-6
    nvlink_hop_s: float = 3.4e-6
    # host seconds to launch one small kernel from eager PyTorch (dispatch + cudaLaunchKernel),
    # where a framework launches one per rank (peers.Deviations.list_all_gather): ~5 us, the same
    # figure as `block_overhead`'s; an assumption, not fitted
    launch_s: float = 5e-6
    # cost per ring byte of a collective kind ("reduce_scatter", "all_gather", "send")
    # relative to an all-reduce's (absent = 1, the ring model's NCCL): gloo's reduce-scatter
    # and all-gather cost more per byte than its all-reduce, measured on CPUs (calibrate.py)
    collective_cost: dict[str, float] = dataclasses.field(default_factory=dict)
    # CPU calibrated on the spot: time the real modules at each layout's shapes (kernels.py)
    # instead of dividing FLOPs by one rate
    measured_kernels: bool = False
    # GPUs: price each kernel of a block (plan/gpu.py) with these; CPUs use one rate per block
    kernel_model: bool = False
    attn_eff: float = 0.5  # achieved / peak of a fused (flash) attention kernel
    kernel_s: float = 5e-6  # fixed seconds per kernel: launch and the last partial wave
    # how many times longer the unfused attention's 16-bit batched GEMMs take when the head
    # dim is not a multiple of 8 elements (16 bytes: NVIDIA's Tensor Core alignment) than the
    # aligned ones; 1 = not priced (fitted where a source measured it: published_runs.py)
    misaligned_slowdown: float = 1.0

    def slowdown(self, devices: int) -> float:
        """How many times slower each rank computes when a job's `devices` ranks of a node
        share this CPU's cores (1 where every rank has a device of its own)."""
        return max(1.0, min(devices, self.per_node) / self.cores) if self.cores else 1.0

    def flops(self, precision: str) -> float:
        """Achieved FLOP/s of training compute in `precision` (peak x efficiency)."""
        eff = self.eff.get(precision, self.matmul_eff) if self.eff else self.matmul_eff
        return self.peak[precision] * eff

    def with_overrides(self, **kw: object) -> Hardware:
        return dataclasses.replace(self, **kw)  # type: ignore[arg-type]


def _gpu(
    name, mem_gib, bf16, fp32, hbm_tbs, intra_gbs, inter_gbs, host_gbs, per_node, host_gib, fp8=0
):
    peak = {"bf16": bf16 * 1e12, "fp16": bf16 * 1e12, "fp32": fp32 * 1e12}
    if fp8:  # only cards with FP8 tensor cores have the key (precision.fp8 needs it)
        peak["fp8"] = fp8 * 1e12
    return Hardware(
        name=name,
        memory=int(mem_gib * GiB),
        peak=peak,
        hbm_bw=hbm_tbs * 1e12,
        intra_bw=intra_gbs * GB,
        inter_bw=inter_gbs * GB,
        host_bw=host_gbs * GB,
        per_node=per_node,
        host_memory=int(host_gib * GiB),
        kernel_model=True,
        comm_buffer_bytes=688 * 10**6,
        pair_buffer_bytes=544 * 10**6,
    )


# name: memory GiB, bf16 TF, fp32 TF, HBM TB/s, intra GB/s, inter GB/s, host GB/s, per node,
# host GiB per device. Sources: NVIDIA A100/H100/H200/HGX B200/L40S data sheets, the Ada and
# Ampere GeForce whitepapers (tensor FP16 with FP32 accumulate), AMD MI300X data sheet.
# The last number where a card has FP8 tensor cores: dense FP8 TF/s with FP32 accumulate from
# the same data sheets (H100 SXM and H200 1979, H100 PCIe 1513, B200 4500, L40S 733, RTX 4090
# 330 (GeForce: half rate with FP32 accumulate), MI300X 2615); A100 and RTX 3090 have none.
# Inter-node: one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100 and later) NIC per GPU, as in
# NVIDIA's DGX reference designs; PCIe parts: 100-200 Gb/s per GPU.
CATALOG: dict[str, Hardware] = {
    h.name: h
    for h in (
        _gpu("a100-40gb", 40, 312, 19.5, 1.555, 300, 25, 32, 8, 128),
        _gpu("a100-80gb", 80, 312, 19.5, 2.039, 300, 25, 32, 8, 256),
        _gpu("h100-sxm", 80, 989, 67, 3.35, 450, 50, 64, 8, 256, fp8=1979),
        _gpu("h100-pcie", 80, 756, 51, 2.0, 64, 25, 64, 8, 256, fp8=1513),
        _gpu("h200", 141, 989, 67, 4.8, 450, 50, 64, 8, 256, fp8=1979),
        _gpu("b200", 180, 2250, 75, 8.0, 900, 50, 64, 8, 512, fp8=4500),
        _gpu("l40s", 48, 362, 91.6, 0.864, 32, 12.5, 32, 8, 128, fp8=733),
        _gpu("rtx4090", 24, 165, 82.6, 1.008, 25, 12.5, 25, 1, 64, fp8=330),
        _gpu("rtx3090", 24, 71, 35.6, 0.936, 25, 12.5, 25, 1, 64),
        _gpu("mi300x", 192, 1307, 163.4, 5.3, 448, 50, 64, 8, 256, fp8=2615),
    )
}
# The kernel model's parameters (plan/gpu.py) fitted on the published runs' calibration subset:
# llm-foundry's single-node rows, Korthikanti et al.'s 22B rows and shardwise's own H200 run,
# each source weighted the same (`benchmarks/published_runs.py --calibrate`, 2026-11-27; every
# other published row is held out). Without the H200 run the H100 rows leave memory efficiency
# and the cost per kernel traded off (fits within 0.004 of each other put that run 3-36 % slow;
# benchmarks/history/published_runs.md, 2026-11-27).
# H100-PCIe and H200 are the H100's chip (GH100): its fit. Other GPUs keep the
# data-sheet defaults. The A100's `misaligned_slowdown` is fitted on one named pair of BLOOM
# runs (published_rows.MISALIGNED_PAIR: 13824 wide, 128 heads of 108 against 96 of 144, one
# layout, x1.30 the step); no source measures it on an H100, where it stays unpriced (1).
FITTED = {
    "a100": dict(
        matmul_eff=0.70, attn_eff=0.30, mem_eff=0.80, kernel_s=6.1e-5, misaligned_slowdown=12.8
    ),
    "h100": dict(matmul_eff=0.56, attn_eff=0.18, mem_eff=0.52, kernel_s=1.2e-5),
}
CHIP = {  # catalog entry -> the fit it uses
    "a100-40gb": "a100",
    "a100-80gb": "a100",
    "h100-sxm": "h100",
    "h100-pcie": "h100",
    "h200": "h100",
}
for _name, _chip in CHIP.items():
    CATALOG[_name] = CATALOG[_name].with_overrides(
        **FITTED[_chip], calibrated=f"fitted to published runs ({_chip})"
    )
ALIASES = {
    "a100": "a100-80gb",
    "h100": "h100-sxm",
    "4090": "rtx4090",
    "3090": "rtx3090",
    "mi300": "mi300x",
}


# fields a `--hardware.FIELD=0` override may zero: no overlap, no reserve, no core limit, no
# NCCL buffers
ZERO_OK = ("overlap", "reserve", "cores", "comm_buffer_bytes", "pair_buffer_bytes")


def hardware_names() -> list[str]:
    return [*CATALOG, "cpu"]


def get_hardware(name: str, calibrate: bool = True) -> Hardware:
    """The catalog entry for `name` (case-insensitive; `cpu` is measured on this machine)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key == "cpu":
        return cpu_hardware(measure=calibrate)
    if key not in CATALOG:
        close = difflib.get_close_matches(key, hardware_names(), n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"unknown hardware '{name}'.{hint} Fix: one of {', '.join(hardware_names())}."
        )
    return CATALOG[key]


def detect_hardware() -> Hardware:
    """The hardware this process runs on: a catalog GPU by its CUDA name, else `cpu`."""
    import torch

    if not torch.cuda.is_available():
        return get_hardware("cpu")
    name = torch.cuda.get_device_name(0).lower().replace(" ", "")
    table = (
        ("h200", "h200"),
        ("h100pcie", "h100-pcie"),
        ("h100", "h100-sxm"),
        ("b200", "b200"),
        ("a100", "a100-80gb"),
        ("l40s", "l40s"),
        ("4090", "rtx4090"),
        ("3090", "rtx3090"),
        ("mi300", "mi300x"),
    )
    for needle, key in table:
        if needle in name:
            hw = CATALOG[key]
            total = torch.cuda.get_device_properties(0).total_memory
            return hw.with_overrides(memory=total, per_node=torch.cuda.device_count())
    raise ConfigError(
        f"GPU '{torch.cuda.get_device_name(0)}' is not in the planner's catalog. Fix: plan "
        f"with --hardware <one of {', '.join(CATALOG)}> and pass the chosen layout explicitly."
    )


def cpu_hardware(measure: bool = True, refresh: bool = False) -> Hardware:
    """This machine's CPU as planner hardware: one rank per core at one thread, all ranks on
    one node sharing its RAM. Rates are measured; the compute efficiency is a whole block's
    achieved FLOP/s over the matmul rate; communication and memory efficiencies are 1."""
    c = (
        calibration(refresh)
        if measure
        else {"fp32": 5e10, "bf16": 5e9, "fp16": 5e9, "mem_bw": 5e9, "gloo_bw": 5e8}
    )
    eff = {"fp32": c.get("eff_fp32", 0.5), "bf16": c.get("eff_bf16", 0.5)}
    eff["fp16"] = eff["bf16"]
    ram = ram_bytes()
    return Hardware(
        name="cpu",
        memory=ram,
        peak={k: c[k] for k in ("fp32", "bf16", "fp16")},
        hbm_bw=c["mem_bw"],
        intra_bw=c["gloo_bw"],
        inter_bw=c["gloo_bw"],
        host_bw=c["mem_bw"],
        per_node=1 << 16,  # every rank runs on this machine
        host_memory=ram,
        host_mem_bw=c["mem_bw"],
        matmul_eff=eff["fp32"],
        eff=eff,
        block_overhead=c.get("block_overhead", 1e-3),
        # a call's cost as the ranks meet it, arriving from compute (calibrate._loaded_sync)
        latency=c.get("gloo_sync", c.get("gloo_latency", 1e-4)),
        collective_cost={
            "reduce_scatter": c.get("gloo_rs_cost", 1.0),
            "all_gather": c.get("gloo_ag_cost", 1.0),
        },
        comm_eff=1.0,
        mem_eff=1.0,
        # The ranks keep every core busy computing: gloo's transfer threads get no spare core,
        # so nothing hides behind compute.
        overlap=0.0,
        reserve=0,
        cores=os.cpu_count() or 1,
        memory_shared=True,
        measured_kernels=measure,
        calibrated="measured on this machine" if measure else "nominal (not measured)",
    )


def take_hardware_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(`--hardware.FIELD=VALUE` overrides, the config overrides left), the value given in
    the same token or the next one."""
    mine, rest, i = [], [], 0
    while i < len(overrides):
        arg = overrides[i]
        if arg.startswith("--hardware."):
            if "=" not in arg and i + 1 < len(overrides):
                arg, i = f"{arg}={overrides[i + 1]}", i + 1
            mine.append(arg)
        else:
            rest.append(arg)
        i += 1
    return mine, rest


def with_overrides(hw: Hardware, overrides: list[str]) -> Hardware:
    """`hw` with `--hardware.FIELD=VALUE` applied: one scalar field of the catalog entry each
    (e.g. `--hardware.inter_bw=6.25e9` bytes/s per device for a slower network)."""
    fields = {f.name: f for f in dataclasses.fields(Hardware) if f.type in ("int", "float", "bool")}
    changes = {}
    for arg in overrides:
        key, _, text = arg[len("--hardware.") :].partition("=")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"--hardware.{key} is not a field of the hardware entry.{hint} Fix: one of "
                f"{', '.join(sorted(fields))}."
            )
        kind = fields[key].type
        try:
            if kind == "bool":
                if text.lower() not in ("true", "false"):
                    raise ValueError(text)
                value = text.lower() == "true"
            else:
                value = float(text) if kind == "float" else int(float(text))
        except ValueError:
            raise ConfigError(
                f"--hardware.{key}={text!r} is not a {kind}. Fix: e.g. --hardware.{key}="
                f"{getattr(hw, key)}."
            ) from None
        if kind != "bool" and (value < 0 or (value == 0 and key not in ZERO_OK)):
            bound = ">= 0" if key in ZERO_OK else "> 0"
            raise ConfigError(f"--hardware.{key}={text} must be {bound}. Fix: a value {bound}.")
        changes[key] = value
    if not changes:
        return hw
    return dataclasses.replace(hw, **changes, calibrated=f"{hw.calibrated}, overridden")
