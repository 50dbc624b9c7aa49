"""`shardwise data prepare` vs `datasets.Dataset.map(batched=True, num_proc=N)`, side by side.

One corpus of JSON lines built from text on this machine (the Python standard library's
sources, repeated with a varying first line so that no copy is a duplicate of another, to
`--gb` gigabytes), one byte-level BPE tokenizer (trained once on its first 32 M characters
and saved as a Hugging Face tokenizer folder), and two ways to tokenise all of it with N
processes: `shardwise data prepare CORPUS --tokenizer TOK --workers N` (read, split, encode,
write checksummed shards: the command line, start-up included) and the usual `datasets`
recipe, `load_dataset("json")` then `map(tokenize, batched=True, num_proc=N)` (read into
Arrow, encode, write Arrow). Both count the same tokens (each document's ids and its
end-of-text token); the table gives tokens/s of each and their ratio.

    .venv/bin/python benchmarks/data_prepare.py [--gb 1.0] [--workers 2] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from common import add_smoke, preamble, table

FILE_MB = 32  # per .jsonl file of the corpus: several files, as a real corpus comes


def build_corpus(root: Path, gb: float) -> int:
    """Write `gb` GB of JSON lines (one standard-library source file per row, each copy's
    rows starting with a line naming the copy) into `root`, once; return the bytes."""
    done = root / "complete.marker"  # not a corpus suffix: prepare skips it
    if done.is_file() and json.loads(done.read_text())["gb"] == gb:
        return json.loads(done.read_text())["bytes"]
    if root.is_dir() and any(p.name != done.name for p in root.iterdir()):
        if not done.is_file():  # never delete what this script did not write
            sys.exit(
                f"--corpus {root} holds files this benchmark did not write. Fix: an "
                "empty or new directory."
            )
        shutil.rmtree(root)  # our own corpus, of another size
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" not in path.parts:
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
    target, total, copy, part = int(gb * 1e9), 0, 0, 0
    f = open(root / f"part-{part:04d}.jsonl", "w")  # noqa: SIM115 - rotated below
    while total < target:
        for i, text in enumerate(texts):
            row = json.dumps({"text": f"# copy {copy} of file {i}: {copy * 7919 % 104729}\n{text}"})
            f.write(row + "\n")
            total += len(row) + 1
            if f.tell() > FILE_MB * 1e6:
                f.close()
                part += 1
                f = open(root / f"part-{part:04d}.jsonl", "w")  # noqa: SIM115
            if total >= target:
                break
        copy += 1
    f.close()
    done.write_text(json.dumps({"gb": gb, "bytes": total}))
    return total


def build_tokenizer(corpus: Path, out: Path, vocab: int) -> None:
    """A byte-level BPE of `vocab` tokens on the corpus's first 32 M characters, saved as a
    Hugging Face tokenizer folder (the one both sides load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts, budget = [], 32_000_000
    with open(sorted(corpus.glob("*.jsonl"))[0]) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            budget -= len(texts[-1])
            if budget <= 0:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)


def run_ours(corpus: Path, tok: Path, out: Path, workers: int) -> tuple[float, int]:
    """(seconds, tokens) of `shardwise data prepare` with `workers` processes."""
    shardwise = Path(sys.executable).with_name("shardwise")
    cmd = [str(shardwise), "data", "prepare", str(corpus), "--out", str(out)]
    cmd += ["--tokenizer", str(tok), "--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    seconds = time.perf_counter() - start
    m = json.loads((out / "manifest.json").read_text())
    return seconds, m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]


def run_peer(corpus: Path, tok_dir: Path, cache: Path, workers: int) -> tuple[float, int]:
    """(seconds, tokens) of load_dataset("json") + map(batched=True, num_proc=workers)."""
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    eos = tok.eos_token_id

    def encode(batch: dict) -> dict:
        return {"input_ids": [[*ids, eos] for ids in tok(batch["text"])["input_ids"]]}

    files = [str(p) for p in sorted(corpus.glob("*.jsonl"))]
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(cache))
    ds = ds.map(encode, batched=True, num_proc=workers, remove_columns=["text"])
    seconds = time.perf_counter() - start
    tokens = pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py()
    return seconds, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (default 1)")
    ap.add_argument("--workers", type=int, default=2, help="processes of each side (default 2)")
    ap.add_argument("--vocab", type=int, default=32768, help="BPE tokens (default 32768)")
    ap.add_argument(
        "--corpus", default="", help="where the corpus is built and kept (default: temp dir)"
    )
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.gb, args.vocab = 0.004, 1024
    preamble()
    scratch = Path(tempfile.mkdtemp(prefix="shardwise-bench-prepare-"))
    corpus = Path(args.corpus or Path(tempfile.gettempdir()) / f"shardwise-corpus-{args.gb}gb")
    try:
        t0 = time.perf_counter()
        size = build_corpus(corpus, args.gb)
        build_tokenizer(corpus, scratch / "tok", args.vocab)
        print(f"corpus {corpus}: {size / 1e9:.3f} GB of JSON lines, ready in "
              f"{time.perf_counter() - t0:.0f} s; BPE of {args.vocab} tokens")  # fmt: skip
        env_threads = os.environ.get("OMP_NUM_THREADS", "")
        ours = run_ours(corpus, scratch / "tok", scratch / "prepared", args.workers)
        peer = run_peer(corpus, scratch / "tok", scratch / "hf-cache", args.workers)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for name, (seconds, tokens) in (
        (f"shardwise data prepare --workers {args.workers}", ours),
        (f"datasets map(batched=True, num_proc={args.workers})", peer),
    ):
        rows.append([name, f"{tokens:,}", f"{seconds:.1f}", f"{tokens / seconds / 1e6:.3f}"])
    print(table(["tokeniser", "tokens", "s", "M tokens/s"], rows))
    ratio = (ours[1] / ours[0]) / (peer[1] / peer[0])
    print(f"ours / datasets tokens/s: {ratio:.2f}x; same token count: {ours[1] == peer[1]}")
    print(f"(OMP_NUM_THREADS={env_threads or 'unset'}; start-up of the CLI included in ours)")
    return 0 if ours[1] == peer[1] else 1


if __name__ == "__main__":
    raise SystemExit(main())
