"""Which layouts can run a job: the rules the engine enforces (training/checks.py,
checks_layout.py, validate.py) and the families' seams, as one reason per rejected layout (the
keys of `plan`'s rejected table)."""

from __future__ import annotations

from shardwise.errors import ConfigError
from shardwise.models.families import Family, family_of
from shardwise.parallel.compile import untraced
from shardwise.parallel.recompute import PLANS
from shardwise.plan import peers
from shardwise.plan.layout import Job, Layout

RECOMPUTE = ("none", "selective", "full")
# LoRA targets naming some blocks only are priced block by block in one stage, unsplit: the
# tp traffic of adapters and of the first adapted block's entry, and a stage's blocks, are
# priced for targets every block has
SOME_BLOCKS = "tp/pp/cp with LoRA targets naming some blocks only"


def recompute_modes(fam: Family) -> tuple[str, ...]:
    """The memory.recompute values the engine builds for `fam` (parallel/recompute.py: a
    family of recomputation plans has those it names; transformers' presets none)."""
    if fam.recompute != "plans":
        return RECOMPUTE
    return ("none", *PLANS.get(fam.name, {}))


def invalid(job: Job, lay: Layout) -> str | None:
    """Why `lay` cannot run `job`, or None. The reasons are the rejected table's keys."""
    spec = job.spec
    if any(getattr(lay, k) != v for k, v in job.pinned):
        return "other than the layout keys given"
    if job.devices % (lay.tp * lay.pp * lay.cp):  # train refuses it: every rank has a place
        return "tp*pp*cp does not divide the devices"
    fam = family_of(spec)
    if lay.tp > 1 and fam.tensor_parallel == "none":
        return "tp not built for this model family"
    if lay.pp > 1 and fam.pipeline == "none":
        return "pp not built for this model family"
    # our engine's per-slice FP8 scales are checked per family (parallel/fp8.py); a published
    # run's framework ran its own FP8 under tp
    ours = peers.of(job) is peers.NONE
    if ours and lay.tp > 1 and job.fp8 != "none" and not fam.fp8_tensor_parallel:
        return "FP8 with tp on this model family (per-slice scales unchecked)"
    untraceable = untraced(fam, lay.recompute, lay.pp, lay.pp_schedule, lay.cp)
    if ours and job.compiled and untraceable:  # training refuses it (training/checks.py)
        return f"compiled blocks with {untraceable}"
    if lay.tp > 1 and spec.n_experts and not lay.sp:  # (training/checks_layout.py refuses it too)
        return "MoE tp without sp (every tp rank would run every token's experts)"
    if lay.ep > 1 and not (fam.expert_parallel and spec.n_experts):
        return "ep without routed experts"
    if lay.ep > 1 and ((lay.dp * lay.cp) % lay.ep or spec.n_experts % lay.ep):
        return "ep does not divide dp*cp and n_experts"
    if split := _split_refused(job, lay):
        return split
    if job.act_lines and lay.recompute not in dict(job.act_lines):
        return f"recompute={lay.recompute} not available for this model"
    if not job.act_lines and lay.recompute not in recompute_modes(fam):
        return f"recompute={lay.recompute} not built for this model family"
    if lay.tp > job.hardware.per_node:
        return "tp spans nodes"
    if spec.n_heads % lay.tp or spec.ffn_dim % lay.tp:
        return "heads or ffn not divisible by tp"
    if spec.n_kv_heads % lay.tp and lay.tp % spec.n_kv_heads:
        return "kv heads and tp do not divide"
    if lay.pp * lay.pp_virtual > spec.n_layers:  # uneven cuts are balanced (pipeline_split)
        return "more pipeline chunks than layers"
    if job.global_batch % (lay.dp * lay.micro_batch):
        return "global batch not divisible by dp*micro_batch"
    m = lay.micro_batches(job)
    if lay.pp > 1 and m < lay.pp:
        return "fewer micro-batches than pipeline stages"
    if lay.pp_schedule == "interleaved" and m % lay.pp:
        return "interleaved needs micro-batches divisible by pp"
    if lay.pp > 1 and lay.zero >= 2:
        return "zero>=2 with pp (gradients reduce-scattered every micro-batch)"
    if lay.offload != "none" and lay.zero == 0:
        return "offload needs zero>=1"
    if lay.offload in ("optimizer+params", "params+nvme") and lay.zero != 3:
        return "parameter offload needs zero=3"
    if lay.zero > 0 and lay.dp * lay.cp == 1 and lay.offload == "none":
        return "zero with dp=1 shards nothing"
    if lay.cp > 1 and job.seq_len % (2 * lay.cp):
        return "seq_len not divisible by 2 x cp (the zig-zag split)"
    if lay.cp > 1 and lay.cp_mode == "ulysses" and spec.n_heads % lay.cp:
        return "heads not divisible by cp (Ulysses)"
    if lay.cp > 1 and (spec.dropout or spec.attn_dropout or job.packed):
        return "cp with dropout or packed rows"
    return None


def check_some_blocks(job: Job, lay: Layout, targets: str) -> None:
    """Refuse pricing one layout (`explain`) with LoRA targets naming some blocks only under
    tp, pp or cp (`SOME_BLOCKS`), naming the targets and the fix."""
    if not _some_blocks_split(job, lay):
        return
    raise ConfigError(
        f"finetune.lora_targets='{targets}' adapts some blocks only, which the planner prices "
        f"in one unsplit stage, and this layout has tp={lay.tp}, pp={lay.pp}, cp={lay.cp}. "
        "Fix: --parallel.tp=1 --parallel.pp=1 --parallel.cp=1 to predict it, or targets that "
        "every block has (a linear's name such as wq, or a path with * for the block number, "
        "such as blocks.*.attn.wq)."
    )


def _split_refused(job: Job, lay: Layout) -> str | None:
    """Why a job priced in one unsplit stage cannot be priced in `lay` (tp, pp or cp > 1)."""
    if _some_blocks_split(job, lay):
        return SOME_BLOCKS
    if job.act_lines and (lay.tp > 1 or lay.pp > 1):  # job/real.py
        return "tp/pp searched for Llama-family and GPT-2 configs only"
    return None


def _some_blocks_split(job: Job, lay: Layout) -> bool:
    """LoRA targets naming some blocks only (`FineTune.lora_layers`) in a split layout."""
    return bool(job.finetune.lora_layers) and (lay.tp > 1 or lay.pp > 1 or lay.cp > 1)
