"""What is planned (`Job`: model, hardware, batch, precision, fine-tuning) and one way to run
it (`Layout`: degrees, ZeRO stage, schedule, micro-batch, recompute, offload, gradient
compression)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from shardwise.models import ModelSpec
from shardwise.plan.hardware import Hardware

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class FineTune:
    """Planner-only fine-tuning options (scenario 3). LoRA (Hu et al. 2021) trains rank-r
    adapters A (r x in) and B (out x r) beside frozen `targets`; QLoRA (Dettmers et al. 2023)
    stores the frozen linear weights in 4-bit NF4 (or int8); 8-bit optimizers (Dettmers et al. 2022)
    keep Adam's two moments in one byte each."""

    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")
    base_quant: str = "none"  # finetune.base_quant: none | nf4 | int8
    optim_8bit: bool = False
    lora_dropout: float = 0.0  # its masks and dropped inputs are saved for backward
    # the MoE layers' stacked weights with adapters of their own (plan/moe.lora_gemms)
    lora_experts: tuple[str, ...] = ()
    # targets naming some blocks only (`blocks.1.attn.wq`): each block's adapted linears,
    # priced at tp = pp = cp = 1 (plan/valid.py); () when every block has `lora_targets`
    lora_layers: tuple[tuple[str, ...], ...] = ()

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def quantised(self) -> bool:
        return self.base_quant != "none"


@dataclass(frozen=True)
class Job:
    spec: ModelSpec | None  # None: model states only, from `params`
    hardware: Hardware
    devices: int
    seq_len: int = 2048
    global_batch: int = 1024
    precision: str = "bf16"
    reduce: str = "bf16"
    fp8: str = "none"  # precision.fp8: the blocks' linear layers at the card's FP8 peak
    params: int = 0  # used when spec is None
    finetune: FineTune = field(default_factory=FineTune)
    frozen: tuple | None = None  # the real model's ZeRO units (explain with train.freeze)
    pp_split: str = ""  # parallel.pp_split: blocks per pipeline chunk ("" = balanced cut)
    bucket_mb: float = 25.0  # parallel.bucket_mb: the data-parallel gradient bucket cap
    # (out, in) of each quantised frozen linear (finetune/quant): outside the ZeRO units,
    # whole on every rank, or 1/dp of it on each under ZeRO-3
    quantised_shapes: tuple[tuple[int, int], ...] = ()
    # whether each of them is used in backward (its input needs a gradient; () = all are)
    quantised_backward: tuple[bool, ...] = ()
    packed: bool = False  # data.pack: several records per row (models/packing.py)
    loss_chunks: int = 0  # train.loss_chunks: > 1, the head and loss by chunks of tokens
    # layout fields the user pinned (plan with --parallel.tp=8 ...): ((field, value), ...)
    pinned: tuple = ()
    # a model priced from its real modules (job/real.py): module buffers, the parameters
    # that cost matmul FLOPs, and saved bytes = a + b·micro_batch per recomputation mode
    buffer_bytes: int = 0
    matmul_params: int = 0
    act_lines: tuple = ()  # ((recompute, (a, b)), ...)
    powersgd_rank: int = 4  # parallel.powersgd_rank (layouts with compression='powersgd')
    # what the search may send ZeRO-0 gradients as: none, plus the config's grad_compression
    compressions: tuple[str, ...] = ("none",)
    nvme_chunk: int = 1 << 22  # memory.nvme_buffer_mb in fp32 elements (optimizer+nvme)
    # train.compile=blocks: TorchInductor fuses each block's element-wise chains (a GPU's
    # kernel model prices them below eager ones: peers.elementwise_excess)
    compiled: bool = False

    @property
    def bc(self) -> int:
        return BYTES[self.precision]

    @property
    def br(self) -> int:
        return BYTES[self.reduce]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    sp: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    offload: str = "none"
    compression: str = "none"  # parallel.grad_compression: what the ZeRO-0 all-reduce sends
    cp: int = 1  # parallel.cp: ranks splitting each sample's sequence (dp: the sample streams)
    cp_mode: str = "ring"  # parallel.cp_mode: ring | ulysses (what the cp ranks exchange)
    ep: int = 1  # parallel.ep: ranks of a dp line splitting each MoE layer's experts

    def micro_batches(self, job: Job) -> int:
        """Micro-batches per rank per step (gradient accumulation / pipeline micro-batches)."""
        return job.global_batch // (self.dp * self.micro_batch)

    def record(self) -> dict:
        return {f: getattr(self, f) for f in _FIELDS}

    def short(self) -> str:
        sched = ""
        if self.pp > 1:
            sched = f" {self.pp_schedule}" + (f"x{self.pp_virtual}" if self.pp_virtual > 1 else "")
        return (
            f"tp{self.tp}{'+sp' if self.sp else ''} pp{self.pp}{sched} dp{self.dp} "
            + (f"cp{self.cp} {self.cp_mode} " if self.cp > 1 else "")
            + (f"ep{self.ep} " if self.ep > 1 else "")
            + f"z{self.zero} mb{self.micro_batch} rc={self.recompute} off={self.offload}"
            + (f" wire={self.compression}" if self.compression != "none" else "")
        )


_FIELDS = tuple(f.name for f in fields(Layout))


def as_data_parallel(job: Job, layout: Layout) -> tuple[Job, Layout]:
    """A context-parallel layout priced as the data-parallel job each rank's work resembles:
    dp x cp replicas that each see seq_len / cp tokens of a sample. Model states are sharded
    and reduced over all of them, activations are those of the local length, and the tokens
    per step are unchanged. What the cp attention adds is priced from the cp layout itself:
    its exchange (traffic.cp_traffic), what its kernels save beyond plain attention and the
    ring's blocks in flight (memory.cp_saved_bytes, memory.cp_transient), the attention over
    the rest of the sequence and the exchange's time (plan/context.py). cp = 1: unchanged."""
    if layout.cp == 1:
        return job, layout
    cp = layout.cp
    shorter = replace(job, seq_len=job.seq_len // cp, global_batch=job.global_batch * cp)
    return shorter, replace(layout, dp=layout.dp * cp, cp=1)
