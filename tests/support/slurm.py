"""A real Slurm cluster on one machine for tests: munged, slurmctld and one slurmd per
simulated node, all on localhost, without systemd or cgroups. Every daemon runs in the
foreground as a child of the test (stopped by its PID), every file lives in a private
temporary directory, and the commands (`sbatch`, `scontrol`) find the cluster through
$SLURM_CONF. Debian packages: slurmctld, slurmd, slurm-client, munge."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "scontrol", "munged"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_installed(timeout: float = 300) -> str | None:
    """Install the packages with apt when missing; None when ready, else why not."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm/munge are not installed and apt-get is not usable here (needs root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for step in ([install], [["apt-get", "update", "-q"], install]):
        for cmd in step:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 and all(shutil.which(b) for b in BINARIES):
            return None
    return f"could not install {' '.join(PACKAGES)} with apt: {proc.stderr.strip()[-500:]}"


def _conf(root: Path, nodes: int, cpus: int, ctl_port: int, ports: list[int]) -> str:
    host = socket.gethostname()
    node_lines = [
        f"NodeName=node{i + 1} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={cpus} State=UNKNOWN"
        for i, port in enumerate(ports)
    ]
    return "\n".join(
        [
            "ClusterName=shardwise-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            # no cgroups, no systemd: plain process tracking, no task binding
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",  # start requeued jobs promptly
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool-%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd-%n.log'}",
            *node_lines,
            f"PartitionName=debug Nodes=node[1-{nodes}] Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


class LocalSlurm:
    """`with LocalSlurm(nodes=2, cpus=2) as cluster:` — a running cluster; `cluster.env` is
    the environment for Slurm commands."""

    def __init__(self, nodes: int = 2, cpus: int = 2) -> None:
        self.nodes, self.cpus = nodes, cpus
        self.root = Path(tempfile.mkdtemp(prefix="shardwise-slurm-"))
        self.root.chmod(0o755)  # munged runs as the munge user and must reach its directory
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def _start(self, cmd: list[str], name: str, **kw) -> None:
        log = (self.root / f"{name}.out").open("w")
        self.procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, **kw)
        )

    def _munge(self) -> None:
        d = self.root / "munge"
        d.mkdir()
        d.chmod(0o711)  # munged: the socket directory must be searchable by everyone
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (d, key):
            shutil.chown(path, "munge", "munge")
        opts = [f"--socket={d / 'munge.socket'}", f"--key-file={key}"]
        opts += [f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}"]
        opts += [f"--seed-file={d / 'munged.seed'}"]
        self._start(["munged", "-F", *opts], "munged", user="munge", group="munge", extra_groups=[])
        self._wait(lambda: (d / "munge.socket").exists(), "munged", 20)

    def __enter__(self) -> LocalSlurm:
        try:
            self._munge()
            ports = [_free_port() for _ in range(self.nodes)]
            conf = _conf(self.root, self.nodes, self.cpus, _free_port(), ports)
            (self.root / "slurm.conf").write_text(conf)
            (self.root / "state").mkdir()
            conf_flag = ["-f", str(self.root / "slurm.conf")]
            self._start(["slurmctld", "-D", "-i", *conf_flag], "slurmctld")
            for i in range(self.nodes):
                self._start(["slurmd", "-D", "-N", f"node{i + 1}", *conf_flag], f"slurmd{i + 1}")
            self._wait(self._nodes_idle, "the nodes to come up idle", 60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
        return len(out) == self.nodes and all(s == "idle" for s in out)

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}: daemons exited {dead}\n{self.logs()}")
            time.sleep(0.3)

    def run(self, cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
        return proc

    def job_state(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key → value (JobState, Restarts, ExitCode, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: str, timeout: float, until=("COMPLETED", "FAILED")) -> dict:
        """Poll until the job reaches one of `until` (or a terminal state); returns its record."""
        terminal = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if state["JobState"] in set(until) | terminal:
                return state
            if time.monotonic() > deadline:
                self.run(["scancel", job_id], check=False)
                raise TimeoutError(f"job {job_id} still {state['JobState']}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        names = [
            "munged.out",
            "slurmctld.log",
            *(f"slurmd-node{i + 1}.log" for i in range(self.nodes)),
        ]
        parts = [(self.root / n).read_text()[-2000:] for n in names if (self.root / n).exists()]
        return "\n".join(parts)

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):  # end running jobs before their daemons go
            self.run(["scancel", "--full", "--quiet", "-u", "root"], check=False)
            deadline = time.monotonic() + 15
            while self.run(["squeue", "-h"], check=False).stdout.strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.3)
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)
