"""`plan --verify`: run candidates for a few steps on this machine and compare the prediction
with the engine's measured accounting (memory by category) and the median step time after
warm-up. Also the measuring core of benchmarks/planner_accuracy.py."""

from __future__ import annotations

import statistics
import time

from shardwise.config import load_config
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.job.prepare import check_data, run_job_here, validate
from shardwise.plan.layout import Job
from shardwise.training.metrics import human_bytes
from shardwise.training.validate import Derived

STATES = ("params", "grads", "master", "optimizer")
STEPS = 6  # the steps `plan --verify` runs per candidate: 2 of warm-up, 4 measured


def layout_overrides(c: dict) -> list[str]:
    """Config overrides that run candidate `c`."""
    out = [
        f"--parallel.tp={c['tp']}",
        f"--parallel.pp={c['pp']}",
        f"--parallel.zero={c['zero']}",
        f"--train.micro_batch={c['micro_batch']}",
        f"--memory.recompute={c['recompute']}",
        f"--memory.offload={c['offload']}",
        f"--parallel.grad_compression={c.get('compression', 'none')}",
    ]
    if c["tp"] > 1:
        out.append(f"--parallel.sp={str(c['sp']).lower()}")
    if c["pp"] > 1:
        out += [
            f"--parallel.pp_schedule={c['pp_schedule']}",
            f"--parallel.pp_virtual={c['pp_virtual']}",
        ]
    return out


def timed_run(cfg, derived: Derived | None = None) -> dict:
    """One rank of a harness case (`build_run`, `fit`) that also takes each step's process CPU
    time, from `zero_grad` (the step's start) to the end of the optimizer step: on a shared
    machine wall-clock time inflates with the other jobs, CPU time much less. `derived`: the
    run description `verify` validated (None: this rank validates, `job_here`)."""
    return run_job_here(cfg, derived, timed_fit)


def timed_fit(run) -> dict:
    """`fit(run)`'s records and each step's process CPU time (see `timed_run`)."""
    from shardwise.training.loop import fit

    cpu: list[float] = []
    zero_grad, step = run.reducer.zero_grad, run.optimizer.step

    def timed_zero_grad() -> None:
        cpu.append(time.process_time())
        zero_grad()

    def timed_step(*args, **kwargs):
        out = step(*args, **kwargs)
        cpu[-1] = time.process_time() - cpu[-1]
        return out

    run.reducer.zero_grad, run.optimizer.step = timed_zero_grad, timed_step
    return {"records": fit(run), "step_cpu_times": cpu}


def predicted_run(cfg, derived: Derived | None = None) -> dict:
    """`timed_run`, with the planner's prediction for this config (`pred`) made in this world
    just before: rank 0 times the layout's kernels afresh while the other ranks wait, so a
    drift of a shared machine's speed between calibration and measurement stays out of the
    comparison."""
    import torch.distributed as dist

    from shardwise.job.explain import explain_record
    from shardwise.plan import kernels
    from shardwise.plan.hardware import cpu_hardware

    pred = None
    if dist.get_rank() == 0:
        kernels.clear()
        pred = explain_record(cfg, dist.get_world_size(), cpu_hardware())
    dist.barrier()
    return {**timed_run(cfg, derived), "pred": pred}


def quiet(steps: int) -> list[str]:
    """The overrides `measure` adds to every case: `steps` steps, no evaluation."""
    return ["--train.eval_every=0", "--train.eval_batches=0", f"--train.steps={steps}"]


