"""The training loop: fetch → micro-steps → clip → step → log, top to bottom."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.checkpoint import io
from shardwise.checkpoint.manager import Checkpointer
from shardwise.data import GlobalSampler, split_for_rank
from shardwise.data.prefetch import Fetch
from shardwise.distributed import device as dev
from shardwise.distributed.clock import clock
from shardwise.errors import CheckpointError
from shardwise.models import build_on_meta
from shardwise.models.dropout import random_stream, samples
from shardwise.optim import StepResult, lr_at
from shardwise.parallel.compile import compile_summary
from shardwise.parallel.data import sync_buffers
from shardwise.profile import ledger
from shardwise.profile.capture import Capture, capture_for
from shardwise.training.memory import model_state_bytes, step_memory
from shardwise.training.metrics import METRICS, MetricsLogger, done_line, flops_per_token
from shardwise.training.nonfinite import NonFiniteGuard
from shardwise.training.preempt import Preempted, StopRequest
from shardwise.training.runtime import Run


def fit(run: Run) -> list[dict]:
    """Train up to `train.steps` optimizer steps (continuing a checkpoint per
    `checkpoint.resume`); returns the per-step metric records of the steps run here."""
    cfg, d = run.cfg, run.derived
    peak = run.info.peak_flops(cfg.precision.compute)
    # the whole model's FLOPs, not this rank's tensor-parallel slice
    step_flops = flops_per_token(build_on_meta(d.spec), d) * d.tokens_per_step
    ckpt = Checkpointer(run)
    start = ckpt.resume()  # the step to continue from (0: a fresh run)
    if start >= cfg.train.steps:  # before the logger: a finished run's files stay untouched
        ckpt.close()
        _nothing_to_do(run, start, ckpt.root)
        return []
    logger = MetricsLogger(run, start, ckpt.record)
    guard = NonFiniteGuard(run)
    stop = StopRequest(ckpt.root)
    stop = stop.install() if cfg.checkpoint.on_signal else stop
    capture = capture_for(run, start)  # `shardwise profile`: traces of the last steps
    clock().on = cfg.log.ledger or capture.active  # the ledger: where each step's time went
    fetch = Fetch(run.train_data, cfg.data.prefetch)  # loads ahead in threads when asked
    # a resumed run saves its last step even with checkpoint.every=0: else the next run (and
    # export) would take the older checkpoint it resumed from and train the tail again
    count = _target_count(run)
    loop = _Loop(ckpt, logger, guard, stop, capture, fetch, count, step_flops, peak, start > 0)
    try:
        records, signum = _steps(run, start, loop)
        if not signum and records and cfg.checkpoint.on_signal:
            # a signal after the last step's check (during its save or log line): the job
            # is stopping, so say so with its checkpoint rather than wait for the launcher
            signum = _late_signal(run, stop)
            if signum:
                ckpt.maybe_save(records[-1]["step"], records[-1], force=True)
        capture.close()  # every rank writes its part, then waits for the others' files
    except BaseException:
        logger.close_after_error()
        raise
    finally:
        stop.close()
        capture.stop()  # (after an error too, without a collective: nothing can hang here)
        fetch.close()
    ckpt.close()  # (waits for an async save: a stopped job exits with its checkpoint written)
    logger.close()
    saved = str(io.step_dir(ckpt.root, ckpt.saving_step)) if ckpt.saving_step else None
    if signum:  # told to stop, and saved: the caller exits 128 + signum
        raise Preempted(signum, records[-1]["step"], saved, metrics=str(logger.path))
    if run.topo.rank == 0:  # the last line: what was written where
        print(done_line(run.cfg, records[-1]["step"], logger.path, saved), flush=True)
    return records


def _nothing_to_do(run: Run, start: int, root: Path) -> None:
    """A resumed checkpoint at or past `train.steps`: say so instead of exiting silently."""
    cfg = run.cfg
    if start > cfg.train.steps:
        elsewhere = "another --checkpoint.dir" if cfg.checkpoint.dir else "a new --run.dir"
        raise CheckpointError(
            f"the checkpoint resumed is at step {start}, past train.steps={cfg.train.steps}: "
            f"nothing to train. Fix: --train.steps=N with N > {start} to continue it, or "
            f"{elsewhere} to start over."
        )
    if run.topo.rank == 0:
        resumed = cfg.checkpoint.resume  # a path, or the step's folder in checkpoint.dir
        if resumed == "auto":
            resumed = str(io.step_dir(root, start))
        print(
            f"shardwise: already complete at step {start}: nothing to do (run dir "
            f"{cfg.run.dir}, metrics {Path(cfg.run.dir) / METRICS}, checkpoint {resumed}; "
            f"--train.steps=N with N > {start} trains further)",
            flush=True,
        )


def _late_signal(run: Run, stop: StopRequest) -> int:
    """A stop signal any rank received after the last step's check (every rank asks: one
    all-reduce at the end of the run)."""
    flag = torch.tensor([float(stop.signum)], dtype=torch.float64, device=run.info.device)
    run.comm.all_reduce_world(flag, "max")
    return int(flag.item())


def _micro(run: Run, step: int, batch: torch.Tensor | None = None) -> list[torch.Tensor]:
    """This rank's micro-batches of `step` (its slice of the global batch); none past the end."""
    if step >= run.cfg.train.steps:
        return []
    batch = run.sampler.global_indices(step) if batch is None else batch
    return split_for_rank(batch, run.dp_rank, run.derived.dp, run.derived.micro_batch)


