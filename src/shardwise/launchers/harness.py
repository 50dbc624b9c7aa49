"""The parity harness: one world of N gloo ranks runs a list of cases.

Process start-up dominates on small machines, so a world is started once and every case
(a list of `--section.key=value` overrides, optionally a hook or the PyTorch-peer flag, and
the run description its caller's job layer derived, if any) runs in it in turn. Each rank
returns its losses, per-step records and final parameters. For the tests,
`run_cases`/`run_named` run one rank in the calling process and compute a case that several
test modules share (the same overrides, hook and peer on as many ranks) once."""

from __future__ import annotations

import importlib
import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from shardwise.distributed.store import listening_store
from shardwise.launchers.rank_start import PRELOAD, start_method

BASE = ["--log.tensorboard=false", "--log.progress=off", "--log.every=1000000"]


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _run_case(case: dict, run_dir: str) -> dict:
    from shardwise.config import load_config
    from shardwise.job.prepare import run_job_here
    from shardwise.training.loop import fit

    cfg = load_config(None, [*BASE, f"--run.dir={run_dir}", *case.get("overrides", [])])
    derived = case.get("derived")  # the caller's job layer validated it for this world
    if case.get("peer"):
        peer = _resolve(case["peer"])
        return peer(cfg) if derived is None else peer(cfg, derived=derived)
    # no launcher prepared this world's job: this rank's part of it validates (or takes the
    # caller's description) and locks here
    return run_job_here(cfg, derived, lambda run: _train_case(case, run, fit))


def _or_error(run, case: dict, run_dir: str) -> dict:
    """`run(case, run_dir)`, or its failure as `{"error": ...}` for the test to report."""
    try:
        return run(case, run_dir)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}


def _train_case(case: dict, run, fit) -> dict:
    if case.get("hook"):
        _resolve(case["hook"])(run)
    records = fit(run)
    if hasattr(run.reducer, "full_parameters"):  # ZeRO: gather shards back to full shape
        params = run.reducer.full_parameters()
        zero = {
            "peak_gathered": run.reducer.peak_gathered,
            "unit_bytes": [u.full_bytes for u in run.reducer.units],
        }
    else:
        params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
        zero = {}
    params = run.tp.full_parameters(params, run.info.device)  # tp shards -> full shape
    if getattr(run, "expert_parallel", None) is not None:  # expert slices -> full shape
        params = run.expert_parallel.full_parameters(params, run.info.device)
    buffers = {}
    if getattr(run, "return_buffers", False):
        buffers = {
            n: b.detach().float().cpu().clone()
            for n, b in run.model.named_buffers()
            if b.is_floating_point()
        }
    from shardwise.finetune.quant import quant_layers

    return {
        "buffers": buffers,
        "zero": zero,
        # a quantised base: per layer, (elements this rank read from the checkpoint, out, in)
        "quant": {n: (m.read_elements, *m.shape) for n, m in quant_layers(run.model)},
        "losses": [r["loss"] for r in records],
        "records": records,
        "params": params,
        "scales": [r["loss_scale"] for r in records],
        "skipped": [r["skipped"] for r in records],
        "resume_note": run.resume_note,
    }


# how long a rank waits for the world's store and for its peers' keys
STORE_TIMEOUT_S = 300.0


def _worker(
    rank: int, world: int, port: int, cases: list[dict], out_dir: str, env: dict[str, str]
) -> None:
    import datetime

    import torch.distributed as dist

    # a rank forks from the server with the server's environment: take the caller's
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    results = []
    for i, case in enumerate(cases):
        results.append(_or_error(_run_case, case, os.path.join(out_dir, f"case{i}")))
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(results, fh)
    dist.destroy_process_group()


# Ranks fork from a server process that imported torch and the training code once, for all
# the worlds this process starts; `_worker` hands them the caller's environment
_PRELOAD = [*PRELOAD, __name__]


