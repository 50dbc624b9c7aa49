"""How ranks on this machine start: forked from a server that imported torch and the training
code once, instead of each importing them itself.

A spawned rank imports torch, TorchDynamo and the training code before its first step: about
2 CPU-s per rank, most of a short job's start-up on a small machine (and the launcher process
has paid it already). A forkserver imports them once and forks every rank from that state.
Its children inherit the server's environment as it was when the server started, not their
parent's at the time of the start: a launch therefore starts the server afresh and stops it
at its end (`fresh_forkserver`), while the parity harness hands its callers' environment to
its ranks itself. Where the platform has no forkserver, ranks are spawned.

A launch's server ignores the signals that stop a job. Slurm's requeue and a `kill` of the
job's process group signal every process, the server too; the agent learns how each rank
ended through the server, so a server gone at the first signal would have it stop waiting
while the ranks still finish their step and save. A forked rank takes the signals' usual
actions back at once (a fork hook the server registers; SIGINT, which the forkserver resets
to ignored, in `as_rank`). The server ends when the agent does: each rank closes the server's
pipe it inherits (`as_rank`), so the server sees the agent's end close it, and the ranks then
get the SIGINT torch elastic asks for when their parent dies, as spawned ranks got it from the
agent's death. A forked rank ends without Python's shutdown (the forkserver's children exit
straight after their function returns): `rank_process_main` runs the exit handlers itself.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver

# what every rank imports before its first step
PRELOAD = ["torch", "torch._dynamo", "shardwise.training.runtime", "shardwise.training.loop"]
# set only while `fresh_forkserver` starts its server, which imports this module first
SERVER_ENV = "SHARDWISE_RANK_SERVER"
# what stops a job besides SIGINT (training/preempt.py saves on SIGTERM, SIGUSR1, SIGINT); the
# forkserver itself ignores SIGINT and resets it to ignored in its children
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)


def start_method(preload: list[str]) -> str:
    """The forkserver method, its server importing `preload` when it starts, where the
    platform has one; else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"


def _stop_server() -> None:
    forkserver._forkserver._stop()  # closes its pipe and waits for it; nothing if not running


@contextmanager
def fresh_forkserver(preload: list[str]) -> Iterator[str]:
    """The start method for one launch's ranks: a forkserver started now (so its ranks see this
    process's environment as it is, with the variables the launcher has just set), which
    ignores the stop signals, stopped when the launch ends. Spawn where the platform has no
    forkserver."""
    method = start_method([__name__, *preload])
    if method != "forkserver":
        yield method
        return
    _stop_server()  # one started earlier (an earlier launch, the harness) has an older environment
    os.environ[SERVER_ENV] = "1"
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(SERVER_ENV, None)
    try:
        yield method
    finally:
        _stop_server()


def as_rank() -> None:
    """In a rank forked from a launch's server: the usual SIGINT action (the forkserver left it
    ignored), and the server's pipe closed, so the server ends with the agent. What a
    spawned rank has anyway."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:  # (a spawned rank has none)
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None


def _usual_stop_actions() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def _server_ignores_stop_signals() -> None:
    """At import, in a launch's server only (the variable is set just for its start, and taken
    out of its environment here, so its ranks do not inherit it): ignore the stop signals, and
    give each forked rank their usual actions back as it is forked."""
    if os.environ.pop(SERVER_ENV, None) == "1":
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        os.register_at_fork(after_in_child=_usual_stop_actions)


_server_ignores_stop_signals()
