"""The published record as cases the planner prices: each row of `benchmarks/published/*.jsonl`
(one measured GPU training run, with the source's own words in `quote`) turned into a planner
`Job` and `Layout` and the step time the source measured, by an adapter per source. Where the
framework that ran it differs from shardwise, the job is a `plan/peers.PeerJob` with that
framework's `Deviations`, data beside the record (`published/frameworks.toml`). Knobs a source
does not state (micro-batch, interleaving depth) are the planner's choice, as `plan` makes it
when those keys are not pinned. A row the planner cannot price says why. The MoE rows'
adapters are in published_moe.py. Used by published_runs.py, tests/test_published.py and
tests/test_published_ours.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

from published_case import FRAMEWORKS, HERE, Case, best_layout
from published_moe import ADAPTERS as MOE
from shardwise.models.presets import ModelSpec, preset
from shardwise.plan.hardware import CATALOG
from shardwise.plan.layout import Job, Layout
from shardwise.plan.peers import Deviations, PeerJob


def source(row: dict) -> str:
    return row["id"].split("-")[0]


# The pair that fits `Hardware.misaligned_slowdown` (published_runs.fit_misaligned): BLOOM's
# 02-23 heads comparison, one layout and one model, 128 heads of 108 (off the 16-bit Tensor
# Cores' 8-element alignment) against 96 of 144: the same FLOPs, x1.30 the step
MISALIGNED_PAIR = tuple(
    f"bloom-prequel-182b-h13824l78-384g-tp8pp6dp8-mbs4-gbs2048-nh{n}-0223-nheadscmp"
    for n in (128, 96)
)


def calibration(row: dict) -> bool:
    """The named calibration subset: llm-foundry's single-node (8-GPU) rows, Korthikanti et
    al.'s 22B rows (8 GPUs, tp 8, the unfused-attention path) and shardwise's own eager H200
    run for the kernel parameters, and MISALIGNED_PAIR for the misaligned-head slowdown."""
    if row["id"].startswith("korthikanti2022-t5-22b-"):
        return True
    if row["id"].startswith("shardwise-"):  # our eager bf16 run: compiled and FP8 runs of
        # ours are priced from it (peers.elementwise_excess reads its pair), not fitted to
        return not (row["layout"].get("compile") or row["layout"].get("float8"))
    if row["id"] in MISALIGNED_PAIR:
        return True
    return row["id"].startswith("foundry-") and row["hardware"]["n_gpus"] <= 8


def _gpt(m: dict, dropout: float = 0.0) -> ModelSpec:
    """A GPT block (LayerNorm, GELU MLP, learned positions, tied head) of the row's shape."""
    return ModelSpec(
        "gpt2", m["n_layers"], m["dim"], m["n_heads"], m["n_heads"], m["ffn_dim"],
        m["vocab_size"], max_seq_len=m["seq_len"], tie_embeddings=True, dropout=dropout,
        attn_dropout=dropout,
    )  # fmt: skip


def _llama(m: dict) -> ModelSpec:
    """A Llama block (RMSNorm, SwiGLU, RoPE, grouped k/v heads, untied head)."""
    return ModelSpec(
        "decoder", m["n_layers"], m["dim"], m["n_heads"], m["n_kv_heads"] or m["n_heads"],
        m["ffn_dim"], m["vocab_size"], max_seq_len=m["seq_len"],
    )  # fmt: skip


def _unsupported(row: dict, priced: tuple[str, ...] = ()) -> str | None:
    """Why the planner cannot price this row, or None. `priced`: what the source's adapter
    prices of FP8 ("fp8"), torch.compile ("compile") and context parallelism ("cp")."""
    lay = row["layout"]
    fp8 = "fp8" in str(row["precision"]) or lay.get("float8")
    if fp8 and "fp8" not in priced:
        return "FP8 matmuls (the planner prices bf16/fp16 only)"
    if fp8 and (lay.get("tp") or 1) > 1:  # torchtitan's float8 tp styles cast before the
        # sequence-parallel collectives: fp8 bytes and buffers the planner does not model
        return "Float8 with tensor parallelism (its fp8 collectives are not modelled)"
    if lay.get("compile") and "compile" not in priced:
        return "torch.compile (the planner prices eager kernels)"
    if lay.get("async_tp"):
        return "asynchronous tp (its overlap of tp communication is not modelled)"
    if (lay.get("cp") or 1) > 1 and "cp" not in priced:
        return "context parallelism (not in the planner)"
    return None


