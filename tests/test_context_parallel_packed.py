"""Context parallelism with packed records (data.pack=true) on the built-in decoder: each rank
holds its zig-zag part of every packed row, positions restart per record as on one process,
and the ring and Ulysses kernels attend within each record (parallel/context_comm.py).

fp32, Alpaca-style records of 147-211 tokens packed two to a 384-token row (tests/
test_packing.py's data and checkpoint shape: 4 query and 2 k/v heads), 4 steps of LoRA: cp 2
(dp 2 x cp 2) and cp 4, ring and Ulysses, cp 2 x tp 2 with sequence parallelism, and GPT-2
(learned positions) at cp 4 must reproduce the single process's losses, gradient norms and
final parameters, and the planner must predict the cp traffic exactly.
One 4-rank world runs every multi-rank case, one process the references."""

from __future__ import annotations

import pytest

from shardwise.config import load_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_named_worlds
from shardwise.plan.hardware import get_hardware
from support.compare import assert_reproduces

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

from test_instruct import instruction_checkpoint  # noqa: E402
from test_packing import _overrides  # noqa: E402

ULYSSES = "--parallel.cp_mode=ulysses"
CASES = {
    "cp2_ring": ["--parallel.cp=2"],
    "cp2_ulysses": ["--parallel.cp=2", ULYSSES],
    "cp4_ring": ["--parallel.cp=4"],
    "cp4_ulysses": ["--parallel.cp=4", ULYSSES],
    # tp splits the heads, sp each cp rank's part of the sequence again
    "cp2_tp2_sp_ring": ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true"],
    # GPT-2's learned position table, read at the positions within each record
    "gpt2_cp4_ring": ["--parallel.cp=4"],
}


def _base(root, name: str) -> list[str]:
    """The reference's overrides of case `name`: the built-in decoder in the checkpoint's
    shape (its weights), or gpt2-tiny (its own init) with the checkpoint's tokenizer."""
    dec = _overrides(root, hf=False)
    if not name.startswith("gpt2"):
        return dec
    mine = [o for o in dec if not o.startswith("--model.init_from")]
    return [*mine, "--model.name=gpt2-tiny", f"--data.tokenizer={root / 'ckpt'}"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_packed")
    instruction_checkpoint(root, max_positions=512)
    return root


@pytest.fixture(scope="module")
def worlds(root):
    four = {name: {"overrides": [*_base(root, name), *extra]} for name, extra in CASES.items()}
    one = {ref: {"overrides": _base(root, ref)} for ref in ("ref", "gpt2")}
    return run_named_worlds({1: one, 4: four})


@pytest.mark.parametrize("name", list(CASES))
def test_packed_cp_reproduces_one_process(worlds, name):
    """Losses and gradient norms within 1e-5 relative, parameters within 1e-5, on every rank
    (a tp rank's gathered to full shape). It trained; a position counted from the rank's
    part instead of the record, or a record seeing another, moves the first loss already."""
    ref = worlds[1]["gpt2" if name.startswith("gpt2") else "ref"][0]
    assert ref["losses"][-1] < ref["losses"][0]
    assert len(ref["losses"]) == 4
    assert_reproduces(name, worlds[4][name], ref)


@pytest.mark.parametrize("name", list(CASES))
def test_packed_cp_traffic_is_predicted_byte_for_byte(worlds, root, name):
    """comm_bytes.cp and comm_calls.cp as the planner predicts them (Ulysses gathers the
    record starts with the positions; the ring sends what it sends unpacked) equal what
    comm.py counted, on every rank and step."""
    cfg = load_config(None, [*_base(root, name), *CASES[name]])
    pred = explain_record(cfg, 4, get_hardware("cpu", calibrate=False))
    for rank in worlds[4][name]:
        for rec in rank["records"]:
            assert rec["comm_bytes"]["cp"] == pred["comm_bytes"]["cp"] > 0, (name, rec, pred)
            assert rec["comm_calls"]["cp"] == pred["comm_calls"]["cp"], (name, rec, pred)
