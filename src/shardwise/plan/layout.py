"""What is planned (`Job`: model, hardware, batch, precision, fine-tuning) and one way to run
it (`Layout`: degrees, ZeRO stage, schedule, micro-batch, recompute, offload, gradient
compression)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def quantised(self) -> bool:
        return self.base_quant != "none"


@dataclass(frozen=True)
class Engine:
    """Where training frameworks differ in what a layout costs. The planner's default is
    shardwise itself; the published runs of other frameworks (benchmarks/published_runs.py)
    set theirs from what their papers and code say."""

    name: str = "shardwise"
    # "engine": our block's saved tensors (activations.block_terms: fp32 norms); "paper":
    # Korthikanti et al.'s 16-bit block (activations.paper_block_terms)
    block_memory: str = "engine"
    # attention materialises the s x s scores (Megatron-LM's fused softmax before
    # FlashAttention, BLOOM); attention dropout implies it in our engine too
    unfused_attention: bool = False
    # gradient reduction overlaps backward (ours, DDP, FSDP: yes; Megatron-LM in 2021-22: no)
    overlap_dp: bool = True
    # pipeline sends without sp carry 1/tp of the activation, all-gathered over tp after
    # (Megatron-LM's scatter/gather optimisation, Narayanan et al. 2021 §4.1)
    pp_scatter_gather: bool = False
    # the loss keeps the 16-bit logits and writes their gradient in place (flash-attn's fused
    # cross entropy, llm-foundry's default) instead of an fp32 log-softmax and a new gradient
    fused_loss: bool = False
    # ZeRO-3 gathers and reduces parameter by parameter, each call blocking (DeepSpeed in
    # 2021: one all-gather per parameter with a device synchronisation each, DeepSpeed issue
    # #1069 and PR #1188), instead of one call per unit (ours, FSDP)
    zero3_per_tensor: bool = False
    # ZeRO-3 gathers into a list of dp views (torch.distributed.all_gather, DeepSpeed 2021's
    # `_allgather_param`): c10d gathers into a fresh flat buffer, then copies it out slice by
    # slice, a copy kernel per rank (PyTorch's `_all_gather_base`, 1.9+, made it one call)
    list_all_gather: bool = False
    # selective recomputation keeps every other matmul's output and the fused attention's
    # (torchtitan's per-op policy, selective_ac_option "op": activations.op_sac_terms)
    # instead of recomputing the attention core only (Korthikanti et al. 2022 §5; ours)
    selective_ops: bool = False
    # the loss casts the 16-bit logits to fp32 for PyTorch's cross entropy (torchtitan): in
    # backward the loss's gradient and log-softmax's input gradient, both fp32, live at once
    loss_upcast: bool = False
    # the optimizer accumulates gradients into an fp32 buffer of every parameter the rank
    # holds, beside the 16-bit ones (DeepSpeed's BF16_Optimizer, BLOOM from 2022-02-28)
    fp32_grads: bool = False
    # the optimizer step flattens the rank's share of the gradients into a new 16-bit buffer
    # and casts that to a new fp32 one, both alive beside the model states (DeepSpeed's ZeRO-1/2
    # `step`: `self.flatten(self.averaged_gradients[i]).to(fp32)`, in its code since 2020 and
    # measured in 0.19.8 by tests/test_zero_peers.py)
    step_grad_copies: bool = False
    # a pipeline stage keeps, per micro-batch in flight, the hidden state it received (the
    # engine's receive buffer, cloned again as its blocks' input) and the one it sent (held
    # to run backward from): DeepSpeed's PipelineEngine (`pipe_buffers["inputs"]` and
    # `["outputs"]`, freed after that micro-batch's backward; measured in DeepSpeed 0.19.8 by
    # tests/test_deepspeed_pipeline.py), beside each block's input that full recomputation
    # saves; ours hands the received tensor to its first block
    pp_stage_copies: bool = False
    # full recomputation re-runs a block's whole forward, both its tp collectives too
    # (Megatron-LM checkpoints a whole layer), instead of stopping at its last saved tensor
    # (ours: one all-reduce again, sp three halves)
    recompute_whole_block: bool = False
    # sp keeps 1/tp of each norm's output for backward and all-gathers it again there for the
    # weight gradient: two more all-gathers per layer (Korthikanti et al. 2022 §4.2.2)
    sp_regather: bool = False
    # backward's tp reduction of the input gradient (all-reduce; sp: reduce-scatter) runs while
    # the weight gradient is computed, sp's re-gather while the input gradient is (Megatron-LM
    # from 2022: Korthikanti et al. §4.2.2 and §6.2, whose full recomputation costs 39 % and
    # not 33 % because the recomputed forward's all-reduces have nothing to hide behind)
    tp_overlap_backward: bool = False
    # pipeline sends are broadcasts in a 2-rank group per pair of neighbouring stages, an NCCL
    # communicator each (DeepSpeed's pipe/p2p.py), instead of batched p2p in the pipeline
    # group's one (ours); and the groups a rank uses beyond the world's and one per parallel
    # dimension: Megatron-DeepSpeed's model-parallel group (the gradient norm) and DeepSpeed's
    # pipe group (the loss broadcast), and the pair of first and last stages that reduces the
    # tied embedding's gradient (plan/memory.communicator_bytes)
    pp_pairs: bool = False
    extra_groups: int = 0
    extra_pairs: int = 0


SHARDWISE = Engine()


@dataclass(frozen=True)
class Job:
    spec: ModelSpec | None  # None: model states only, from `params`
    hardware: Hardware
    devices: int
    seq_len: int = 2048
    global_batch: int = 1024
    precision: str = "bf16"
    reduce: str = "bf16"
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
    engine: Engine = field(default_factory=lambda: SHARDWISE)  # the framework that runs it

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
            f"z{self.zero} mb{self.micro_batch} rc={self.recompute} off={self.offload}"
            + (f" wire={self.compression}" if self.compression != "none" else "")
        )


_FIELDS = tuple(f.name for f in fields(Layout))
