"""`train.compile=blocks` compiles each block's forward with TorchInductor and trains as the
eager engine does, in every layout it allows: dp2 ZeRO-3, tp2 + sp, pp2 1F1B, LoRA, full
recomputation, dropout and transformers' Llama (the hf-llama preset).

Tolerance: inductor fuses element-wise chains and may reorder fp32 reductions (the norms'
means, softmax sums), so values differ from eager by fp32 rounding; over 6 steps of AdamW the
losses stay within 1e-5 relative and the parameters within 1e-5 (measured here: below 5e-7),
the bound every layout's parity test uses. Compile time dominates this file: blocks of one
shape share a graph and inductor's on-disk cache serves the second process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launchers.harness import run_here, run_world
from shardwise.parallel.compile import compile_summary
from shardwise.training.validate import derive
from support.compare import case, max_param_diff, max_rel

pytestmark = pytest.mark.slow

# micro-batches of 4 rows, so dp2 ZeRO-3 (4 rows a rank) compiles the one-process plain run's
# block graph again and inductor's on-disk cache serves it: a graph of new shapes costs ~13
# kernels of C++ (~0.7 s each) on each rank. pp2 keeps 4 micro-batches of 2 rows: with 2 the
# first stage's order (F F B B) would be GPipe's, and 1F1B's forward after a backward untested
STEPS = ["--train.steps=6", "--train.micro_batch=4"]
ON = "--train.compile=blocks"
ONE = {  # one process: (what it adds to the config)
    "plain": [],
    "lora": ["--finetune.lora_rank=4", "--finetune.lora_alpha=8"],
    "hf": ["--model.name=hf-llama-tiny"],
    "dropout": ["--model.dropout=0.1", "--model.attn_dropout=0.1"],
    "full": ["--memory.recompute=full"],
}
TWO = {  # two ranks, compared with the one-process eager run of the plain config
    "zero3": ["--parallel.zero=3"],
    "tp_sp": ["--parallel.tp=2", "--parallel.sp=true"],
    "pp_1f1b": ["--parallel.pp=2", "--train.micro_batch=2"],
}


def _params(ranks: list[dict]) -> dict:
    """Every rank's parameters in one dict (a pipeline stage holds its own layers)."""
    out: dict = {}
    for result in ranks:
        assert "error" not in result, result["error"]
        out.update(result["params"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("compile")
    eager = {k: run_here(case(*STEPS, *v), str(root / f"e_{k}")) for k, v in ONE.items()}
    compiled = {k: run_here(case(*STEPS, *v, ON), str(root / f"c_{k}")) for k, v in ONE.items()}
    after = compile_summary()  # this process compiled every one-process case
    world = run_world(2, [case(*STEPS, *v, ON) for v in TWO.values()])
    return {
        "eager": eager,
        "compiled": compiled,
        "two": dict(zip(TWO, world, strict=True)),
        "after": after,
    }


@pytest.mark.parametrize("name", list(ONE))
def test_compiled_blocks_train_as_eager(runs, name: str) -> None:
    eager, compiled = runs["eager"][name], runs["compiled"][name]
    assert "error" not in compiled, compiled.get("error")
    assert len(compiled["losses"]) == 6
    assert max_rel(compiled["losses"], eager["losses"]) <= 1e-5
    assert max_param_diff(compiled["params"], eager["params"]) <= 1e-5


@pytest.mark.parametrize("name", list(TWO))
def test_compiled_blocks_in_parallel_layouts(runs, name: str) -> None:
    ranks, eager = runs["two"][name], runs["eager"]["plain"]
    params = _params(ranks)
    assert max_rel(ranks[0]["losses"], eager["losses"]) <= 1e-5
    assert max_param_diff(params, eager["params"]) <= 1e-5


def test_compiling_is_reported_once_and_never_repeated(runs) -> None:
    """The first step's record says what compiling did; a plain decoder block traces whole
    (no graph break), and no later step or micro-batch compiled again: the process's graph
    count after every run equals the sum the first steps reported."""
    first = [r["records"][0]["compile"] for r in runs["compiled"].values()]
    assert all("compile" not in rec for r in runs["compiled"].values() for rec in r["records"][1:])
    plain = runs["compiled"]["plain"]["records"][0]["compile"]
    assert plain["graphs"] >= 1 and plain["graph_breaks"] == 0
    assert runs["after"]["graphs"] == first[-1]["graphs"]  # counters are cumulative


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--memory.recompute=selective"], "torch.compile cannot trace that recomputation"),
        (["--model.name=moe-tiny"], "is an MoE decoder, whose compiled blocks are not tested"),
        (["--parallel.cp=2", "--data.seq_len=64"], "parallel.cp=2 attends"),
    ],
)
def test_untested_combinations_are_refused(extra: list[str], message: str) -> None:
    cfg = load_config(None, [ON, *extra])
    with pytest.raises(ConfigError, match=rf"train.compile=blocks: .*{message}.*Fix:"):
        derive(cfg, 2)


def test_compile_key_is_in_the_docs() -> None:
    assert "train.compile" in (Path(__file__).parents[1] / "docs" / "config.md").read_text()