def run_world(nproc: int, cases: list[dict]) -> list[list[dict]]:
    """Run `cases` on `nproc` ranks; returns results[case][rank]. The world's store is hosted
    here, on a loopback port the kernel picks and held until the ranks are done: no other
    process can take the port between choosing and binding it."""
    store = listening_store("127.0.0.1", 0, STORE_TIMEOUT_S)
    with tempfile.TemporaryDirectory() as out_dir:
        args = (nproc, store.port, cases, out_dir, dict(os.environ))
        mp.start_processes(_worker, args=args, nprocs=nproc, start_method=start_method(_PRELOAD))
        per_rank = [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(nproc)]
    return [[per_rank[r][i] for r in range(nproc)] for i in range(len(cases))]


def run_side_by_side(groups: list[list[dict]]) -> list[list[list[dict]]]:
    """One single-process world per group, all at once: a rank runs one intra-op thread, so
    independent single-process runs use the machine's other cores instead of queueing."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(lambda cases: run_world(1, cases), groups))


def run_here(case: dict, run_dir: str) -> dict:
    """Run one case in this process as a single rank (no spawn); a process group created for
    it is destroyed afterwards."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    try:
        return _run_case(case, run_dir)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run_cases_here(cases: list[dict]) -> list[list[dict]]:
    """`run_world(1, cases)` without spawning: this process is the one rank (a spawned rank
    spends ~4 s CPU importing torch before its first case)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a spawned rank runs
    results = []
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            for i, case in enumerate(cases):
                results.append([_or_error(run_here, case, os.path.join(out_dir, f"case{i}"))])
    finally:
        torch.set_num_threads(threads)
    return results


# (nproc, case) -> its per-rank results, for this process's lifetime: test modules that run
# the same case (the plain DP run is the reference of several) compute it once
_DONE: dict[str, list[dict]] = {}


def run_cases(nproc: int, cases: list[dict]) -> list[list[dict]]:
    """`run_world`, except that one rank runs in this process and a case this process already
    ran on `nproc` ranks (the same overrides, hook and peer) is not run again. For tests:
    timing benchmarks call `run_world`."""
    keys = [repr((nproc, sorted(c.items()))) for c in cases]
    results = {i: _DONE[k] for i, k in enumerate(keys) if k in _DONE}
    todo = [i for i in range(len(cases)) if i not in results]
    if todo:
        fresh = [cases[i] for i in todo]
        ran = _run_cases_here(fresh) if nproc == 1 else run_world(nproc, fresh)
        for i, per_rank in zip(todo, ran, strict=True):
            results[i] = per_rank
            if all("error" not in r for r in per_rank):  # a failure is never reused
                _DONE[keys[i]] = per_rank
    return [results[i] for i in range(len(cases))]


def run_named(nproc: int, cases: dict[str, dict]) -> dict[str, list[dict]]:
    """`run_cases` over named cases: each name maps to its per-rank results; a case that
    failed on any rank fails the caller with every failed rank's error. A rank that fails
    first leaves the others waiting for it until the collective timeout, so the errors that
    are not timeouts come first: they are the cause."""
    results = run_cases(nproc, list(cases.values()))
    out = {}
    for name, per_rank in zip(cases, results, strict=True):
        errors = [(rank, r["error"]) for rank, r in enumerate(per_rank) if "error" in r]
        errors.sort(key=lambda e: "timed out" in e[1].lower())
        assert not errors, f"{name}: " + "\n".join(f"rank {k}: {e}" for k, e in errors)
        out[name] = per_rank
    return out


def run_named_worlds(worlds: dict[int, dict[str, dict]]) -> dict[int, dict[str, list[dict]]]:
    """`run_named` for several worlds at once: each multi-rank world from its own thread, the
    single-process one in this thread. A single process leaves the other cores idle and the
    ranks of one world idle while they wait for each other, so a fixture's worlds side by
    side take less time than one after another (the same work, fewer idle cores)."""
    from concurrent.futures import ThreadPoolExecutor

    spawned = [n for n in worlds if n > 1]
    with ThreadPoolExecutor(max(1, len(spawned))) as pool:
        running = {n: pool.submit(run_named, n, worlds[n]) for n in spawned}
        out = {n: run_named(n, cases) for n, cases in worlds.items() if n == 1}
        out.update({n: future.result() for n, future in running.items()})
    return out
