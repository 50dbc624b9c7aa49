"""Packing instruction records (`data.pack=true`) beside padding them and beside transformers'
padding-free collator, side by side in one run.

What it measures: a Llama (4 layers, 256 wide; a BPE tokenizer trained here) on Alpaca-style
records built from the Python standard library's module docstrings (instruction: give the
docstring's first line; input: the rest), seq_len 512, one process, fp32, AdamW, 8 rows per
step. Engines: ours with one padded record per row; ours packed (records share rows, attention
masked per record, positions restarting); the peer: the same transformers model trained by a
plain PyTorch loop over `DataCollatorWithFlattening` batches of as many records as our packed
step holds on average (records concatenated into one row, `position_ids` restarting, which
transformers turns into per-record attention). Printed: median step time, records and response
tokens per second, and the ratio to the padded run. The peer's labels are the same response
tokens shifted the way transformers' loss shifts them (one token per record fewer).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import add_smoke, load, median, preamble, steady, table
from shardwise.launchers.harness import run_here


def records(limit: int) -> list[dict]:
    """Alpaca records from real text: stdlib module docstrings (no download)."""
    import pkgutil

    out = []
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if info.name.startswith("_") or len(out) >= limit:
            continue
        try:
            spec = info.module_finder.find_spec(info.name)
            text = Path(spec.origin).read_text(errors="ignore") if spec and spec.origin else ""
        except (OSError, ValueError, AttributeError):
            continue
        if text.startswith('"""') and text.count('"""') >= 2:
            doc = text[3 : text.index('"""', 3)].strip()
            first, _, rest = doc.partition("\n")
            if first and rest.strip():
                out.append(
                    {
                        "instruction": "Give the first line of this documentation.",
                        "input": rest.strip()[:600],
                        "output": first,
                    }
                )
    return out


def checkpoint(root: Path, rows: list[dict], dim: int, layers: int) -> Path:
    """A Llama checkpoint (random weights) and a byte-level BPE trained on the records."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(r.values()) for r in rows], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(root / "ckpt")
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=dim,
        intermediate_size=int(dim * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "ckpt")
    (root / "inst.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "ckpt"


def peer(data, per_step: int, steps: int, ckpt: Path, lr: float) -> list[float]:
    """transformers' padding-free training: a plain loop over DataCollatorWithFlattening."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    collate = transformers.DataCollatorWithFlattening(return_position_ids=True)
    times = []
    for step in range(steps):
        feats = []
        for j in range(per_step):
            i = (step * per_step + j) % len(data.lengths)
            n = int(data.lengths[i])
            x, y = data.inputs[i, :n].tolist(), data.targets[i, :n].tolist()
            feats.append({"input_ids": x, "labels": [-100, *y[: n - 1]]})
        batch = collate(feats)
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    add_smoke(parser)
    args = parser.parse_args()
    dim, layers, seq, limit = 256, 4, 512, 400
    if args.smoke:
        args.steps, dim, layers, seq, limit = 2, 64, 1, 512, 60
    preamble()
    from shardwise.config import load_config
    from shardwise.data import data_spec, load_data

    with tempfile.TemporaryDirectory(prefix="packing-bench-") as tmp:
        root = Path(tmp)
        ckpt = checkpoint(root, records(limit), dim, layers)
        base = [
            "--model.name=hf",
            f"--model.init_from={ckpt}",
            f"--data.dataset={root / 'inst.jsonl'}",
            "--data.format=instruction",
            f"--data.seq_len={seq}",
            "--data.val_fraction=0",
            f"--data.cache_dir={root / 'cache'}",
            "--train.global_batch=8",
            f"--train.steps={args.steps}",
            "--train.lr=1e-4",
            "--train.eval_every=0",
            "--train.eval_batches=0",
        ]
        print(f"case: {' '.join(base[2:])} (model: {layers} x {dim} Llama)")
        padded_data = load_data(data_spec(load_config(None, base), 1 << 20), "train")
        packed_cfg = load_config(None, [*base, "--data.pack=true"])
        packed_data = load_data(data_spec(packed_cfg, 1 << 20), "train")
        per_row = len(packed_data.lengths) / len(packed_data)
        targets_per_record = packed_data.counts.mean()
        runs = {
            "ours padded": (run_here({"overrides": base}, str(root / "a")), 1.0),
            "ours packed": (
                run_here({"overrides": [*base, "--data.pack=true"]}, str(root / "b")),
                per_row,
            ),
        }
        per_step = max(1, round(8 * per_row))
        peer_times = peer(padded_data, per_step, args.steps, ckpt, 1e-4)
    rows, base_rate = [], None
    for name, (res, recs_per_row) in runs.items():
        step = median(steady([r["step_time_s"] for r in res["records"]]))
        rate = 8 * recs_per_row / step
        base_rate = base_rate or rate
        rows.append(
            [name, f"{step * 1000:.0f}", f"{rate:.1f}", f"{rate * targets_per_record:,.0f}"]
        )
        rows[-1].append(f"{rate / base_rate:.2f}")
    step = median(steady(peer_times))
    rate = per_step / step
    peer_row = ["transformers flattening", f"{step * 1000:.0f}", f"{rate:.1f}"]
    rows.append([*peer_row, f"{rate * targets_per_record:,.0f}", f"{rate / base_rate:.2f}"])
    print(f"{len(packed_data.lengths)} records, {per_row:.2f} per packed row of {seq} tokens")
    header = ["engine (1 process)", "step ms", "records/s", "response tokens/s", "/ padded"]
    print(table(header, rows))
    print(f"load average at the end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
