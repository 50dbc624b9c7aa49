"""The published mixture-of-experts runs (`published/moe.jsonl`) as planner cases, beside
published_rows.py's dense ones: NVIDIA's NeMo performance tables (Mixtral on DGX-B200, run by
Megatron-Core with TransformerEngine: `published/frameworks.toml` [nemo-megatron-core]),
Megatron-Bridge's (Qwen3-30B-A3B on DGX-H100, the same engine: [megatron-bridge]) and NeMo
AutoModel's (the same model on DGX-H100 under FSDP2: [nemo-automodel]); a run the planner
cannot price says what stops it. Every row is held out. Balanced, dropless routing is what the
planner prices and what these tables ran ("we force-balance the token distribution among
experts and all benchmarks are token-dropless"; AutoModel: "Fake balanced gate is enabled to
simulate ideal expert routing"). Knobs a source does not state (recomputation) are the
planner's choice, as `plan` makes it.
"""

from __future__ import annotations

import dataclasses

from published_case import FRAMEWORKS, Case, best_layout
from shardwise.models.presets import ModelSpec
from shardwise.plan import search
from shardwise.plan.hardware import CATALOG
from shardwise.plan.layout import Layout
from shardwise.plan.peers import PeerJob


def _mixture(m: dict) -> ModelSpec:
    """A Mixtral-style block (RMSNorm, RoPE, grouped k/v heads, `n_experts` routed SwiGLU
    experts of `ffn_dim`, `top_k` per token, untied head) of the row's shape; heads of their
    own width where the row's head_dim is not dim / n_heads (Qwen3: 32 of 128 on 2048)."""
    width = m.get("head_dim") or 0
    own = width if width * m["n_heads"] != m["dim"] else 0
    return ModelSpec(
        "moe", m["n_layers"], m["dim"], m["n_heads"], m["n_kv_heads"], m["ffn_dim"],
        m["vocab_size"], max_seq_len=m["seq_len"], n_experts=m["n_experts"], top_k=m["top_k"],
        head_dim_override=own,
    )  # fmt: skip


def unpriceable(row: dict) -> str | None:
    """What in the run the planner cannot state, or None."""
    if row["hardware"]["gpu"] not in CATALOG:
        return f"{row['hardware']['gpu']} is not in the hardware catalog"
    return None


def _nemo(row: dict, framework: str = "nemo-megatron-core") -> Case | str:
    """NeMo 2.0's performance tables (and Megatron-Bridge's, the same Megatron-Core):
    Megatron-Core's distributed optimizer (ZeRO-1 over dp, the experts' states over their own
    dp/ep group), the layout as the table gives it (tp with sp, interleaved pipeline of
    `pp_virtual` chunks, a cp ring, ep), FP8 per-tensor or current scaling priced as
    precision.fp8 (the blocks' GEMMs at the card's FP8 peak; an assumption: the
    sequence-parallel collectives stay bf16, where TransformerEngine may gather FP8 inputs)."""
    if why := unpriceable(row):
        return why
    m, lay = row["model"], row["layout"]
    n, s, gb = row["hardware"]["n_gpus"], m["seq_len"], lay["global_batch"]
    peer = FRAMEWORKS[framework]
    job = PeerJob(
        _mixture(m), CATALOG[row["hardware"]["gpu"]], n, s, gb, "bf16", "bf16", deviations=peer
    )
    if lay.get("float8"):
        job = dataclasses.replace(job, fp8="tensorwise")
    v = lay.get("pp_virtual") or 1
    sched = "interleaved" if v > 1 else "1f1b"
    tp, pp, cp, ep = lay["tp"], lay["pp"], lay.get("cp") or 1, lay["ep"]
    layouts = [
        Layout(tp, pp, lay["dp"], 1, tp > 1, sched, v, lay["micro_batch"], rc, cp=cp, ep=ep)
        for rc in ("none", "selective", "full")  # not stated: the planner's choice
    ]
    step = gb * s / (row["measured"]["tokens_per_s_per_gpu"] * n)
    return Case(row, job, best_layout(job, layouts), step)


