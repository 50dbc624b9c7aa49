"""Search over layouts: enumerate tp, pp, dp, ZeRO stage, schedule and v, micro-batch,
recompute and offload; reject what is invalid or does not fit (counting reasons); rank the rest
by predicted tokens/s."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field

from shardwise.errors import ConfigError
from shardwise.models.families import family_of
from shardwise.plan import context as cp_time
from shardwise.plan import memory as mem
from shardwise.plan import moe, traffic
from shardwise.plan import time as tm
from shardwise.plan.activations_hf import cp_repeated_kv_bytes
from shardwise.plan.hardware import GiB
from shardwise.plan.layout import Job, Layout, as_data_parallel
from shardwise.plan.states import add_states, model_states
from shardwise.plan.valid import RECOMPUTE, invalid

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb")
OFFLOAD = ("none", "optimizer", "optimizer+params")
NVME = ("optimizer+nvme", "params+nvme")  # searched where the hardware declares a disk


def _divisors(n: int) -> list[int]:
    """Every divisor of `n`, ascending, from its prime factors (trial division to sqrt(n)):
    a loop to n took minutes for a billion devices."""
    divisors, rest, p = [1], n, 2
    while p * p <= rest:
        power = 0
        while rest % p == 0:
            rest //= p
            power += 1
        if power:
            divisors = [d * p**k for d in divisors for k in range(power + 1)]
        p += 1 if p == 2 else 2
    if rest > 1:
        divisors += [d * rest for d in divisors]
    return sorted(divisors)


def _pow2_upto(n: int) -> list[int]:
    out, d = [], 1
    while d <= n:
        out.append(d)
        d *= 2
    return out


@dataclass
class Result:
    candidates: list[dict]
    rejected: Counter = field(default_factory=Counter)
    best_unfit: dict | None = None  # the candidate needing the least memory, when none fit
    unfit: list[dict] = field(default_factory=list)  # over the memory budget, leanest first


def evaluate(job: Job, lay: Layout) -> dict:
    """The full prediction for one layout: the candidate record of `plan --json`."""
    asked, whole = lay, job
    job, lay = as_data_parallel(job, lay)  # cp > 1: its data-parallel equivalent per rank
    hw = job.hardware
    mb = mem.predict_memory(job, lay)
    if asked.cp > 1:  # what the cp kernels save beyond the equivalent's plain attention
        extra = mem.cp_saved_bytes(whole, asked)
        if family_of(whole.spec).block.transformers and asked.recompute == "none":
            kv = cp_repeated_kv_bytes(
                whole.spec, whole.seq_len, lay.micro_batch, job.bc, asked.cp, lay.tp, job.packed
            )
            extra += kv * mem.job_split(whole, asked)[0][0]  # (pp = 1: every layer)
        mb["activations"] += extra
        mb["total"] += extra
    kinds, calls = traffic.traffic_by_kind(job, lay), traffic.collective_calls(job, lay)
    if asked.cp > 1:  # the attention's exchange, from the sequence split itself
        kinds["cp"], calls["cp"] = traffic.cp_traffic(whole, asked)
    expert_mem = _experts(job, lay, mb, kinds, calls)  # ep > 1: the expert units' states
    parts = tm.step_time(job, lay, mb, kinds, calls)
    if asked.cp > 1:  # the attention over the rest of the sequence, and its exchange
        parts.update(cp_time.cp_seconds(whole, asked, job, lay, kinds["cp"], calls["cp"], parts))
        parts["step_s"] += parts["cp_attention_s"] + parts["cp_exposed_s"]
    if asked.ep > 1:  # the token exchange's all-to-alls, exposed (plan/moe.py): the busiest
        # pipeline stage's MoE layers, not the whole model's (as job/predict.py counts them)
        stage = max(blocks for blocks, *_ in mem.job_split(whole, asked))
        layers = moe.moe_blocks(whole.spec, stage)
        moved, calls["ep"] = traffic.ep_traffic(whole, asked, layers=layers)
        kinds["ep"] = {"all_to_all": moved}
        parts.update(moe.ep_seconds(whole, asked, moved, calls["ep"]))
        parts["step_s"] += parts.get("ep_exposed_s", 0.0)
    transient = max(mem.backward_transient(job, lay), mem.cp_transient(whole, asked))
    peak = max(mb["total"] + transient, mem.step_peak(job, lay)) + mem.device_overhead(job, lay)
    host = mem.kept_in(mb, "host")
    step = parts["step_s"]
    tokens = job.tokens_per_step / step
    peak_flops = job.devices * hw.peak[job.precision]
    mfu = tm.model_flops_per_token(whole) * tokens / peak_flops  # the whole sequence's
    hfu = tm.hardware_flops_per_token(whole, lay) * tokens / peak_flops
    return {
        **asked.record(),
        "mem_bytes": {k: round(v) for k, v in mb.items()},
        "peak_bytes": int(peak),
        "device_memory": hw.memory,
        "host_bytes": int(host),
        "step_time_s": step,
        "tokens_per_s": tokens,
        "mfu": mfu,
        "hfu": hfu,
        "mfu_causal": tm.model_flops_per_token(whole, causal=True) * tokens / peak_flops,
        "flop_convention": tm.FLOP_CONVENTION,
        "time": parts,
        **_rank0_traffic(job, lay, kinds, calls),
        **({"expert_mem_bytes": expert_mem} if expert_mem else {}),
    }


def _rank0_traffic(job: Job, lay: Layout, kinds: dict, calls: dict) -> dict:
    """The record's `comm_bytes` and `comm_calls`: rank 0's, as metrics.jsonl's; `kinds` and
    `calls` price the step time's busiest pipeline stage, so under pp tp and pp are taken
    from pipeline stage 0 (traffic.stage_holds)."""
    comm, calls = traffic.traffic_totals(kinds), dict(calls)
    if lay.pp > 1:
        first, n = traffic.stage_traffic(job, lay, 0)
        comm.update(first)
        calls.update(n)
    return {"comm_bytes": comm, "comm_calls": calls}


def _experts(job: Job, lay: Layout, mb: dict, kinds: dict, calls: dict) -> dict:
    """Under expert parallelism, add the expert units (E/ep experts per MoE layer, sharded and
    reduced over the dp/ep ranks holding the same ones: memory.expert_group) to `mb`'s model
    states and their gradient reduction to the dp traffic (`kinds`, `calls`), in place, as
    job/predict.py does for the real model; returns their states ({} at ep = 1)."""
    if lay.ep == 1:
        return {}
    whole = mem.stage_units(job, dataclasses.replace(lay, ep=1), 0)
    experts = moe.split_units(whole, job.spec, lay.ep)[1]
    edp_job, edp = mem.expert_group(job, lay, lay.ep)
    more = model_states(experts, edp_job, edp.dp, edp.zero, edp.offload, quantised=())
    add_states(mb, {k: v for k, v in more.items() if k != "activations"})
    mb["total"] = sum(
        v for k, v in mb.items() if k != "total" and not k.startswith(("host_", "disk_"))
    )
    held = dataclasses.replace(edp_job, frozen=tuple(experts))
    for kind, n in traffic.traffic_by_kind(held, edp)["dp"].items():
        kinds["dp"][kind] = kinds["dp"].get(kind, 0.0) + n
    calls["dp"] += traffic.collective_calls(held, edp)["dp"]
    return {k: round(v) for k, v in more.items() if v}


def fits(job: Job, rec: dict, disk_budget: float | None = None) -> str | None:
    """Why a prediction does not fit the job's hardware (None: it fits). `disk_budget`: the
    local disk its NVMe state may fill, if not the hardware's declared `nvme_bytes`."""
    hw = job.hardware
    share = min(job.devices, hw.per_node) if hw.memory_shared else 1
    host_total = rec["host_bytes"] * (min(job.devices, hw.per_node) if not hw.memory_shared else 0)
    disk = mem.kept_in(rec["mem_bytes"], "disk")
    if hw.memory_shared:  # CPU: every rank's device and host bytes share the RAM
        if (rec["peak_bytes"] + rec["host_bytes"]) * share > hw.memory:
            return "memory over budget"
    else:
        if rec["peak_bytes"] > hw.memory:
            return "memory over budget"
        if host_total > hw.host_memory * min(job.devices, hw.per_node):
            return "host memory over budget"
    if disk > (hw.nvme_bytes if disk_budget is None else disk_budget):
        return "NVMe over budget (--hardware.nvme_bytes)"
    return None