def measure(
    nproc: int,
    cases: list[list[str]],
    steps: int = STEPS,
    warmup: int = 2,
    predict: bool = False,
    derived: list[Derived] | None = None,
) -> list[dict]:
    """Run each list of overrides on `nproc` local ranks (one world for all); per case: the
    last step's `mem_bytes` and `comm_bytes` (max over ranks), the median over the steps after
    `warmup` of the slowest rank's wall-clock step time (`step_time_s`; its fastest step:
    `step_best_s`) and process CPU time (`step_cpu_s`), or `error`; with `predict`, also the
    prediction made just before (`predicted_run`). `derived`: each case's run description,
    validated by the caller for `nproc` ranks with `quiet(steps)` added (None: the ranks
    validate each case themselves)."""
    from shardwise.launchers.harness import run_world

    peer = f"shardwise.cli.verify:{'predicted_run' if predict else 'timed_run'}"
    todo = [{"overrides": [*c, *quiet(steps)], "peer": peer} for c in cases]
    for case, d in zip(todo, derived or [None] * len(todo), strict=True):
        case["derived"] = d  # validated once, by the caller, not again per rank
    out = []
    for per_rank in run_world(nproc, todo):
        errors = [r["error"] for r in per_rank if "error" in r]
        if errors:
            out.append({"error": errors[0].splitlines()[0]})
            continue
        recs = per_rank[0]["records"]
        walls = [[x["step_time_s"] for x in r["records"]] for r in per_rank]
        wall = [max(ts) for ts in zip(*walls, strict=True)]  # a step ends with its last rank
        cpu = [max(ts) for ts in zip(*[r["step_cpu_times"] for r in per_rank], strict=True)]
        out.append(
            {
                "mem_bytes": recs[-1]["mem_bytes"],
                "comm_bytes": recs[-1]["comm_bytes"],
                "comm_calls": recs[-1]["comm_calls"],
                "comm_wait_s": statistics.median(
                    sum(x["comm_wait_s"].values()) for x in recs[warmup:]
                ),
                "step_time_s": statistics.median(wall[warmup:]),
                "step_best_s": min(wall[warmup:]),
                "step_cpu_s": statistics.median(cpu[warmup:]),
                "pred": per_rank[0].get("pred"),
            }
        )
    return out


def compare(pred: dict, meas: dict) -> dict:
    """Exactness of model states, relative error of the total and of the step time."""
    pm, mm = pred["mem_bytes"], meas["mem_bytes"]
    return {
        "states_exact": all(pm.get(k, 0) == mm.get(k, 0) for k in STATES),
        "total_err": (pm["total"] - mm["total"]) / mm["total"],
        "time_err": (pred["step_time_s"] - meas["step_time_s"]) / meas["step_time_s"],
    }


def verify(job: Job, cands: list[dict], config: str | None, overrides: list[str], top: int) -> int:
    """Run the best `top` runnable candidates here (the plan must be for this machine) and
    print predicted vs measured."""
    if job.hardware.name != "cpu":
        raise ConfigError(
            f"--verify runs the candidates on this machine, but the plan is for "
            f"{job.hardware.name}. Fix: --hardware cpu (or plan on the GPU machine)."
        )
    if config is not None:  # the measuring harness builds configs from overrides only
        raise ConfigError(
            f"--verify takes --section.key=value overrides, not a config file ('{config}'). "
            "Fix: pass its values as overrides."
        )
    base = [*overrides, "--log.tensorboard=false", "--log.progress=off", "--log.every=1000000"]
    runnable, cases, described, skipped = [], [], [], 0
    for c in cands:  # the best `top` that this version of the engine can run
        case = [*base, *layout_overrides(c)]
        cfg = load_config(None, [*case, *quiet(STEPS)])  # what the ranks will run
        try:
            derived = validate(cfg, job.devices)  # the job layer's checks, once
        except ShardwiseError:
            skipped += 1
            continue
        check_data(cfg, derived)  # the data, prepared once: a refusal stops here, unrun
        runnable.append(c)
        cases.append(case)
        described.append(derived)  # handed to the ranks: they validate nothing again
        if len(cases) == top:
            break
    if not cases:
        raise ConfigError("--verify: none of the candidates can run in this version.")
    if skipped:
        print(f"({skipped} better-ranked candidates need features this version lacks)")
    results = measure(job.devices, cases, STEPS, derived=described)
    print(
        f"{'layout':<52} {'pred total':>11} {'meas total':>11} {'err':>6} {'states':>7} "
        f"{'pred s':>8} {'wall s':>8} {'err':>6} {'CPU s':>8} {'err':>6}"
    )
    for c, m in zip(runnable, results, strict=True):
        name = (
            f"tp{c['tp']} pp{c['pp']} dp{c['dp']} z{c['zero']} mb{c['micro_batch']} "
            f"rc={c['recompute']} off={c['offload']}"
        )
        if "error" in m:
            print(f"{name:<52} failed: {m['error']}")
            continue
        e = compare(c, m)
        print(
            f"{name:<52} {human_bytes(c['mem_bytes']['total']):>11} "
            f"{human_bytes(m['mem_bytes']['total']):>11} {100 * e['total_err']:>5.1f}% "
            f"{'exact' if e['states_exact'] else 'DIFF':>7} {c['step_time_s']:>8.4f} "
            f"{m['step_time_s']:>8.4f} {100 * e['time_err']:>5.1f}% {m['step_cpu_s']:>8.4f} "
            f"{100 * (c['step_time_s'] - m['step_cpu_s']) / m['step_cpu_s']:>5.1f}%"
        )
    return 0