# The same table's dense run, priced as the MoE rows are (framework, card, FP8), to tell the
# card's uncalibrated efficiencies from the MoE block's error; not a row of the record (it
# would move the dense MAPE). NeMo 25.02, DGX-B200: "LLAMA3-8B | 8 | 128 | 2 | 8192 | 1 | 1 |
# 1 | 1 | 1 | 8 | 26006 | 1506" (GPUs, GBS, MBS, seq, TP, PP, CP, VP, EP, GA, tokens/s/GPU,
# TFLOP/s/GPU); Llama 3 8B's shape as torchtitan.jsonl's rows give it
CONTROL = {"gpus": 8, "batch": 128, "micro": 2, "seq": 8192, "tokens_per_s_per_gpu": 26006}


def dense_control() -> tuple[float, float]:
    """(measured, predicted) step seconds of CONTROL."""
    c = CONTROL
    spec = ModelSpec("decoder", 32, 4096, 32, 8, 14336, 128256, max_seq_len=c["seq"])
    job = PeerJob(
        spec, CATALOG["b200"], c["gpus"], c["seq"], c["batch"], "bf16", "bf16",
        deviations=FRAMEWORKS["nemo-megatron-core"], fp8="tensorwise",
    )  # fmt: skip
    layouts = [
        Layout(dp=c["gpus"], zero=1, micro_batch=c["micro"], recompute=rc)
        for rc in ("none", "selective", "full")
    ]
    measured = c["batch"] * c["seq"] / (c["tokens_per_s_per_gpu"] * c["gpus"])
    return measured, search.evaluate(job, best_layout(job, layouts))["step_time_s"]


def _automodel(row: dict) -> Case | str:
    """NeMo AutoModel's pre-training table: FSDP2 over all dp ranks (ZeRO-3: parameters,
    gradients and optimizer states sharded, the experts' over their dp/ep group), experts split
    over ep, bf16, TransformerEngine's fused attention, the recomputation its benchmark config
    sets (the row's layout.recompute). Its DeepEP dispatch and combine are priced as the
    planner prices an all-to-all, with the permutation kernels beside them (DeepEP writes the
    rows in expert order itself) and nothing overlapped: an upper bound on the exchange."""
    if why := unpriceable(row):
        return why
    m, lay = row["model"], row["layout"]
    n, s, gb = row["hardware"]["n_gpus"], m["seq_len"], lay["global_batch"]
    peer = FRAMEWORKS["nemo-automodel"]
    job = PeerJob(
        _mixture(m), CATALOG[row["hardware"]["gpu"]], n, s, gb, "bf16", "bf16", deviations=peer
    )
    stated = (lay["recompute"],) if lay.get("recompute") else ("none", "selective", "full")
    layouts = [  # a recomputation the row does not state is the planner's choice
        Layout(dp=lay["dp"], zero=3, micro_batch=lay["micro_batch"], recompute=rc, ep=lay["ep"])
        for rc in stated
    ]
    return Case(row, job, best_layout(job, layouts), row["measured"]["step_time_s"])


ADAPTERS = {
    "nemo-": _nemo,
    "mbridge-": lambda row: _nemo(row, "megatron-bridge"),
    "automodel-": _automodel,
}


def is_moe(row: dict) -> bool:
    return bool(row["model"].get("n_experts"))


def moe_report(results: list, skipped: list[tuple[str, str]], rows: dict[str, dict]) -> None:
    """The MoE rows' errors (all held out) and MAPE, and the MoE runs not priced, with why."""
    mine = [r for r in results if is_moe(r[0].row)]
    if not mine and not any(is_moe(rows[rid]) for rid, _ in skipped):
        return
    print("\nmixture-of-experts rows (held out; measured -> predicted step):")
    for c, pred, unfit, err in mine:
        print(
            f"  {c.row['id']}: {c.layout.short()}: {c.measured_s:.3f} -> {pred:.3f} s "
            f"({err:+.1%}){' ' + unfit if unfit else ''}"
        )
    if mine:
        print(f"  MAPE {sum(abs(r[3]) for r in mine) / len(mine):.1%} over {len(mine)} rows")
        meas, pred = dense_control()
        print(
            f"  dense control, the same table's Llama 3 8B on 8 B200 (not a row): {meas:.3f} -> "
            f"{pred:.3f} s ({pred / meas - 1:+.1%}): the card's uncalibrated efficiencies"
        )
    for rid, why in skipped:
        if is_moe(rows[rid]):
            print(f"  not priced: {rid}: {why}")
