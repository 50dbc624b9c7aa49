"""Peak memory of `shardwise data prepare` on two corpus sizes: flat when it streams.

Two corpora of JSON lines built as benchmarks/data_prepare.py builds them (the standard
library's sources, each copy with its own first line), `--gb` and `--scale` times that, one
byte-level BPE saved as a Hugging Face tokenizer folder, and the command line run on each
with `--workers N`. Each run is a child process that reports its own peak resident set
(`getrusage` RUSAGE_SELF: the process that reads, splits and writes) and its largest worker's
(RUSAGE_CHILDREN, the worker processes it waited for). A prepare that held the corpus would
grow with it; one that streams stays put. `--src DIR` measures the package in DIR instead
(another checkout's `src/`), so two versions compare on the same corpora.

    .venv/bin/python benchmarks/data_prepare_memory.py [--gb 0.05] [--scale 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_smoke, preamble, table
from data_prepare import build_corpus, build_tokenizer

# Runs the command line in this child and prints its peak RSS and its workers' (kB on Linux).
_CHILD = """
import json, resource, sys
from shardwise.cli.data import data_main
status = data_main(sys.argv[1:])
me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"status": status, "self_kb": me, "workers_kb": workers}))
"""


def run(corpus: Path, tok: Path, out: Path, workers: int, src: str) -> dict:
    """One prepare of `corpus` in a child process: its peaks, seconds and token count."""
    args = [str(corpus), "--out", str(out), "--tokenizer", str(tok), "--workers", str(workers)]
    env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, "prepare", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode or not proc.stdout.strip():
        raise SystemExit(f"prepare of {corpus} failed:\n{proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    m = json.loads((out / "manifest.json").read_text())
    got["tokens"] = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    got["docs"] = m["splits"]["train"]["docs"] + m["splits"]["val"]["docs"]
    return {**got, "s": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.05, help="smaller corpus, GB (default 0.05)")
    ap.add_argument("--scale", type=float, default=4.0, help="larger / smaller (default 4)")
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE tokens (default 8192)")
    ap.add_argument("--src", default="", help="measure the package in this src/ instead")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.gb, args.scale, args.vocab = 0.001, 2.0, 512
    preamble()
    scratch = Path(tempfile.mkdtemp(prefix="shardwise-bench-prepare-mem-"))
    rows, peaks = [], []
    try:
        sizes = (args.gb, round(args.gb * args.scale, 6))
        for gb in sizes:
            corpus = scratch / f"corpus-{gb}"
            size = build_corpus(corpus, gb)
            if gb == sizes[0]:
                build_tokenizer(corpus, scratch / "tok", args.vocab)
            r = run(corpus, scratch / "tok", scratch / f"out-{gb}", args.workers, args.src)
            peaks.append(r["self_kb"])
            rows.append([f"{size / 1e9:.3f}", f"{r['docs']:,}", f"{r['tokens']:,}",
                         f"{r['self_kb'] / 1024:.0f}", f"{r['workers_kb'] / 1024:.0f}",
                         f"{r['s']:.1f}"])  # fmt: skip
            shutil.rmtree(corpus)  # one corpus on disk at a time
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    head = ["corpus GB", "documents", "tokens", "prepare peak MB", "worker peak MB", "s"]
    print(table(head, rows))
    what = args.src or "this checkout"
    print(f"peak RSS, larger / smaller corpus: {peaks[1] / peaks[0]:.2f}x for "
          f"{args.scale:g}x the text (workers {args.workers}; {what})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