def _micro_steps(run: Run, micro, ahead, global_count: int, scale: float, fetch):
    """Forward and backward of each micro-batch (no pipeline); (summed loss, peak activation
    bytes)."""
    clk, device = clock(), run.info.device
    loss_sum = torch.zeros((), device=device)
    act_peak = 0
    for i, idx in enumerate(micro):
        run.reducer.sync = i == len(micro) - 1
        run.reducer.start_micro_batch()
        with clk.phase("data"):
            fetched = fetch(idx, micro[i + 1 :] + ahead)
            inputs, targets = (t.to(device, non_blocking=True) for t in fetched)
        with samples(idx):
            with run.meter.measure(), clk.phase("forward"):
                loss = run.loss_sum(inputs, targets) / global_count
                if run.experts is not None:  # MoE: the balance loss's gradient, loads
                    loss = run.experts.after_forward(loss, global_count)
            act_peak = max(act_peak, run.meter.take_peak())
            with clk.phase("backward"):  # recomputation redraws the same masks
                (loss * scale).backward()
        with clk.phase("backward"):  # the last gradient buckets' reduction
            run.reducer.finish()
        loss_sum += loss.detach()
    return loss_sum, act_peak


@dataclass
class _Loop:
    """What the steps use beside the run, made once by `fit`."""

    ckpt: Checkpointer
    logger: MetricsLogger
    guard: NonFiniteGuard
    stop: StopRequest
    capture: Capture  # or its stand-in that does nothing (profile/capture.capture_for)
    fetch: Fetch
    count: Callable[[torch.Tensor], int]  # a step's global batch -> its target tokens
    step_flops: float  # the whole model's FLOPs per step (for MFU)
    peak: float | None  # the devices' peak FLOP/s (None: unknown, no MFU)
    save_last: bool  # save the last step whatever checkpoint.every says (a resumed run)


def _steps(run: Run, start: int, loop: _Loop) -> tuple[list[dict], int]:
    """The training steps from `start`; returns their records and the stop signal that ended
    them early (0: none)."""
    cfg, clk = run.cfg, clock()
    records = []
    t_start = clk.start()  # each step's ledger runs to the next one's: the log line included
    for step in range(start, cfg.train.steps):
        if loop.capture.step_begins(step):  # waited for the other ranks: the step starts now
            t_start = clk.start()
        lr = lr_at(step, cfg)
        run.optimizer.set_lr(lr)
        dev.reset_peak_memory(run.info)
        run.comm.start_step()
        t0 = time.perf_counter()
        # fetch: this rank's slice of the step's global batch, cut into micro-batches
        micro, global_count = _fetch(run, loop, step)
        run.reducer.zero_grad()
        scale = run.optimizer.scaler.scale
        # micro-steps: gradient sync only while the last micro-batch runs backward
        loss_sum, act_peak = _forward_backward(run, loop, step, micro, global_count, scale)
        # clip + step, skipped on every rank alike when the loss (reduced first, so every rank
        # decides on the same number) or the reduced gradient norm is not finite
        local_loss = loss_sum.clone()
        result, moe = _optimizer_step(run, loss_sum)
        step_time = time.perf_counter() - t0
        # log: one record, its memory and any stop signal taken over all ranks
        record, signum = _record(run, loop, step, lr, result, step_time, act_peak, scale)
        record.update(moe)  # moe_load_max_mean, moe_dropped, moe_aux_loss (MoE models)
        _add_step_notes(run, loop, record, result, local_loss, step == start)
        # maybe checkpoint (async: a host snapshot only); always when told to stop
        _checkpoint_and_eval(run, loop, step, record, signum)
        if clk.on:  # from the end of the last step's ledger (its log line) to here
            t_start = _add_ledger(record, t_start)
        loop.capture.step_ends(step, record)
        loop.logger.log(record)
        records.append(record)
        if signum:
            return records, signum
        loop.guard.check(step + 1, record, scale)  # stops after train.max_skipped_steps in a row
    return records, 0