def _cp_degrees(job: Job, tp: int, pp: int, ranks: int) -> list[tuple[int, str]]:
    """(cp, cp_mode) to try over `ranks` ranks that share the parameters: cp = 1, and where
    the engine splits this model's attention (a decoder of ours, alone with dp/ZeRO) every
    power of two dividing them, ring and Ulysses."""
    out = [(1, "ring")]
    fam = family_of(job.spec)
    if not fam.context_parallel or fam.from_checkpoint or job.act_lines or tp > 1 or pp > 1:
        return out
    for cp in _pow2_upto(ranks)[1:]:
        if ranks % cp == 0:
            out += [(cp, "ring"), (cp, "ulysses")]
    return out


def _ep_degrees(job: Job, ranks: int) -> list[int]:
    """Expert-parallel degrees to try over the `ranks` = dp·cp ranks sharing the dense
    parameters: 1, and for a family whose MoE layers take the exchange every divisor of
    `ranks` that also divides the experts per layer (parallel/expert.py)."""
    spec = job.spec
    if not (family_of(spec).expert_parallel and spec.n_experts):
        return [1]
    return [d for d in _divisors(ranks) if spec.n_experts % d == 0]


def _pp_cp(job: Job, tp: int):
    """(pp, cp, cp_mode, ep) for `tp`: every pipeline depth dividing the rest, each with its cp
    and ep."""
    rest = job.devices // tp
    for pp in _divisors(rest):
        for cp, mode in _cp_degrees(job, tp, pp, rest // pp):
            for ep in _ep_degrees(job, rest // pp):
                yield pp, cp, mode, ep


def layouts(job: Job):
    n = job.devices
    for tp in _pow2_upto(min(n, job.hardware.per_node)):
        for pp, cp, mode, ep in _pp_cp(job, tp):
            dp = n // (tp * pp * cp)
            scheds = [("1f1b", 1)] if pp == 1 else [(s, 1) for s in SCHEDULES if s != "interleaved"]
            if pp > 1:
                scheds += [("interleaved", v) for v in (2, 4)]
            per_rank = job.global_batch // dp if job.global_batch % dp == 0 else 0
            mbs = [b for b in _pow2_upto(per_rank) if per_rank % b == 0] or [1]
            # sequence parallelism always with tp: less activation memory for the same
            # communication volume (Korthikanti et al. 2022 §4.2.2)
            # gradient compression over dp > 1 (PowerSGD: ZeRO-0 only): none, and what is asked
            for (sched, v), mb, zero, rc, off in itertools.product(
                scheds, mbs, range(4), RECOMPUTE, _offloads(job)
            ):
                wires = [
                    w for w in job.compressions if dp * cp > 1 and (zero == 0 or w != "powersgd")
                ]
                wires = wires or ["none"]
                for wire in wires:
                    yield Layout(
                        tp, pp, dp, zero, tp > 1, sched, v, mb, rc, off, wire, cp, mode, ep
                    )


def _offloads(job: Job) -> tuple[str, ...]:
    """Where states may go: NVMe too when the hardware declares a disk, or a config pins it
    (then rejected as over budget without one: never silently dropped)."""
    pinned = dict(job.pinned).get("offload")
    nvme = job.hardware.nvme_bytes > 0 or pinned in NVME
    return OFFLOAD + NVME if nvme else OFFLOAD


def usable_devices(job: Job) -> int:
    """The most ranks any layout of `job` can occupy: each data-parallel replica needs a sample
    of the global batch, each pipeline stage a layer, each tensor-parallel rank a head (and tp
    stays inside a node)."""
    spec = job.spec
    tp = min(job.hardware.per_node, spec.n_heads or job.hardware.per_node)
    return job.global_batch * max(1, spec.n_layers) * tp


def check_device_count(job: Job) -> None:
    """Refuse a device count no layout can use, before enumerating its divisors."""
    most = usable_devices(job)
    if job.devices > most:
        tp = most // (job.global_batch * max(1, job.spec.n_layers))
        raise ConfigError(
            f"--devices={job.devices:,} is more than any layout of this job can use: at most "
            f"global batch {job.global_batch} (dp) x {job.spec.n_layers} layers (pp) x {tp} "
            f"(tp: heads, within a node) = {most:,} ranks. Fix: --devices {most:,} or fewer, "
            "or a larger --train.global_batch."
        )


# memory figures closer than this are one row: half the 0.1 GiB the table prints
SAME_BYTES = 2**30 // 20
MEMORY_KEYS = ("mem_bytes", "peak_bytes", "host_bytes")


def _same(a: dict, b: dict) -> bool:
    """Two predictions that read the same: equal times and traffic, memory within SAME_BYTES."""
    rest = [k for k in a if k not in (*MEMORY_KEYS, "zero")]
    if any(a[k] != b.get(k) for k in rest):
        return False
    pairs = [(a["peak_bytes"], b["peak_bytes"]), (a["host_bytes"], b["host_bytes"])]
    pairs += [(v, b["mem_bytes"].get(k, 0)) for k, v in a["mem_bytes"].items()]
    return all(abs(x - y) <= SAME_BYTES for x, y in pairs)


def merge_equivalent(cands: list[dict]) -> list[dict]:
    """One row per distinct layout. With one data-parallel replica ZeRO shards nothing, so
    stages that differ in nothing else are one layout: ZeRO-1 and ZeRO-2 with the optimizer
    offloaded predict the same but ZeRO-2's few MiB of reduce buffers. The first (faster,
    leaner: `cands` is ranked) is kept and names the others in `equivalent_zero`."""
    out: list[dict] = []
    single: list[dict] = []  # the kept rows with dp = 1
    for rec in cands:
        one = rec["dp"] * rec.get("cp", 1) == 1
        twin = next((k for k in single if _same(k, rec)), None) if one else None
        if twin is not None:
            twin.setdefault("equivalent_zero", []).append(rec["zero"])
            continue
        out.append(rec)
        if one:
            single.append(rec)
    return out


def search(job: Job) -> Result:
    """Every valid layout that fits, best first (layouts that cannot differ merged); rejected
    ones counted by reason."""
    if job.spec is None:
        raise ConfigError("search needs a model architecture; --params plans model states only")
    check_device_count(job)
    out, rejected, unfit = [], Counter(), []
    for lay in layouts(job):
        reason = invalid(job, lay)
        if reason:
            rejected[reason] += 1
            continue
        rec = evaluate(job, lay)
        reason = fits(job, rec)
        if reason:
            rejected[reason] += 1
            unfit.append(rec)
            continue
        out.append(rec)
    out.sort(key=lambda r: (-r["tokens_per_s"], r["peak_bytes"]))
    out = merge_equivalent(out)
    hw = job.hardware
    unfit.sort(key=lambda r: max(r["peak_bytes"] / hw.memory, r["host_bytes"] / hw.host_memory))
    return Result(out, rejected, None if out or not unfit else unfit[0], unfit)


def nothing_fits(job: Job, result: Result) -> ConfigError:
    """What would be needed: the least memory any layout needs, and the smallest device count
    (doubling) at which something fits with the same global batch."""
    least, hw = result.best_unfit, job.hardware
    need = ""
    if least:
        need = (
            f" The closest layout ({_short(least)}) needs {least['peak_bytes'] / GiB:.1f} GiB "
            f"per device and {least['host_bytes'] / GiB:.1f} GiB of host memory per device; "
            f"{hw.name} has {hw.memory / GiB:.1f} GiB and {hw.host_memory / GiB:.1f} GiB."
        )
    more = ""
    for k in range(1, 11):
        bigger = dataclasses.replace(job, devices=job.devices * 2**k)
        if bigger.devices > usable_devices(job):
            break
        if search(bigger).candidates:
            more = f" The smallest device count (doubling) that fits is {bigger.devices}."
            break
    return ConfigError(
        f"no layout of {job.spec.n_layers}-layer, {job.spec.dim}-wide model fits on "
        f"{job.devices} x {job.hardware.name} (seq_len {job.seq_len}, global batch "
        f"{job.global_batch}).{need}{more} Fix: more devices, a device with more memory, "
        "a smaller micro-batch or sequence, fine-tuning options (--finetune.lora_rank=16, "
        "--finetune.base_quant=nf4)"
        + (
            ", or NVMe offload: declare the local disk per device (--hardware.nvme_bytes=2e12)."
            if not hw.nvme_bytes
            else "."
        )
    )


def _short(r: dict) -> str:
    ep = f" ep={r['ep']}" if r.get("ep", 1) > 1 else ""
    return (
        f"tp={r['tp']} pp={r['pp']} dp={r['dp']}{ep} zero={r['zero']} mb={r['micro_batch']} "
        f"recompute={r['recompute']} offload={r['offload']}"
    )
