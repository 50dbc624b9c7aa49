"""The end of a process that ran a job: without the interpreter's exit-time garbage collections.

A process that imported torch and the training code tracks some 250,000 objects, and Python's
shutdown walks all of them in full collections while it clears the modules: about a second
of CPU per process on a quiet machine. At the end of a local job the ranks and then the
launcher each pay it, and on a busy machine that CPU comes slowly: of a SIGTERM'd 2-rank run
at load 16, 13 s from the signal to the launcher's exit, 0.2 s were the step, the save and
closing the run, the rest the three processes' shutdowns (docs/checkpoints.md). A
preempted job spends its grace period there, after its checkpoint is written.

Freezing the collector's generations at exit (`gc.freeze`) leaves those objects out of the
exit collections; their memory goes back with the process. Everything else of a shutdown still
runs: the atexit handlers (those registered later run before this one), the modules' teardown,
which releases what they hold by reference count (a file held by a module closes and
flushes), and C++ destructors. What no longer runs are the finalizers of objects that only a
reference cycle keeps alive at exit, which Python's data model does not promise to run for
objects alive at interpreter exit either; a job closes what it writes before it returns
(checkpoints committed, metrics and trackers closed).

Ranks forked from a launch's server (launchers/rank_start.py) skip the shutdown altogether:
the forkserver ends its children straight after their function returns. `rank_process_main`
runs the exit handlers first, so those still run.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def skip_exit_collection() -> None:
    """Leave the objects this process holds at exit out of the interpreter's exit-time garbage
    collections (registered once per process)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
