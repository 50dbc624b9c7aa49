"""`shardwise plan`'s output and limits: any device count answers at once, memory is in GiB
as cards are sold, layouts that cannot differ are one row, a candidate prints as the `train`
command that runs it, and the data settings planned say where they came from."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from shardwise.cli.main import main
from shardwise.plan.search import _divisors

SHARDWISE = str(Path(sys.executable).with_name("shardwise"))
# 7B with LoRA on one 24 GB card: ZeRO-1 and ZeRO-2 both fit with the optimizer offloaded
LORA_7B = [
    "--hardware", "rtx4090", "--devices", "1", "--model", "7b", "--precision.compute=bf16",
    "--precision.reduce=bf16", "--data.seq_len=1024", "--train.global_batch=16",
    "--finetune.lora_rank=16", "--finetune.lora_targets=wq,wk,wv,wo",
]  # fmt: skip
TINY_JOB = ["--model", "tiny", "--data.seq_len=64", "--train.global_batch=8"]


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_billion_devices_answers_at_once():
    """The layout search used to list the divisors of the device count by trying every number
    up to it: a billion devices printed nothing for minutes. The real CLI now answers (a
    limit, named with its fix) well inside the timeout."""
    proc = subprocess.run(
        [SHARDWISE, "plan", "--devices", "1000000000", "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "--devices=1000000000" in proc.stderr and "Fix:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_more_devices_than_any_layout_can_use_is_refused_with_the_bound(capsys):
    """tiny has 4 heads and 4 layers and the batch is 16 samples, so at most 16 x 4 x 4 = 256
    ranks can hold a piece of the job: more is refused at once with that product (it used to
    search every divisor and end in 'no layout fits. Fix: more devices')."""
    code, _, err = _plan(capsys, "--hardware", "h100", "--devices", "100000", "--model", "tiny")
    assert code == 2
    assert "--devices=100,000 is more than any layout of this job can use" in err, err
    assert "global batch 16 (dp) x 4 layers (pp) x 4" in err and "= 256 ranks" in err, err
    assert "Fix: --devices 256 or fewer" in err


def test_divisors_come_from_the_prime_factors():
    """The factorised divisors are exactly the brute-force ones, and a billion's 100 divisors
    (2^9 5^9) come without looping to a billion."""
    for n in range(1, 3000):
        assert _divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    big = _divisors(10**9)
    assert len(big) == 100 and big[0] == 1 and big[-1] == 10**9 and big == sorted(big)
    assert _divisors(2**31 - 1) == [1, 2**31 - 1]  # a prime: trial division to its root only


def test_memory_is_in_gib_with_the_unit_beside_it(capsys):
    """A "24 GB" RTX 4090 holds 24 GiB: the header shows 24.0 GiB (it showed "26 GB", decimal,
    beside cards named by their GiB), the table's memory columns say GiB and so does the
    spare memory; no decimal GB figure is left."""
    code, out, _ = _plan(capsys, *LORA_7B, "--top", "3", "--misses", "2")
    assert code == 0
    header = out.splitlines()[0]
    assert "on 1 x rtx4090 (24.0 GiB, data sheet)" in header and "memory in GiB" in header
    assert "peak GiB" in out and "GiB spare" in out
    assert "closest layouts that do not fit (24.0 GiB device, 64.0 GiB host per device)" in out
    assert " GB" not in out, out


def test_layouts_that_cannot_differ_are_one_row(capsys):
    """With one data-parallel replica ZeRO shards nothing: ZeRO-1 and ZeRO-2 with the
    optimizer offloaded were two identical rows. They are one row, zero '1/2', and --json
    keeps one candidate naming the equivalent stage."""
    code, out, _ = _plan(capsys, *LORA_7B, "--top", "3")
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:5]]
    assert rows[0][4] == "1/2" and [r[4] for r in rows[1:]] == ["0", "0"], out
    shown = [" ".join(r[1:]) for r in rows]
    assert len(set(shown)) == len(shown), out
    code, out, _ = _plan(capsys, *LORA_7B, "--json", "--top", "100")
    cands = json.loads(out)["candidates"]
    assert cands[0]["zero"] == 1 and cands[0]["equivalent_zero"] == [2]
    same = {k: v for k, v in cands[0].items() if k not in ("zero", "equivalent_zero")}
    for other in cands[1:]:  # no other row is that layout under another stage
        rest = {k: v for k, v in other.items() if k not in ("zero", "equivalent_zero")}
        assert rest != same


def test_print_command_is_the_train_command_of_that_candidate(capsys):
    """`--print-command N` prints `shardwise train ...` with the job's own settings and
    candidate N's layout; the train CLI parses it into exactly that layout, which the engine
    accepts; `--json` carries the same flags per candidate."""
    from shardwise.cli.main import parser
    from shardwise.config import load_config, split_overrides
    from shardwise.training.validate import derive

    base = ["--hardware", "h100", "--devices", "2", *TINY_JOB]
    code, out, _ = _plan(capsys, *base, "--json", "--top", "3")
    cands = json.loads(out)["candidates"]
    assert code == 0 and all(c["train_flags"] for c in cands)
    for n, cand in enumerate(cands, 1):
        code, out, _ = _plan(capsys, *base, "--print-command", str(n))
        assert code == 0
        argv = shlex.split(out.strip())
        assert argv[:2] == ["shardwise", "train"], out
        own, overrides = split_overrides(argv[2:])
        args, rest = parser("train").parse_known_args(own)
        assert not rest and args.nproc == "2" and args.config is None
        cfg = load_config(None, overrides)
        assert cfg.model.name == "tiny" and cfg.data.seq_len == 64
        assert cfg.train.global_batch == 8
        got = (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero, cfg.train.micro_batch)
        assert got == (cand["tp"], cand["pp"], cand["zero"], cand["micro_batch"]), out
        assert (cfg.memory.recompute, cfg.memory.offload) == (cand["recompute"], cand["offload"])
        assert set(cand["train_flags"]) <= set(overrides), (cand["train_flags"], overrides)
        derive(cfg, 2)  # the engine's own checks accept it
    code, _, err = _plan(capsys, *base, "--print-command", "999")
    assert code == 2 and "--print-command 999" in err and "Fix: --print-command 1.." in err


def test_print_command_spans_nodes_with_one_agent_each(capsys):
    """Past one node the command is torch elastic's: --nnodes, the ranks per node, and each
    node's index and node 0's address from the environment."""
    args = ["--hardware", "h100", "--devices", "64", "--model", "70b", "--precision.compute=bf16"]
    args += ["--data.seq_len=4096", "--train.global_batch=1024", "--print-command", "1"]
    code, out, _ = _plan(capsys, *args)
    assert code == 0
    assert "--nnodes=8 --nproc=8 --node-rank=$NODE_RANK --rdzv=$MASTER_ADDR:29400" in out, out


def test_default_data_settings_are_marked_and_warned(capsys):
    """`plan --model 175b` alone used to price seq_len 128, global batch 16 and fp32 (the
    config defaults, sized for the tiny preset) without a word. The header marks each as
    '(default)' and a warning names them with a fix; given ones are neither marked nor
    warned about."""
    code, out, err = _plan(capsys, "--hardware", "h100", "--devices", "16", "--model", "175b")
    assert code == 0, err
    header, warning = out.splitlines()[:2]
    assert "seq_len 128 (default), global batch 16 (default), fp32 (default)" in header
    assert warning.startswith("warning: seq_len 128, global batch 16, precision fp32")
    assert "tiny preset" in warning and "Fix:" in warning and "--data.seq_len=" in warning
    given = ["--data.seq_len=2048", "--train.global_batch=64", "--precision.compute=bf16"]
    code, out, _ = _plan(capsys, "--hardware", "h100", "--devices", "16", "--model", "175b", *given)
    assert code == 0
    assert "(default)" not in out and "warning: seq_len" not in out
    code, out, err = _plan(capsys, "--hardware", "h100", "--devices", "16", "--model", "175b",
                           "--json", "--data.seq_len=2048")  # fmt: skip
    json.loads(out)  # stdout stays JSON; the warning goes to stderr
    assert "global batch 16, precision fp32" in err and "seq_len" not in err.split("Fix")[0]


def test_print_command_needs_an_architecture(capsys):
    """--params plans model states only: there is no layout to train, so --print-command is
    refused with the fix (not silently ignored)."""
    code, _, err = _plan(capsys, "--params", "7e9", "--devices", "8", "--print-command", "1")
    assert code == 2 and "--print-command needs a model architecture" in err


def test_a_model_without_transformer_blocks_is_sent_to_explain(capsys):
    """A ResNet has no blocks the layout search can price (it used to answer "no layout of
    0-layer, 0-wide model fits", as if the model were empty): one line naming the model and
    `shardwise explain`, which predicts its memory exactly."""
    code, _, err = _plan(capsys, "--model.name=resnet18", "--devices", "2", "--hardware", "cpu")
    assert code == 2 and "model.name='resnet18'" in err and "shardwise explain" in err, err
    assert "0-layer" not in err and err.count("\n") == 1, err
