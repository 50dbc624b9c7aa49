"""Multi-node jobs for real, on one machine, against the single-host `--nproc 4` run:

* two hosts: two network namespaces joined by a veth link, one node of a 2-node × 2-rank
  job in each (`train --nnodes 2 --node-rank R --rdzv HOST:PORT`);
* Slurm: munged, slurmctld and two slurmd daemons (installed from Debian when missing), and
  the script `shardwise launch slurm --submit` writes, run as a 2-node × 2-rank CPU job.

Each job starts as a plain 2-node run and then fails mid-run (process start-up dominates on
2 cores, so one job proves both): one host's processes are all killed and a replacement node
joins, or the Slurm job is requeued; both must finish from their last checkpoint with the
numbers of the uninterrupted single-host run. A lost host without restarts must fail naming it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.netns import Host, two_hosts
from support.slurm import LocalSlurm, ensure_installed

pytestmark = pytest.mark.slow

PYTHON = sys.executable
STEPS = 20
TINY = [
    "--model.n_layers=2",
    "--data.seq_len=32",
    "--train.global_batch=8",
    f"--train.steps={STEPS}",
    "--train.eval_every=0",
    "--log.every=5",
    "--log.progress=off",
    "--run.device=cpu",
]
PARITY = ("loss", "grad_norm", "lr", "tokens")
RESUMED = r"resumed(?: after restart \d+)? from \S+ at step (\d+)"  # printed by rank 0


def clean_env() -> dict[str, str]:
    """This environment minus any launcher's, so every command starts its own ranks."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("SLURM")}
    env.setdefault("SHARDWISE_CACHE", os.path.expanduser("~/.cache/shardwise"))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_parity(ours: list[dict], reference: list[dict]) -> None:
    """Same numbers as the single-host run: the layout (4 dp ranks) is the same, only the
    transport differs, so the collectives sum in the same order."""
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    for key in PARITY:
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in reference], rel=1e-6), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The plain single-host run: `shardwise train --nproc 4`."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    cmd = [PYTHON, "-m", "shardwise.cli.main", "train", "--nproc", "4", *TINY]
    proc = subprocess.run(
        [*cmd, f"--run.dir={run_dir}"], env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return records(run_dir)


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)")
    stack = two_hosts()
    try:
        pair = stack.__enter__()
    except OSError as exc:
        stack.__exit__(None, None, None)
        pytest.skip(f"this kernel/container does not allow network namespaces: {exc}")
    try:
        yield pair
    finally:
        stack.__exit__(None, None, None)


def start_node(host: Host, node_rank: int, rdzv: str, run_dir: Path, log: Path, *extra: str):
    cmd = [PYTHON, "-m", "shardwise.cli.main", "train", "--nnodes", "2", "--nproc", "2"]
    cmd += ["--node-rank", str(node_rank), "--rdzv", rdzv, *TINY, f"--run.dir={run_dir}", *extra]
    with log.open("w") as out:
        return subprocess.Popen(
            host.command(cmd), env=clean_env(), stdout=out, stderr=subprocess.STDOUT, text=True
        )


def wait_all(procs: list[subprocess.Popen], logs: list[Path], hosts, timeout: float) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for host in hosts:
            host.kill_all()
        pytest.fail("job did not finish in time:\n" + "\n".join(p.read_text() for p in logs))
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log.read_text()[-3000:]


def test_a_lost_host_without_restarts_fails_naming_it(
    hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    """Kill every process on host b mid-run: node 0 stops at once (no hang) with one message
    naming the lost node's address and how to make the job survive it."""
    a, b = hosts
    rdzv, run_dir = f"{a.addr}:29402", tmp_path / "run"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    node0 = start_node(a, 0, rdzv, run_dir, logs[0])
    node1 = start_node(b, 1, rdzv, run_dir, logs[1])
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):  # training has begun
        assert node0.poll() is None and node1.poll() is None, logs[0].read_text()
        assert time.monotonic() < deadline, "no step in time"
        time.sleep(0.05)
    assert b.kill_all(), "nothing ran on host b"
    node0.wait(timeout=120)
    log = logs[0].read_text()
    assert node0.returncode == 2, log
    # what follows is the ranks' failure (or, when the hang watchdog sees it first, its report)
    assert f"error: node 0: lost contact with the node at {b.addr}: " in log, log
    assert "Fix: --max-restarts N with --checkpoint.every=M" in log
    assert "Traceback" not in log, log


def wait_for_checkpoint(run_dir: Path, alive: Callable[[], bool], timeout: float = 300) -> int:
    """Block until the job has committed a checkpoint; returns the steps logged by then, so
    the caller can prove its fault struck mid-run (the job could otherwise outrun it)."""
    latest, metrics = run_dir / "checkpoints" / "latest", run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not latest.is_file():
        assert alive(), "the job ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def rx_bytes(host: Host) -> int:
    out = subprocess.run(
        ["ip", "-n", host.netns, "-j", "-s", "link", "show"], capture_output=True, text=True
    ).stdout
    return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(out) if link["ifname"] != "lo")