def _target_count(run: Run) -> Callable[[torch.Tensor], int]:
    """The global count of target tokens of a step's global batch, which the loss is divided
    by (prompts masked: every rank counts the whole batch, so the normaliser is the same in
    every layout without a collective)."""
    counted = getattr(run.train_data, "targets_in", None)  # only some tokens are targets
    per_step = run.cfg.train.global_batch * run.derived.tokens_per_sample
    return counted if counted else lambda batch: per_step


def _fetch(run: Run, loop: _Loop, step: int) -> tuple[list[torch.Tensor], int]:
    """This rank's micro-batches of `step` and the global count of target tokens the loss is
    divided by."""
    with clock().phase("data"):
        batch = run.sampler.global_indices(step)
        micro = _micro(run, step, batch)
        global_count = loop.count(batch)
    return micro, global_count


def _forward_backward(
    run: Run, loop: _Loop, step: int, micro: list[torch.Tensor], global_count: int, scale: float
) -> tuple[torch.Tensor, int]:
    """Forward and backward of the step's micro-batches, through the pipeline schedule when
    pp > 1; (summed loss, peak activation bytes)."""
    # dropout masks are keyed by (seed, step, global sample), never by the layout
    with random_stream(run.cfg.train.seed, step):
        if run.pipeline is not None:  # pp > 1: the schedule runs them through the stages
            return run.pipeline.train_step(run, micro, global_count, scale)
        fetch = loop.fetch
        ahead = _micro(run, step + 1) if fetch.depth else []  # the next step's too
        return _micro_steps(run, micro, ahead, global_count, scale, fetch)


def _optimizer_step(run: Run, loss_sum: torch.Tensor) -> tuple[StepResult, dict]:
    """Clip and step on the loss summed over dp; (the step's result, MoE's load metrics)."""
    with clock().phase("optimizer"):
        # every tp rank holds the whole loss of its dp replica: sum over dp only
        run.comm.all_reduce(loss_sum, "dp", control=True)
        # the loss comes to the host with the gradient norm, in one transfer
        result = run.optimizer.step(loss_sum)
        # MoE: loads summed over the global batch move every rank's bias alike
        moe = run.experts.after_step(run.comm, result.skipped) if run.experts else {}
        sync_buffers(run.model, run.comm)
        dev.synchronize(run.info)
    return result, moe


def _add_step_notes(
    run: Run,
    loop: _Loop,
    record: dict,
    result: StepResult,
    local_loss: torch.Tensor,
    first: bool,
) -> None:
    """What the record says beside the metrics: a skipped step's non-finite tensors, the
    pipeline's report, and (the `first` step) what compiling did."""
    if result.skipped:  # which tensors / ranks (the guard pools every rank's view)
        record["nonfinite"] = loop.guard.diagnose(local_loss, result.nonfinite)
    if run.pipeline is not None:
        record["pipeline"] = run.pipeline.report(run.info.device)
    if run.cfg.train.compile != "false" and first:  # what compiling did, once
        _note_compile(run, record)


def _checkpoint_and_eval(run: Run, loop: _Loop, step: int, record: dict, signum: int) -> None:
    """Save the step when due (or told to stop, or the last step of a resumed run), then
    measure the held-out loss when due and not stopping."""
    clk, cfg = clock(), run.cfg
    # before evaluating: a failure there must not cost the step's checkpoint
    with clk.phase("checkpoint"):
        last = loop.save_last and step + 1 == cfg.train.steps
        loop.ckpt.maybe_save(step + 1, record, force=bool(signum) or last)
    if not signum and _eval_due(run, step):  # told to stop: saved, and leaving
        with clk.phase("eval"):
            record.update(evaluate(run))


def _add_ledger(record: dict, t_start: float) -> float:
    """The step's ledger (where its time went since `t_start`) into `record`; returns where
    the next step's ledger starts."""
    t_end, totals, overlapped = clock().take()
    record["ledger"] = ledger.build(t_end - t_start, totals, overlapped)
    return t_end