def _layouts(row: dict, job: Job, zero: int, recompute: str) -> Layout:
    lay = row["layout"]
    tp, pp, dp = lay["tp"], lay["pp"], lay["dp"]
    mbs = [lay["micro_batch"]] if lay.get("micro_batch") else [1, 2, 4, 8]
    sched = str(lay.get("pp_schedule") or "").lower()
    if pp == 1:
        plans = [("1f1b", 1)]
    elif "interleaved" in sched or "interleav" in sched:
        vs = [lay["pp_virtual"]] if lay.get("pp_virtual") else [2, 3, 4, 6, 8]
        plans = [("interleaved", v) for v in vs]
    elif "1f1b" in sched:
        plans = [("1f1b", 1)]
    else:  # not stated: the planner's choice of 1F1B or interleaved
        plans = [("1f1b", 1)] + [("interleaved", v) for v in (2, 3, 4, 6, 8)]
    sp = bool(lay.get("sp")) and tp > 1
    cp = {"cp": lay.get("cp") or 1}  # (a ring over the cp ranks: torchtitan's)
    return best_layout(
        job,
        [
            Layout(tp, pp, dp, zero, sp, sc, v, mb, recompute, **cp)
            for (sc, v) in plans
            for mb in mbs
        ],
    )


def _foundry(row: dict) -> Case | str:
    """MosaicML llm-foundry's MPT benchmarks: FSDP (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP =
    ZeRO-2) on every GPU, Flash/Triton attention, no dropout, a GELU MLP of 4d, learned
    positions and a tied head (NumParams = 12Ld^2 + (V+S)d + 13Ld + 2d, checked per row)."""
    if why := _unsupported(row):
        return why
    m, lay = row["model"], row["layout"]
    n, s = row["hardware"]["n_gpus"], m["seq_len"]
    zero = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}[lay["sharding"]]
    # amp_bf16 (fp32 sharded parameters, bf16 autocast) and pure bf16 both compute in bf16
    hw = CATALOG[row["hardware"]["gpu"]]
    peer = FRAMEWORKS["llm-foundry"]
    job = PeerJob(_gpt(m), hw, n, s, lay["global_batch"], "bf16", "bf16", deviations=peer)
    layout = Layout(
        dp=n, zero=zero, micro_batch=lay["micro_batch"], recompute=lay["recompute"] or "none"
    )
    step = lay["global_batch_tokens"] / row["measured"]["tokens_per_s"]
    return Case(row, job, layout, step)