def test_a_lost_host_is_replaced_and_the_job_resumes(
    reference: list[dict], hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    """Two hosts run one job; kill every process on host b (agent and ranks: the host is
    gone), start a replacement node there: node 0's agent restarts its ranks in a new
    rendezvous round with it and the job continues from the newest checkpoint to the same
    numbers as the uninterrupted single-host run. (One job covers the plain two-host run too:
    its first round is that run, and the parity below holds only if both rounds were exact.)"""
    a, b = hosts
    rdzv, run_dir = f"{a.addr}:29401", tmp_path / "run"
    before = rx_bytes(a)
    extra = ("--checkpoint.every=2", "--max-restarts", "1")
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1-new.log"]
    node0 = start_node(a, 0, rdzv, run_dir, logs[0], *extra)
    node1 = start_node(b, 1, rdzv, run_dir, logs[1], *extra)
    done = wait_for_checkpoint(run_dir, lambda: node0.poll() is None and node1.poll() is None)
    assert b.kill_all(), "nothing ran on host b"
    assert done < STEPS, "the job finished before the host was killed"
    node1.wait(timeout=30)
    assert node1.returncode != 0
    replacement = start_node(b, 1, rdzv, run_dir, logs[2], *extra)
    wait_all([node0, replacement], [logs[0], logs[2]], hosts, timeout=400)
    ours = records(run_dir)
    assert_parity(ours, reference)
    assert "nodes: 2 x 2 ranks; dp=4 across nodes" in logs[0].read_text()
    # The gradients crossed the link: an all-reduce must bring each host at least the other
    # host's partial sum, the full gradient size, every step.
    assert rx_bytes(a) - before >= STEPS * ours[-1]["mem_bytes"]["grads"]
    # node 0's agent restarted its ranks (restart 1); they resumed from a mid-run checkpoint
    resumed = re.findall(RESUMED, logs[0].read_text() + logs[2].read_text())
    assert resumed and all(2 <= int(step) < STEPS for step in resumed), resumed
    assert "resumed after restart 1 from" in logs[0].read_text() + logs[2].read_text()


# --- Slurm -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    with LocalSlurm(nodes=2, cpus=2) as cluster:
        yield cluster


def submit(cluster: LocalSlurm, workdir: Path, *extra: str) -> str:
    """`shardwise launch slurm ... --submit` in `workdir`; returns the job id it printed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [PYTHON, "-m", "shardwise.cli.main", "launch", "slurm", "--nodes", "2"]
    cmd += ["--cpus-per-node", "2", "--port", str(port), "-o", "job.sbatch", "--submit"]
    cmd += [*TINY, f"--run.dir={workdir / 'run'}", *extra]
    env = {**clean_env(), "SLURM_CONF": cluster.env["SLURM_CONF"]}
    proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = re.search(r"submitted Slurm job (\d+)", proc.stdout)
    assert found, proc.stdout
    return found.group(1)


def test_requeued_slurm_job_finishes_from_its_checkpoint(
    reference: list[dict], slurm: LocalSlurm, tmp_path: Path
) -> None:
    job = submit(slurm, tmp_path, "--checkpoint.every=2")
    slurm.wait_job(job, timeout=300, until=("RUNNING",))
    done = wait_for_checkpoint(
        tmp_path / "run", lambda: slurm.job_state(job)["JobState"] == "RUNNING"
    )
    slurm.run(["scontrol", "requeue", job])
    assert done < STEPS, "the job finished before it was requeued"
    # Slurm holds a requeued job for ~2 minutes (BeginTime); release it now.
    while slurm.job_state(job)["JobState"] != "PENDING":
        time.sleep(0.2)
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    state = slurm.wait_job(job, timeout=300)
    log = (tmp_path / f"shardwise-tiny-{job}.out").read_text()
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), log
    assert (state["NumNodes"], state["NumTasks"], state["NodeList"]) == ("2", "2", "node[1-2]")
    assert "DUE TO JOB REQUEUE" in log  # both attempts wrote to the one log
    # one agent per node, in each of the two attempts (the plain 2 x 2 run is the first)
    assert log.count("nodes: 2 x 2 ranks; dp=4 across nodes") == 4, log
    resumed = re.findall(RESUMED, log)
    assert resumed and 2 <= int(resumed[0]) < STEPS, log
    # Slurm's requeue stops the job with SIGTERM: every rank finished its step and the job
    # saved it (checkpoint.on_signal), so the requeued job resumes exactly there, not at the
    # last periodic checkpoint
    stopped = re.findall(r"stopped by SIGTERM after step (\d+)", log)
    assert stopped and int(stopped[0]) == int(resumed[0]), log
    assert_parity(records(tmp_path / "run"), reference)
