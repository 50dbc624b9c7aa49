"""Hooks the tests apply to a built run before `fit()` (fault injection)."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def inject_inf_on_rank1_step3(run) -> None:
    """Make one gradient infinite on dp rank 1 during the 3rd optimizer step's backward."""
    if run.topo.rank != 1:
        return
    calls = {"n": 0}
    first = next(p for p in run.model.parameters() if p.requires_grad)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return torch.full_like(grad, float("inf")) if calls["n"] == 3 else grad

    first.register_hook(poison)


def return_buffers(run) -> None:
    """Ask the harness to return the model's floating buffers (BatchNorm statistics)."""
    run.return_buffers = True


def skip_mlp_on_even_steps(run) -> None:
    """Leave block 1's MLP out of the graph on every other forward: its parameters get no
    gradient on those steps (an unused-parameter case that must neither hang nor drift)."""
    block = run.model.blocks[1]
    forward = block.mlp.forward
    calls = {"n": 0}

    def maybe_skip(x):
        calls["n"] += 1
        return torch.zeros_like(x) if calls["n"] % 2 == 0 else forward(x)

    block.mlp.forward = maybe_skip


class _SkipOnce(torch.nn.ModuleList):
    """Iterates like its blocks, except that one call of the model's forward skips one."""

    skip_at = 2  # the forward call (1-based) that leaves a block out
    skip_index = 1
    calls = 0

    run = None

    def __iter__(self):
        type(self).calls += 1
        for i, block in enumerate(super().__iter__()):
            if not (type(self).calls == self.skip_at and i == self.skip_index):
                yield block
            else:
                _mark(self.run, "skip-block")


def skip_block1_on_rank1(run) -> None:
    """Rank 1 alone leaves block 1 out of its 2nd forward: control flow differs by rank."""
    if run.topo.rank == 1:
        _SkipOnce.run = run
        run.model.blocks.__class__ = _SkipOnce


def _mark(run, what: str) -> None:
    """Record when a fault was injected (the hang tests time the stop from here)."""
    Path(run.cfg.run.dir).mkdir(parents=True, exist_ok=True)
    Path(run.cfg.run.dir, "fault_injected").write_text(f"{what} {time.time()}\n")


def skip_loss_reduce_on_rank1(run) -> None:
    """Rank 1 leaves out the loss all-reduce over dp of step 3: a skipped collective (and no
    other collective of rank 1 changes, its call site included)."""
    if run.topo.rank != 1:
        return
    all_reduce = run.comm.all_reduce
    calls = {"n": 0}

    def skipping(t, dim, op="sum", async_op=False, control=False):
        if dim == "dp" and control and t.numel() == 1:
            calls["n"] += 1
            if calls["n"] == 3:
                _mark(run, "skip")
                return None
        return all_reduce(t, dim, op=op, async_op=async_op, control=control)

    run.comm.passthrough.add(skipping.__code__)
    run.comm.all_reduce = skipping


def sleep_forever_on_rank1(run) -> None:
    """Rank 1 stops in its 3rd forward and never comes back (outside any collective)."""
    if run.topo.rank != 1:
        return
    loss_sum = run.loss_sum
    calls = {"n": 0}

    def sleeping(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            _mark(run, "sleep")
        while calls["n"] == 3:
            time.sleep(3600)
        return loss_sum(*args, **kwargs)

    run.loss_sum = sleeping


def _nan_loss_on_rank1(run, steps) -> None:
    """Rank 1's loss becomes NaN on the given forwards (1-based); a constant added to it, so
    its gradients stay finite: only the loss check can catch it."""
    if run.topo.rank != 1:
        return
    loss_sum = run.loss_sum
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        out = loss_sum(*args, **kwargs)
        return out + float("nan") if calls["n"] in steps else out

    run.loss_sum = poisoned


def nan_loss_on_rank1_step3(run) -> None:
    _nan_loss_on_rank1(run, {3})


def nan_loss_on_rank1_from_step3(run) -> None:
    _nan_loss_on_rank1(run, range(3, 10**6))


def environment(cfg) -> dict:
    """A harness peer that trains nothing: the environment and process id its rank sees."""
    import os

    return {"env": dict(os.environ), "pid": os.getpid()}


def fail_rank1_first(cfg) -> dict:
    """Rank 1 fails with the cause; rank 0 then fails as a rank left waiting does."""
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("the cause, on rank 1")
    raise RuntimeError("Timed out waiting 300000ms for recv operation to complete")


def thread_affinities(cfg) -> dict:
    """A harness peer that builds the run (where `run.cpu_affinity` applies) and trains
    nothing: the distinct core sets of this rank's threads, gloo's included."""
    import os

    from shardwise.job.prepare import run_job_here

    def affinities(run) -> dict:
        tids = os.listdir("/proc/self/task")
        sets = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids}
        return {"affinities": [list(cores) for cores in sorted(sets)]}

    return run_job_here(cfg, None, affinities)


def slow_data(run) -> None:
    """A slow data source: every micro-batch takes 40 ms more to load (profile tests)."""
    get = run.train_data.get_batch

    def slow(indices):
        time.sleep(0.04)
        return get(indices)

    run.train_data.get_batch = slow


def slow_rank1(run) -> None:
    """Rank 1 computes 150 ms longer per forward (a straggler, for the profile tests): well
    above the ~50 ms by which the two ranks' own step times can drift apart on 2 busy cores."""
    if run.topo.rank == 1:
        run.model.register_forward_pre_hook(lambda module, args: time.sleep(0.15))


def disk_full_at_second_save(run) -> None:
    """Every rank's second checkpoint write fails as a full disk does (ENOSPC)."""
    import errno

    from shardwise.checkpoint import io

    write, calls = io.write_shard, {"n": 0}

    def fills_up(path, tensors):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, tensors)

    io.write_shard = fills_up


def record_environment(run) -> None:
    """Write what this rank starts with to run.dir/environment-rank<R>.json: its environment,
    its parent's process id and the actions of the signals that stop a job (before training
    installs its own); an exit handler writes run.dir/exited-rank<R> as the process ends."""
    import atexit
    import json
    import os
    import signal

    stops = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP", "SIGQUIT")
    actions = {name: repr(signal.getsignal(getattr(signal, name))) for name in stops}
    seen = {"env": dict(os.environ), "ppid": os.getppid(), "signals": actions}
    Path(run.cfg.run.dir, f"environment-rank{run.topo.rank}.json").write_text(json.dumps(seen))
    # and, as the rank's process ends, that its exit handlers ran
    atexit.register(Path(run.cfg.run.dir, f"exited-rank{run.topo.rank}").write_text, "atexit")
