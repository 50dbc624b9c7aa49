"""Run several benchmarks' `--smoke` mode in this one process (tests/test_benchmarks.py).

Each script runs as `python SCRIPT --smoke` would (as `__main__`, with that argv), one after
another; what matters for the suite's time is that they share one interpreter, one torch
import and one warm forkserver for their worlds instead of paying for them per script. Per
script one JSON line on stdout at the end: name, exit status, the tail of what the script
printed and of its error, its seconds. A benchmark that fails is reported, and the next one
still runs.

    .venv/bin/python benchmarks/smoke_all.py recompute.py zb_split.py
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAIL = 3000


def run_one(name: str) -> dict:
    out, err, code, start = io.StringIO(), io.StringIO(), 0, time.monotonic()
    argv = sys.argv
    sys.argv = [str(HERE / name), "--smoke"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(HERE / name), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # report it and go on with the next script
        err.write(traceback.format_exc())
        code = 1
    finally:
        sys.argv = argv
    return {
        "name": name,
        "rc": code,
        "stdout": out.getvalue()[-TAIL:],
        "stderr": err.getvalue()[-TAIL:],
        "secs": round(time.monotonic() - start, 1),
    }


def main() -> int:
    sys.path.insert(0, str(HERE))  # the scripts import `common` (and each other) as siblings
    results = [run_one(name) for name in sys.argv[1:]]
    for r in results:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
