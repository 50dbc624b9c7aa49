"""Our pipeline schedules against torch.distributed.pipelining, side by side.

What it measures: on 2 gloo ranks (pp = 2) in fp32, the same decoder (same chunks, same
(seed, name) initialisation, same global batch 0 of the same data) is trained one optimizer
step at a time by shardwise (`fit`: our schedule, our p2p, our AdamW with fp64-norm clipping)
and by PyTorch's pipelining (`PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` /
`ScheduleInterleaved1F1B`, the same loss normalised by the global token count, then the same
clipping over both stages and `torch.optim.AdamW`). The two alternate single steps inside the
same processes, order flipped every step, so both see the same machine load at the same
moments. Step time per step is the slower rank's; per schedule the median over the steps
after warm-up, and the ratio ours / torch (target <= 1.00, limit 1.15). The first step's
losses must agree (both compute the same thing). Why: the pipeline engine is ours; PyTorch's
is the peer to beat (docs/design.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common import add_smoke, check, command_line, commit, cpu_jiffies, load, median, stolen, table
from shardwise.launchers.harness import run_world

P = 2
WARMUP = 2
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # name -> virtual chunks per rank
M = 8  # micro-batches per step
MODEL = [  # the balanced model of benchmarks/pipeline_bubble.py
    "--model.name=tiny",
    "--model.n_layers=8",
    "--model.dim=256",
    "--model.n_heads=4",
    "--model.n_kv_heads=4",
    "--model.ffn_dim=938",
    "--data.seq_len=128",
]


def overrides(schedule: str, steps: int, affinity: str = "cores") -> list[str]:
    v = SCHEDULES[schedule]
    return [
        *MODEL,
        "--train.micro_batch=2",
        f"--train.global_batch={2 * M}",
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        "--train.lr=1e-3",
        "--optim.warmup_steps=5",
        f"--parallel.pp={P}",
        f"--parallel.pp_schedule={schedule}",
        f"--parallel.pp_virtual={v}",
        f"--run.cpu_affinity={affinity}",  # pins the process: both engines run pinned (or not)
    ]


def _torch_side(run, cfg):
    """PyTorch's pipeline over the same chunks, initialised like ours; returns a step()."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from shardwise.models import build_model, init_weights
    from shardwise.optim import adamw
    from shardwise.parallel.pipeline_split import plan_chunks, prune_to_stage

    d, p, v = run.derived, cfg.parallel.pp, cfg.parallel.pp_virtual
    r, device = run.topo.coord("pp"), run.info.device
    group = run.topo.group("pp")
    chunks = plan_chunks(d.spec, p, v, cfg.parallel.pp_split, cfg.data.seq_len)
    stages, modules = [], []
    for chunk in chunks[r::p]:
        with torch.device("meta"):
            module = build_model(d.spec)
        prune_to_stage(module, [chunk], chunk.index % p, p)  # this chunk alone
        module.to_empty(device=device)
        init_weights(module, cfg.train.seed)
        modules.append(module)
        stages.append(PipelineStage(module, chunk.index, p * v, device, group=group))
    count = cfg.train.global_batch * d.tokens_per_sample

    def loss_fn(logits, targets):
        flat = logits.float().flatten(0, -2)
        return F.cross_entropy(flat, targets.flatten(), reduction="sum") / count

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(cfg.parallel.pp_schedule)
    if kind is None:
        schedule = ScheduleInterleaved1F1B(stages, d.micro_batches, loss_fn, scale_grads=False)
    else:
        schedule = kind(stages[0], d.micro_batches, loss_fn, scale_grads=False)
    params = [q for m in modules for q in m.parameters()]
    opt = adamw([q for q in params if q.ndim >= 2], [q for q in params if q.ndim < 2], cfg)
    opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = cfg.train.lr / cfg.optim.warmup_steps

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        idx = run.sampler.global_indices(0)  # ours repeats step 0 too (fit with steps=1)
        x, y = (t.to(device) for t in run.train_data.get_batch(idx))
        losses: list[torch.Tensor] = []
        if r == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses, return_outputs=False)
        grads = [q.grad for q in params]
        norm = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)).square().sum()
        torch.distributed.all_reduce(norm, group=group)  # both stages' parameters
        torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, norm.sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, float(sum(q.detach() for q in losses))

    return step


def paired(cfg) -> dict:
    """Alternate one step of ours and one of PyTorch's, order flipped every step; ours runs
    inside the job layer (`run_job_here`: run dir locked, run closed)."""
    from shardwise.job.prepare import run_job_here

    steps, cfg.train.steps = cfg.train.steps, 1
    return run_job_here(cfg, None, lambda run: _paired_steps(run, cfg, steps))


def _paired_steps(run, cfg, steps: int) -> dict:
    """`paired`'s body on our built run: PyTorch's pipeline beside it, then `steps` pairs."""
    from shardwise.training.loop import fit

    theirs = _torch_side(run, cfg)
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    first: dict[str, float] = {}

    def ours() -> tuple[float, float]:
        rec = fit(run)[0]
        return rec["step_time_s"], rec["loss"]

    pair = [("ours", ours), ("torch", theirs)]
    for i in range(steps):
        for who, step in pair if i % 2 == 0 else pair[::-1]:
            torch.distributed.barrier()  # both start together, as in `fit`
            seconds, loss = step()
            times[who].append(seconds)
            first.setdefault(who, loss)
    return {"times": times, "first_loss": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--affinity",
        choices=["cores", "none"],
        default="cores",
        help="run.cpu_affinity of the ranks (both engines share the processes)",
    )
    add_smoke(parser)
    args = parser.parse_args()
    args.steps = WARMUP + 1 if args.smoke else args.steps
    print(f"shardwise commit {commit()}, torch {torch.__version__}")
    print(f"$ {command_line()}")
    print(f"model and batch: {' '.join(overrides('1f1b', args.steps)[:9])}")
    print(f"run.cpu_affinity={args.affinity}")
    print(f"load average at the start: {load()} (2 cores, shared)")
    jiffies = cpu_jiffies()
    names = ["interleaved"] if args.smoke else list(SCHEDULES)  # smoke: the most involved
    cases = [
        {"overrides": overrides(n, args.steps, args.affinity), "peer": "pp_vs_torch:paired"}
        for n in names
    ]
    results = run_world(P, cases)
    check(results)
    rows, ok = [], True
    for name, per_rank in zip(names, results, strict=True):
        slow = {
            who: [max(ts) for ts in zip(*(r["times"][who] for r in per_rank), strict=True)]
            for who in ("ours", "torch")
        }
        ours, theirs = median(slow["ours"][WARMUP:]), median(slow["torch"][WARMUP:])
        ratio = ours / theirs
        last = per_rank[-1]["first_loss"]  # the last stage computes the loss
        same = abs(last["ours"] - last["torch"]) <= 1e-5 * abs(last["torch"])
        ok &= ratio <= 1.15 and same
        rows.append(
            [
                name,
                f"{1000 * ours:.0f}",
                f"{1000 * theirs:.0f}",
                f"{ratio:.3f}",
                "ok" if ratio <= 1.0 else ("within limit" if ratio <= 1.15 else "OVER 1.15"),
                f"{last['ours']:.6f} / {last['torch']:.6f}",
            ]
        )
    print(table(["schedule", "ours ms", "torch ms", "ratio", "target 1.0", "loss 1"], rows))
    print(f"load average at the end: {load()}")
    share = stolen(jiffies, cpu_jiffies())
    print(f"CPU time stolen by the hypervisor during the run: {100 * share:.1f}%")
    print("OK" if ok else "FAILED: a ratio is above 1.15 or the first losses differ")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
