"""Shared helpers of the benchmark scripts: the command line, medians, tables, a byte-counting
DDP peer. Imported as `common` (the scripts' own directory is on `sys.path`, also in the
spawned ranks, which inherit the parent's `sys.path`). Importing it also puts the test rigs
(tests/support/, imported as `support`) on `sys.path`."""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def add_test_rigs_to_path() -> None:
    """Put the repository's tests/ on `sys.path`: the PyTorch peers, fault hooks and chaos
    rigs the benchmarks run live in tests/support/ (`support.peers:ddp_peer`, ...), not in
    the installed package. Spawned ranks inherit the parent's `sys.path`."""
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    if tests not in sys.path:
        sys.path.append(tests)


add_test_rigs_to_path()  # before a script's `from support import ...` (sorted after `common`)

WARMUP_STEPS = 5  # first steps pay allocator growth, lazy init and cold caches
SMOKE_HELP = (
    "the smallest case for a couple of steps, one round: shows that the script still runs "
    "against today's API (tests/test_benchmarks.py runs every benchmark so); its numbers mean "
    "nothing and no verdict is drawn from them"
)


def add_smoke(parser: argparse.ArgumentParser) -> None:
    """Every benchmark's `--smoke` flag."""
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def commit() -> str:
    """The checked-out shardwise commit, and whether the tree had local changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = ["git", "-C", root]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True)
    except OSError:
        return "unknown"
    return head.stdout.decode().strip() + (" + local changes in src/" if dirty.stdout else "")


def command_line() -> str:
    """The exact command that produced this output (environment that matters included)."""
    env = " ".join(
        f"{k}={shlex.quote(os.environ[k])}"
        for k in ("SHARDWISE_CACHE", "OMP_NUM_THREADS")
        if k in os.environ
    )
    argv = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    return f"{env} {argv}".strip()


def preamble() -> None:
    """The lines every result starts with: commit, the exact command, date and load."""
    import datetime

    print(f"shardwise commit {commit()}")
    print(f"$ {command_line()}")
    cores = os.cpu_count()
    print(f"date: {datetime.date.today()}; load average at the start: {load()} ({cores} cores)")


def load() -> str:
    """The 1/5/15-minute load averages: how busy the shared machine was."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_jiffies() -> tuple[int, int]:
    """(stolen, total) CPU jiffies of this machine since boot (/proc/stat; (0, 0) elsewhere):
    time the hypervisor gave this VM's CPUs to other guests."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return fields[7], sum(fields)


def stolen(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Fraction of the CPU time between two `cpu_jiffies` readings that was stolen."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def slowest_rank_steps(per_rank: list[dict]) -> list[float]:
    """Per step, the slowest rank's time (a step ends for the job when its last rank ends):
    from a peer's `step_times` or from our records."""
    if "step_times" in per_rank[0]:
        runs = [r["step_times"] for r in per_rank]
    else:
        runs = [[x["step_time_s"] for x in r["records"]] for r in per_rank]
    return [max(ts) for ts in zip(*runs, strict=True)]


def abba_cases(rounds: int, sizes: list[str], pair, make) -> tuple[list[dict], list[tuple]]:
    """The timed cases of `pair` ((name, case entries) for us and the peer) per size, in
    alternating order per round (A B, B A, A B, ...: drift hits both alike), with their
    (size, name, round) keys; `make(size)` gives a case's overrides."""
    cases, keys = [], []
    for r in range(rounds):
        for size in sizes:
            for who, extra in pair if r % 2 == 0 else pair[::-1]:
                cases.append({"overrides": make(size), **extra})
                keys.append((size, who, r))
    return cases, keys


def engine_rounds(engines: list[tuple[str, list[str], str | None]], base: list[str], rounds: int):
    """The cases of every (name, extra overrides, peer or None) engine on `base`, in `rounds`
    rounds whose order alternates (drift hits every engine alike), with (name, round) keys."""
    cases, keys = [], []
    for r in range(rounds):
        for name, extra, peer in engines if r % 2 == 0 else engines[::-1]:
            cases.append({"overrides": [*base, *extra], **({"peer": peer} if peer else {})})
            keys.append((name, r))
    return cases, keys


def engine_times(by_key: dict, names: list[str], rounds: int) -> dict[str, float]:
    """Per engine the median over rounds of its median steady step (slowest rank per step)."""
    return {
        name: median([median(steady(slowest_rank_steps(by_key[name, r]))) for r in range(rounds)])
        for name in names
    }


def round_medians(by_key: dict, size: str, sides: tuple[str, str], rounds: int, label: str):
    """Per side the median steady step of each round and the fastest step, the per-round
    ratios sides[0] / sides[1], and the rows of the per-round table."""
    med, best, rows = {}, {}, []
    for who in sides:
        times = [steady(slowest_rank_steps(by_key[size, who, r])) for r in range(rounds)]
        med[who] = [median(t) for t in times]
        best[who] = min(min(t) for t in times)
        rows.append([size, who, *(f"{m * 1000:.1f}" for m in med[who])])
    paired = [a / b for a, b in zip(med[sides[0]], med[sides[1]], strict=True)]
    rows.append([size, label, *(f"{x:.3f}" for x in paired)])
    return med, best, paired, rows


