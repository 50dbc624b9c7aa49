"""`python -m support.faultjob HOOK NPROC [--section.key=value ...]`: what
`shardwise train --nproc NPROC` does, with a fault hook ("module:function") applied to every
rank's run before training. The hang-diagnosis tests run faulty jobs through it; `job_env` is
the environment a test starts such a job (or `shardwise train`) with."""

from __future__ import annotations

import os
import sys

from shardwise.config import load_config
from shardwise.data import prepare_data
from shardwise.errors import ShardwiseError, print_error
from shardwise.launchers.local import launch_local
from shardwise.training.runtime import data_spec
from shardwise.training.validate import derive

# what a launcher tells its ranks: a job started with these set would join that launch
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def job_env() -> dict[str, str]:
    """This environment minus any launcher's, with one intra-op thread: the environment of a
    job that a test starts in a subprocess and that must start its own ranks."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


def main(argv: list[str] | None = None) -> int:
    hook, nproc, *overrides = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(None, overrides)
        prepare_data(data_spec(cfg, derive(cfg, int(nproc)).spec.vocab_size))
        launch_local(cfg, int(nproc), hook)
    except ShardwiseError as exc:
        return print_error(exc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