def _record(
    run: Run,
    loop: _Loop,
    step: int,
    lr: float,
    result: StepResult,
    step_time: float,
    act_peak: int,
    scale: float,
) -> tuple[dict, int]:
    """The step's metrics record (memory as the max over ranks) and the stop signal any rank
    received (0: none)."""
    d = run.derived
    # bookkeeping collectives are counted apart from the step's traffic
    comm = run.comm.take_step()
    mem = step_memory(model_state_bytes(run.model, run.reducer, run.optimizer), act_peak)
    device_peak = dev.peak_memory(run.info)
    if device_peak is not None:
        mem["device_peak"] = device_peak
    mem["stop_signal"] = loop.stop.signum  # a signal on any rank stops all of them here
    mem = _max_over_ranks(run, mem)
    signum = mem.pop("stop_signal")
    tokens_per_s = d.tokens_per_step / step_time
    record = {
        "step": step + 1,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": lr,
        "tokens": d.tokens_per_step * (step + 1),
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_s,
        "mfu": loop.step_flops / step_time / (loop.peak * d.world) if loop.peak else None,
        "mem_bytes": mem,
        **comm,  # comm_bytes, comm_calls, comm_wait_s
        "skipped": result.skipped,
        "loss_scale": scale,
        "time": time.time(),  # when the step ended (unix s): gaps between steps show
    }
    return record, signum


def _note_compile(run: Run, record: dict) -> None:
    """Record what compiling the blocks did (the first step), and say it on rank 0."""
    record["compile"] = compile_summary()
    if run.topo.rank == 0:
        c = record["compile"]
        print(
            f"shardwise: compiled blocks: {c['graphs']} graph(s), "
            f"{c['graph_breaks']} graph break(s) {c['break_reasons'] or ''}",
            file=sys.stderr,
            flush=True,
        )


def _eval_due(run: Run, step: int) -> bool:
    """Whether the held-out loss is measured after `step`: every train.eval_every steps and
    after the last."""
    cfg = run.cfg
    eval_every = cfg.train.eval_every
    return bool(
        run.val_data is not None
        and cfg.train.eval_batches
        and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == cfg.train.steps)
    )


def _max_over_ranks(run: Run, mem: dict[str, int]) -> dict[str, int]:
    keys = sorted(mem)
    values = torch.tensor([mem[k] for k in keys], dtype=torch.float64, device=run.info.device)
    run.comm.all_reduce_world(values, "max")
    return {k: int(v) for k, v in zip(keys, values.tolist(), strict=True)}


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Mean loss (and accuracy for classifiers) over the first `train.eval_batches` global
    batches of the held-out split."""
    cfg, d = run.cfg, run.derived
    n_val = len(run.val_data)
    batch = min(cfg.train.global_batch, n_val - n_val % d.dp)
    sampler = GlobalSampler(n_val, batch, cfg.train.seed)
    sums = torch.zeros(2, dtype=torch.float64, device=run.info.device)  # loss, correct
    classifies = d.tokens_per_sample == 1 and run.user_loss is None  # class labels
    count = 0
    counted = getattr(run.val_data, "targets_in", None)  # only some tokens are targets
    run.model.eval()  # BatchNorm uses its running statistics
    for step in range(cfg.train.eval_batches):
        parts = split_for_rank(sampler.global_indices(step), run.dp_rank, d.dp, batch // d.dp)
        if run.pipeline is not None:  # pp > 1: forwards through the stages, loss on the last
            sums[0] += run.pipeline.forward_only(run, run.val_data, parts)
        else:
            for idx in parts:
                inputs, targets = (t.to(run.info.device) for t in run.val_data.get_batch(idx))
                if classifies:  # labels (a split vocabulary has no local argmax)
                    loss, logits = run.loss_sum(inputs, targets, return_logits=True)
                    sums[1] += (logits.argmax(-1) == targets).sum().double()
                else:  # the loss alone: train.loss_chunks keeps the logits unwhole here too
                    loss = run.loss_sum(inputs, targets)
                sums[0] += loss.double()
        count += counted(sampler.global_indices(step)) if counted else batch * d.tokens_per_sample
    run.model.train()
    run.comm.all_reduce(sums, "dp", control=True)
    out = {"eval_loss": float(sums[0]) / count}
    if classifies:
        out["eval_accuracy"] = float(sums[1]) / count
    return out
