"""How another training framework differs from shardwise where it changes what a layout costs.

The planner prices shardwise's own engine and needs none of this: a plain `Job` is run by
shardwise. The published record's runs of other frameworks (benchmarks/published_runs.py) are
priced as a `PeerJob`, a `Job` with the `Deviations` of the framework that ran it; which
framework deviates where, and the paper or code that says so, is data beside the record
(benchmarks/published/frameworks.toml). Plan modules read the record through `of(job)`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from shardwise.plan.layout import Job


@dataclass(frozen=True)
class Deviations:
    """How another framework differs from shardwise; the planner's own engine needs none.
    Every default is shardwise's behaviour."""

    name: str = "shardwise"
    # "shardwise": our block's saved tensors (activations.block_terms: fp32 norms); "paper":
    # Korthikanti et al.'s 16-bit block (activations.paper_block_terms)
    block_memory: Literal["shardwise", "paper"] = "shardwise"
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
    # the ring attention runs each block pair through the fused (flash) kernel, which returns
    # its log-sum-exp and keeps the scores on chip (PyTorch's context_parallel, which
    # torchtitan uses), instead of materialising one block pair's fp32 scores (ours:
    # parallel/context_comm.py, in the fit check's transient: memory.cp_transient)
    cp_fused_blocks: bool = False
    # the ring sends each K/V block at the model's k/v heads, as grouped-query attention
    # kernels take them (TransformerEngine's p2p context parallelism, Megatron-Core's),
    # instead of repeated to the query heads (ours, PyTorch's context_parallel after repeat_kv)
    cp_kv_heads: bool = False
    # a block's element-wise ops run as plain eager PyTorch, a kernel per op of the module's
    # code (plan/eager.py), unless the run compiles its blocks (Job.compiled), instead of the
    # one pass per op that compiled blocks and hand-fused kernels run (Megatron-LM's apex and
    # jit fusions, DeepSpeed's, llm-foundry's). Such a block pays EAGER_SHARE of the eager
    # count's excess over the fused count (`elementwise_excess`). Off for shardwise's own
    # engine although it runs eager: its eager H200 run is the GH100 fit's calibration row,
    # priced with the fused count (priced with the eager count it comes out 34 % slow, and
    # refitted the kernel parameters price llm-foundry's H100 rows worse); its compiled blocks
    # are priced below that instead
    eager_elementwise: bool = False


NONE = Deviations()  # shardwise's own engine


@dataclass(frozen=True)
class PeerJob(Job):
    """A `Job` as another framework runs it (a published run priced as it ran)."""

    deviations: Deviations = NONE


def of(job: Job) -> Deviations:
    """How the framework that runs `job` differs from shardwise (`NONE` for a plain `Job`)."""
    return job.deviations if isinstance(job, PeerJob) else NONE


def eager_elementwise(job: Job) -> bool:
    """Whether `job`'s blocks run each element-wise op as its own eager PyTorch kernel: a
    framework that runs them so (`Deviations.eager_elementwise`), not compiled this time."""
    return of(job).eager_elementwise and not job.compiled


# The share of the eager count's excess over the fused count (plan/eager.py against
# gpu._elementwise_seconds) that eager element-wise kernels cost, measured: the 1b decoder in
# bf16 on one H200 stepped 370.1 ms eager and 304.1 / 302.5 ms with compiled blocks (two runs,
# benchmarks/RESULTS.md "Speed on one GPU"), a gap of 66.8 ms against the 122.2 ms the count
# prices at the GH100 fit: 0.547. The count alone overshoots (kernels of one op chain overlap
# on the GPU, launches hide behind running kernels); held out, torchtitan's Llama 3.1 8B eager
# rows on 8 and 128 H100s come out +0.9 % and -2.6 % with it (+11.5 % and +7.7 % at 1).
EAGER_SHARE = 0.55


def elementwise_excess(job: Job) -> float:
    """How many times the eager count's excess over the fused count `job`'s blocks pay on a
    GPU: EAGER_SHARE where a framework runs them eagerly (not compiled this time);
    -EAGER_SHARE for shardwise's own engine with compiled blocks (its eager cost is in the
    fused count's calibration: compiling takes away what eager paid beyond it, at most the
    whole element-wise time: gpu._elementwise_seconds), except under precision.fp8, whose
    casts around each FP8 GEMM are not priced and on the measured H200 run cost about what
    compiling saved (compiled FP8 measured 270 ms; priced 254 ms without the discount, 213 ms
    with it); 0 otherwise."""
    if eager_elementwise(job):
        return EAGER_SHARE
    if of(job) is NONE and job.compiled and job.fp8 == "none":
        return -EAGER_SHARE
    return 0.0


def run_by(job: Job, deviations: Deviations) -> PeerJob:
    """`job` as the framework of `deviations` runs it."""
    return PeerJob(**{f.name: getattr(job, f.name) for f in fields(Job)}, deviations=deviations)