def megatron_flops(m: dict, batch: int) -> float:
    """Narayanan et al. 2021 eq. 3: FLOPs of one iteration with full recomputation,
    96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    b, s, layers, h, v = batch, m["seq_len"], m["n_layers"], m["dim"], m["vocab_size"]
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def _megatron_framework(row: dict, zero: int) -> Deviations:
    """DeepSpeed's 2021 ZeRO-3 for ZeRO-3 rows, Megatron-LM of 2022 for Korthikanti et al.'s,
    of 2021 for the others."""
    if zero == 3:
        return FRAMEWORKS["deepspeed-zero3-2021"]
    if row["id"].startswith("korthikanti2022-"):
        return FRAMEWORKS["megatron-lm-2022"]
    return FRAMEWORKS["megatron-lm"]


def _megatron(row: dict) -> Case | str:
    """Megatron-LM's GPT runs (Narayanan et al. 2021, Korthikanti et al. 2022) on Selene's
    A100-80GB nodes: 16-bit mixed precision, unfused softmax attention with dropout 0.1 on
    attention and hidden states (the block Korthikanti's activation formulas count), a tied
    head; the data-parallel all-reduce runs after backward, not overlapped. ZeRO-3 rows
    (DeepSpeed) prefetch and overlap. Full recomputation where the source does not say
    (eq. 3, which gives the TFLOP/s, assumes it)."""
    m, lay, meas = row["model"], row["layout"], row["measured"]
    if lay.get("tp") is None:
        return "the layout is not given (a prose data point)"
    zero = 3 if lay.get("sharding") == "ZeRO-3" else 0
    n = row["hardware"]["n_gpus"]
    hw = CATALOG[row["hardware"]["gpu"]]
    job = PeerJob(
        _gpt(m, 0.1), hw, n, m["seq_len"], lay["global_batch"], "fp16", "fp16",
        deviations=_megatron_framework(row, zero),
    )  # fmt: skip
    if meas.get("step_time_s"):
        step = meas["step_time_s"]
    elif meas.get("tflops_per_gpu"):
        step = megatron_flops(m, lay["global_batch"]) / (n * meas["tflops_per_gpu"] * 1e12)
    elif meas.get("oom"):
        step = math.nan
    else:
        return "no step time or TFLOP/s given (a model-FLOPs utilisation only)"
    layout = _layouts(row, job, zero, lay.get("recompute") or "full")
    return Case(row, job, layout, step, bool(meas.get("oom")))


def _torchtitan(row: dict) -> Case | str:
    """torchtitan's Llama 3/3.1 runs: FSDP2 (ZeRO-3) with tp, pp and cp as given, SDPA flash
    attention, bf16. Its H100s are 96 GB HBM2e parts at 2.4 TB/s and 500 W (the doc's words):
    memory and bandwidth overridden, the power cap not modelled. Float8 runs price the blocks'
    linear layers at the card's FP8 peak (tensorwise, torchtitan's default recipe). Runs the
    row states eager (`compile` false) price a block's element-wise ops as eager PyTorch runs
    them, a kernel per op (plan/eager.py); compiled runs, and those that do not say, one
    pass per op (pricing the unstated ones eager too, as torchtitan's default would have
    them, worsens the held-out MAPE: 7.95 -> 7.99 %, the A100 rows +10-12 %)."""
    if why := _unsupported(row, priced=("fp8", "compile", "cp")):
        return why
    m, lay, meas = row["model"], row["layout"], row["measured"]
    if not meas.get("tokens_per_s_per_gpu") and not meas.get("oom"):
        return "no throughput given"
    n = row["hardware"]["n_gpus"]
    hw = CATALOG[row["hardware"]["gpu"]]
    if "96GB HBM2e" in row.get("notes", ""):
        hw = hw.with_overrides(memory=96 * 2**30, hbm_bw=2.4e12)
    if not lay.get("global_batch") and not lay.get("micro_batch"):
        return "the batch is not given"
    gb = lay.get("global_batch") or lay["dp"] * lay["micro_batch"]
    peer = FRAMEWORKS["torchtitan"]
    job = PeerJob(_llama(m), hw, n, m["seq_len"], gb, "bf16", "bf16", deviations=peer)
    job = dataclasses.replace(job, compiled=lay.get("compile") is not False)  # (see above)
    if "fp8" in str(row["precision"]) or lay.get("float8"):
        job = dataclasses.replace(job, fp8="tensorwise")
    rc = str(lay.get("recompute") or "none")
    if rc == "selective (layer)":
        return "per-layer selective checkpointing (every k-th block whole, k not stated)"
    rc = "selective" if rc.startswith("selective") else rc
    tps = meas.get("tokens_per_s_per_gpu")
    step = gb * m["seq_len"] / (tps * n) if tps else math.nan
    # FSDP2 with pipeline stages keeps parameters gathered between micro-batches
    # (reshard_after_forward off): the planner has no ZeRO-2/3 with pp, so ZeRO-1 prices it
    zero = 3 if lay["pp"] == 1 else 1
    return Case(row, job, _layouts(row, job, zero, rc), step, bool(meas.get("oom")))


def _bloom(row: dict) -> Case | str:
    """BigScience's BLOOM runs on Jean Zay (Megatron-DeepSpeed): A100-80GB nodes whose NCCL
    network is 4 Omni-Path links of 100 Gb/s per 8 GPUs (6.25 GB/s per GPU), ZeRO-1 (the
    BF16 optimizer), the fused softmax (unfused attention), no dropout, full recomputation,
    the data-parallel reduction after backward."""
    m, lay, meas = row["model"], row["layout"], row["measured"]
    if row.get("inconsistent"):
        return f"the source contradicts itself: {row['inconsistent']}"
    if not m.get("vocab_size") or not m.get("n_layers"):
        return "model shape not given (vocabulary or layers)"
    if not meas.get("step_time_s") and not meas.get("oom"):
        return "no step time given"
    if row["precision"] not in ("bf16", "fp16"):
        return f"precision not given ({row['precision']})"
    hw = CATALOG[row["hardware"]["gpu"]].with_overrides(inter_bw=6.25e9)
    zero = 1 if "ZeRO-1" in str(lay.get("sharding")) and lay["dp"] > 1 else 0
    # the chronicles, 02-28: "from now on the testing is happening with BF16 optimizer that
    # was just written to accumulate gradients in fp32, so it is more memory heavy"
    bf16_optimizer = row["precision"] == "bf16" and ("-0228" in row["id"] or "-tr11-" in row["id"])
    peer = FRAMEWORKS["megatron-deepspeed-bf16" if bf16_optimizer else "megatron-deepspeed"]
    job = PeerJob(
        _gpt(m), hw, row["hardware"]["n_gpus"], m["seq_len"], lay["global_batch"],
        row["precision"], row["precision"], deviations=peer,
    )  # fmt: skip
    # DeepSpeed's pipeline engine runs one schedule, 1F1B (its TrainSchedule)
    one_f1b = dict(row, layout=dict(lay, pp_schedule=lay.get("pp_schedule") or "1f1b"))
    layout = _layouts(one_f1b, job, zero, lay.get("recompute") or "full")
    return Case(row, job, layout, meas.get("step_time_s") or math.nan, bool(meas.get("oom")))


def _megatron_readme(row: dict) -> Case | str:
    """The Megatron-LM README's GPT-3 175B example on 1,024 A100s; its MFU/HFU table repeats
    Korthikanti et al.'s rows (counted once, there)."""
    if "sp-selrecompute" in row["id"]:
        return "the same run as Korthikanti et al.'s Table 5 row (counted there)"
    if row["layout"].get("tp") is None:
        return "the layout is not given"
    # the example's GPT-2 BPE padded as in all of Megatron-LM's GPT runs (the row's
    # `assumed.model.vocab_size`: "All models use a vocabulary size of 51,200")
    m = dict(row["model"], vocab_size=row["model"]["vocab_size"] or 51200)
    return _megatron(dict(row, model=m))


def _llama3(row: dict) -> str:
    """Llama 3's Table 4 gives TFLOP/s per GPU and MFU, not the FLOPs per token behind them."""
    if (row["layout"].get("cp") or 1) > 1:
        return "context parallelism (not in the planner)"
    return "the paper does not state its FLOPs per token, so TFLOP/s give no step time"


def _shardwise(row: dict) -> Case | str:
    """shardwise's own runs on a GPU (benchmarks/cuda_profile.py, cuda_speed.py): a preset
    model, priced as `explain` prices it (our engine, the catalog's entry for the card), with
    `train.compile=blocks` and `precision.fp8` where the row's layout says it ran them."""
    m, lay = row["model"], row["layout"]
    job = Job(
        preset(m["preset"]), CATALOG[row["hardware"]["gpu"]], row["hardware"]["n_gpus"],
        m["seq_len"], lay["global_batch"], row["precision"], row["precision"],
        fp8=lay.get("float8") or "none", compiled=bool(lay.get("compile")),
    )  # fmt: skip
    layout = Layout(dp=lay["dp"], micro_batch=lay["micro_batch"], recompute=lay["recompute"])
    return Case(row, job, layout, row["measured"]["step_time_s"])


ADAPTERS = {
    "shardwise-": _shardwise,
    "llama3-": _llama3,
    "bloom-": _bloom,
    "megatron-readme-": _megatron_readme,
    "foundry-": _foundry,
    "narayanan2021-": _megatron,
    "korthikanti2022-": _megatron,
    "torchtitan-": _torchtitan,
}


def load_rows() -> list[dict]:
    rows = []
    for path in sorted(HERE.glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def make_case(row: dict) -> Case | str:
    for prefix, adapter in (ADAPTERS | MOE).items():
        if row["id"].startswith(prefix):
            return adapter(row)
    return "no adapter for this source yet"


def split_cases(rows: list[dict]) -> tuple[list[Case], list[tuple[str, str]]]:
    """(the rows the planner prices, (id, why not) for the others)."""
    cases, skipped = [], []
    for row in rows:
        c = _case(row)
        if isinstance(c, Case) and c.oom:
            c = "ran out of memory (not timed; the memory report checks the planner rejects it)"
        (skipped.append((row["id"], c)) if isinstance(c, str) else cases.append(c))
    return cases, skipped


def oom_cases(rows: list[dict]) -> tuple[list[Case], list[tuple[str, str]]]:
    """(the runs a source says ran out of memory, as the planner sees them; (id, why not)
    for those it cannot build)."""
    cases, skipped = [], []
    for row in rows:
        if row["measured"].get("oom"):
            c = _case(row)
            (skipped.append((row["id"], c)) if isinstance(c, str) else cases.append(c))
    return cases, skipped


def _case(row: dict) -> Case | str:
    try:
        return make_case(row)
    except (KeyError, TypeError, ValueError) as exc:  # a field the adapter needs is absent
        return f"incomplete row ({type(exc).__name__}: {exc})"