def steady(times: Sequence[float], warmup: int = WARMUP_STEPS) -> list[float]:
    """Step times after the warm-up steps (all of them if the run is too short)."""
    return list(times[warmup:]) or list(times)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (pastes into RESULTS.md unchanged)."""
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def check(results: list[list[dict]]) -> None:
    """Fail loudly when a case raised inside the spawned world."""
    for case in results:
        for rank, r in enumerate(case):
            if "error" in r:
                sys.exit(f"rank {rank} failed:\n{r['error']}")


def _counting_hook(state: dict, bucket):
    """All-reduce like DDP's default (average), counting ring-equivalent bytes sent."""
    n = torch.distributed.get_world_size()
    buf = bucket.buffer()
    state["bytes"] += 2 * (n - 1) / n * buf.numel() * buf.element_size()
    buf.div_(n)
    work = torch.distributed.all_reduce(buf, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def counting_ddp_peer(cfg) -> dict:
    """`support.peers.ddp_peer` with a comm hook that counts DDP's gradient bytes.

    Only for measuring bytes: a Python comm hook replaces DDP's C++ all-reduce, so step
    times of this peer are not the ones to compare (the timed peer runs without it)."""
    from support import peers

    state = {"bytes": 0.0}
    plain = peers.DistributedDataParallel

    class Counting(plain):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.register_comm_hook(state, _counting_hook)

    peers.DistributedDataParallel = Counting
    try:
        out = peers.ddp_peer(cfg)
    finally:
        peers.DistributedDataParallel = plain
    out["comm_bytes_per_step"] = state["bytes"] / cfg.train.steps
    return out


def paired_peer(cfg) -> dict:
    """Alternate single steps of ours (`fit` with one step) and of DDP in the same processes,
    with the order flipped every step: the two see the same load at the same moments, which
    a comparison of whole runs on a busy shared machine cannot promise. The DDP step is the
    body of `support.peers.ddp_peer` (no accumulation; the same fp64-norm clipping).
    Timing only: both repeat global batch 0 at the learning rate of step 0. Ours runs inside
    the job layer (`run_job_here`: run dir locked, run closed)."""
    from shardwise.job.prepare import run_job_here

    steps, cfg.train.steps = cfg.train.steps, 1
    return run_job_here(cfg, None, lambda run: _paired_steps(run, steps))


def _paired_steps(run, steps: int) -> dict[str, list[float]]:
    """`paired_peer`'s body on our built run: DDP built beside it, then `steps` pairs."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from shardwise.data import split_for_rank
    from shardwise.models import build_model, init_weights
    from shardwise.training.loop import fit

    cfg = run.cfg
    d, o = run.derived, cfg.optim
    with torch.device(run.info.device):
        model = build_model(d.spec)
    init_weights(model, cfg.train.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    betas = (o.beta1, o.beta2)
    opt = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=betas, eps=o.eps, fused=True)
    count = cfg.train.global_batch // d.dp * d.tokens_per_sample

    def ddp_step() -> float:
        t0 = time.perf_counter()
        (idx,) = split_for_rank(run.sampler.global_indices(0), run.dp_rank, d.dp, d.micro_batch)
        x, y = (t.to(run.info.device) for t in run.train_data.get_batch(idx))
        logits = ddp(x).float().flatten(0, -2)
        (F.cross_entropy(logits, y.flatten(), reduction="sum") / count).backward()
        grads = [p.grad for p in model.parameters()]  # the peer's clipping: fp64 norm
        norm = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)).square().sum()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), o.grad_clip, norm.sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"ours": [], "ddp": []}
    pair = [("ours", lambda: fit(run)[0]["step_time_s"]), ("ddp", ddp_step)]
    for i in range(steps):
        for who, step in pair if i % 2 == 0 else pair[::-1]:
            times[who].append(step())
            torch.distributed.barrier()  # both start the next step together, as in `fit`
    return times


def alternating_rounds(run, keys: list, rounds: int) -> list[dict]:
    """Run the cases named by `keys` `rounds` times through `run(keys) -> results in order`,
    the order reversed every other round (a burst of other tenants' load, or a core that runs
    slower for a while, then hits other cases each round); per round, key -> its result."""
    out = []
    for r in range(rounds):
        order = list(keys)[:: -1 if r % 2 else 1]
        out.append(dict(zip(order, run(order), strict=True)))
    return out


# The checkpoint benchmarks' run: a decoder whose checkpointed state (fp32 parameters and AdamW
# moments) is >= 50 MB trains 20 steps saving every CKPT_EVERY; the smoke run saves twice.
CKPT_RUN = [
    "--model.n_layers=4",
    "--model.dim=256",
    "--model.vocab_size=8192",
    "--data.seq_len=64",
    "--train.global_batch=8",
    "--train.steps=20",
    "--train.lr=1e-3",
    "--optim.warmup_steps=5",
    "--train.eval_every=0",
    "--train.eval_batches=0",
    "--log.tensorboard=false",
    "--log.progress=off",
    "--log.every=1000000",
]
CKPT_EVERY = 5
CKPT_SMOKE = ["--model.n_layers=1", "--model.dim=64", "--train.steps=6"]  # two saves
CKPT_NPROC = 2


def checkpoint_world(
    parser: argparse.ArgumentParser, prefix: str, cases: Callable
) -> tuple[argparse.Namespace, Path, list]:
    """The checkpoint benchmarks' start: add `--rounds` to `parser` (which has `--smoke`),
    parse, print the preamble, run `cases(root, rounds, smoke)` ((kind, case) pairs) in ONE
    world of CKPT_NPROC ranks under a fresh temporary `root`; returns the arguments, root and
    (kind, per-rank results) pairs."""
    from shardwise.launchers.harness import run_world

    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    args.rounds = 1 if args.smoke else args.rounds
    preamble()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    todo = cases(root, args.rounds, args.smoke)
    results = run_world(CKPT_NPROC, [c for _, c in todo])
    check(results)
    return args, root, [(kind, r) for (kind, _), r in zip(todo, results, strict=True)]
