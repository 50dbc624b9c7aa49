"""checkpoint.format=dcp: step directories written by torch.distributed.checkpoint, resumed in
any layout.

One spawned 4-rank world runs eight cases in turn: dp4 ZeRO-3 saving DCP checkpoints at steps
4 and 8 (the reference), the same with the shardwise format (the same tensors, bit for bit),
the same saving asynchronously, the same resumed from its step 4, tp2 x pp2 resuming that
checkpoint, a bf16 PowerSGD run and its resume, and dp2 x cp2 saving DCP checkpoints. The
one-process resumes (of ZeRO-3's and of cp2's step 4), the damaged-checkpoint refusals and the
exports run in this process."""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint import dcp_format, slices
from shardwise.checkpoint import io as io
from shardwise.cli.main import main
from shardwise.errors import CheckpointError, ConfigError
from shardwise.launchers.harness import run_here, run_world
from support.compare import case, max_param_diff, max_rel

RUN = ["--train.steps=8", "--checkpoint.every=4"]
DCP = "--checkpoint.format=dcp"
HALF, END = "step-00000004", "step-00000008"
BF16_PSGD = ["--precision.compute=bf16", "--parallel.grad_compression=powersgd"]


def _ckpt(root: Path, name: str, *extra: str) -> dict:
    return case(*RUN, *extra, f"--checkpoint.dir={root / name}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("dcp")
    z3 = "--parallel.zero=3"
    cases = {
        "z3": _ckpt(root, "z3", z3, DCP),
        "z3_shardwise": _ckpt(root, "z3_shardwise", z3),
        "z3_async": _ckpt(root, "z3_async", z3, DCP, "--checkpoint.async=true"),
        "z3_resumed": _ckpt(
            root, "z3_resumed", z3, DCP, f"--checkpoint.resume={root / 'z3' / HALF}"
        ),
        # bf16 parameters beside fp32 masters, and PowerSGD's per-rank state (rank-keyed)
        "bf16_psgd": _ckpt(root, "bf16_psgd", DCP, *BF16_PSGD),
        "bf16_psgd_resumed": _ckpt(
            root, "bf16_psgd_r", DCP, *BF16_PSGD, f"--checkpoint.resume={root / 'bf16_psgd' / HALF}"
        ),
        "tp2_pp2": _ckpt(
            root,
            "tp2_pp2",
            "--parallel.tp=2",
            "--parallel.pp=2",
            DCP,
            f"--checkpoint.resume={root / 'z3' / HALF}",
        ),
        # dp2 x cp2: the cp ranks hold the same dense parameters (resumed below at cp 1)
        "cp2": _ckpt(root, "cp2", "--parallel.cp=2", DCP),
    }
    out: dict = {"root": root}
    for name, per_rank in zip(cases, run_world(4, list(cases.values())), strict=True):
        for r in per_rank:
            assert "error" not in r, f"{name}: {r['error']}"
        # pipeline stages hold their own layers: the union of every rank's full-shape params
        params = {k: v for r in per_rank for k, v in r["params"].items()}
        out[name] = {**per_rank[0], "params": params}
    # one process, the shardwise format for its own saves: the format only decides writing
    resumed = case(
        *RUN, f"--checkpoint.dir={root / 'dp1'}", f"--checkpoint.resume={root / 'z3' / HALF}"
    )
    out["dp1"] = run_here(resumed, str(tmp_path_factory.mktemp("dp1")))
    cp1 = case(
        *RUN, f"--checkpoint.dir={root / 'cp1'}", f"--checkpoint.resume={root / 'cp2' / HALF}"
    )
    out["cp1"] = run_here(cp1, str(tmp_path_factory.mktemp("cp1")))
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    index = io.read_index(path)
    if index.get("storage") == "dcp":  # one dcp.load for all (slices.read_tensor: one each)
        return dcp_format.read_all(path, index["tensors"])
    return {key: slices.read_tensor(path, key, index) for key in index["tensors"]}


def _resumed_like(got: dict, ref: dict) -> None:
    """Steps 5-8 after resuming at step 4: the next step's loss equal to the uninterrupted
    run's within fp32 rounding of another reduction order (1e-6), the later ones and the final
    parameters within the bound the other reshard tests use (1e-5, tests/support/compare.py:
    Adam magnifies rounding noise in near-zero gradient entries)."""
    assert [r["step"] for r in got["records"]] == [5, 6, 7, 8]
    assert max_rel(got["losses"][:1], ref["losses"][4:5]) <= 1e-6
    assert max_rel(got["losses"], ref["losses"][4:]) <= 1e-5
    assert max_param_diff(got["params"], ref["params"]) <= 1e-5


@pytest.mark.slow
def test_a_zero3_dcp_checkpoint_resumes_at_tp2_pp2(runs: dict) -> None:
    _resumed_like(runs["tp2_pp2"], runs["z3"])
    # its own saves are DCP too, written from tp boxes on two pipeline stages
    final, ref = _tensors(runs["root"] / "tp2_pp2" / END), _tensors(runs["root"] / "z3" / END)
    assert final.keys() == ref.keys()
    assert max((final[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5


@pytest.mark.slow
def test_a_zero3_dcp_checkpoint_resumes_on_one_process(runs: dict) -> None:
    _resumed_like(runs["dp1"], runs["z3"])
    assert io.read_index(runs["root"] / "dp1" / END).get("storage") is None  # shardwise


@pytest.mark.slow
def test_a_cp2_dcp_checkpoint_resumes_on_one_process(runs: dict) -> None:
    """Saved by dp2 x cp2 (each sequence split over two ranks), resumed at cp 1: the same
    next loss as the uninterrupted cp2 run, whose losses are the dp4 ZeRO-3 run's (layout
    invariance: the same global batches)."""
    assert io.read_index(runs["root"] / "cp2" / HALF).get("storage") == "dcp"
    _resumed_like(runs["cp1"], runs["cp2"])
    assert max_rel(runs["cp2"]["losses"], runs["z3"]["losses"]) <= 1e-5


@pytest.mark.slow
def test_dcp_holds_the_same_tensors_as_the_shardwise_format(runs: dict) -> None:
    """The same run saved both ways: the same keys (global names), shapes and values bit for
    bit, read from DCP at full shape; the training itself is unchanged by the format, and an
    async save writes the same checkpoint."""
    root = runs["root"]
    assert runs["z3"]["losses"] == runs["z3_shardwise"]["losses"] == runs["z3_async"]["losses"]
    for step in (HALF, END):
        ours, dcp, later = (_tensors(root / n / step) for n in ("z3_shardwise", "z3", "z3_async"))
        assert ours.keys() == dcp.keys() == later.keys()
        assert any(k.startswith("exp_avg_sq/") for k in dcp)
        for key, value in ours.items():
            assert torch.equal(dcp[key], value) and torch.equal(later[key], value), (step, key)
    index = io.read_index(root / "z3" / END)
    assert index["storage"] == "dcp" and index["layout"]["zero"] == 3
    files = sorted(index["files"])
    assert files == [".metadata", *(f"__{r}_0.distcp" for r in range(4))], files
    assert sorted(p.name for p in (root / "z3" / END).iterdir()) == sorted([*files, io.INDEX])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3", "bf16_psgd"])
def test_a_dcp_resume_in_the_same_layout_is_bitwise(runs: dict, name: str) -> None:
    """8 steps uninterrupted == 4 + save + resume + 4, bit for bit: losses, parameters and the
    final checkpoint (bf16 parameters and fp32 masters; PowerSGD's per-rank error memory, Q
    and random stream restored, not restarted)."""
    full, resumed = runs[name], runs[f"{name}_resumed"]
    assert [r["step"] for r in resumed["records"]] == [5, 6, 7, 8]
    assert resumed["losses"] == full["losses"][4:] and resumed["resume_note"] is None
    for key, value in full["params"].items():
        assert torch.equal(resumed["params"][key], value), key
    root, other = runs["root"], "z3_resumed" if name == "z3" else "bf16_psgd_r"
    a, b = _tensors(root / name / END), _tensors(root / other / END)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if name == "bf16_psgd":
        assert {"powersgd_rng/rank3", "master/embed.weight"} <= a.keys()
        assert a["param/embed.weight"].dtype == torch.bfloat16


def test_a_flat_run_is_cut_into_rectangles_that_tile_it_exactly() -> None:
    """Every range [lo, hi) of every small shape (0-d to 3-d): the rectangles cover exactly
    those elements, once, each holding its flat run in row-major order, at most 2·ndim − 1."""
    for shape in [(), (5,), (3, 4), (2, 3, 4)]:
        n = math.prod(shape)
        for lo, hi in itertools.combinations_with_replacement(range(n + 1), 2):
            got = torch.zeros(shape, dtype=torch.int64)
            pieces = dcp_format.rects(shape, lo, hi)
            for off, size, a, b in pieces:
                box = tuple(slice(o, o + k) for o, k in zip(off, size, strict=True))
                got[box] += torch.arange(a, b).view(size) + 1
            want = torch.zeros(n, dtype=torch.int64)
            want[lo:hi] = torch.arange(lo, hi) + 1
            assert torch.equal(got.reshape(-1), want), (shape, lo, hi)
            assert len(pieces) <= max(1, 2 * len(shape) - 1)


def _copy(runs: dict, tmp: Path) -> Path:
    dst = tmp / "ckpt"
    shutil.copytree(runs["root"] / "z3", dst)
    return dst


@pytest.mark.slow
def test_a_half_written_dcp_is_never_resumed(runs: dict, tmp_path: Path) -> None:
    """A killed save's `.tmp` (DCP files, no index) is removed and the newest complete
    checkpoint resumed; named explicitly it is refused with one message."""
    root = _copy(runs, tmp_path)
    killed = root / "step-00000012.tmp"
    killed.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp"):
        shutil.copy(root / END / name, killed / name)
    with pytest.raises(CheckpointError, match=r"step-00000012\.tmp is not a valid checkpoint"):
        run_here(
            case(*RUN, f"--checkpoint.dir={root}", f"--checkpoint.resume={killed}"),
            str(tmp_path / "a"),
        )
    got = run_here(
        case(*RUN, "--train.steps=12", DCP, f"--checkpoint.dir={root}"), str(tmp_path / "b")
    )
    assert [r["step"] for r in got["records"]] == [9, 10, 11, 12]
    assert not killed.exists() and (root / "step-00000012" / dcp_format.METADATA).is_file()


@pytest.mark.slow
def test_a_dcp_checkpoint_missing_its_metadata_is_refused(runs: dict, tmp_path: Path) -> None:
    """DCP's `.metadata` gone from a step directory: named, it is refused with one message
    that names the file; resume=auto passes over it to the previous checkpoint."""
    root = _copy(runs, tmp_path)
    (root / END / dcp_format.METADATA).unlink()
    named = case(
        *RUN, DCP, f"--checkpoint.dir={tmp_path / 'x'}", f"--checkpoint.resume={root / END}"
    )
    with pytest.raises(CheckpointError, match=r"not a valid checkpoint: .*\.metadata: missing"):
        run_here(named, str(tmp_path / "a"))
    # (its damaged step 8 is set aside when step 8 is saved again)
    got = run_here(case(*RUN, DCP, f"--checkpoint.dir={root}"), str(tmp_path / "b"))
    assert [r["step"] for r in got["records"]] == [5, 6, 7, 8]
    assert got["losses"] == runs["dp1"]["losses"]  # the one-process resume of step 4


def test_exports_and_pruning_from_a_dcp_run(tmp_path: Path) -> None:
    """One process, saving every step and keeping 2: the pruned checkpoints are gone whole,
    and `export --format hf` and `--format dcp` of the DCP run equal those of the same run
    saved in the shardwise format."""
    for fmt in ("dcp", "shardwise"):
        ckpt = tmp_path / fmt
        extra = ["--train.steps=3", "--checkpoint.every=1", "--checkpoint.keep=2"]
        run_here(
            case(*extra, f"--checkpoint.format={fmt}", f"--checkpoint.dir={ckpt}"),
            str(tmp_path / f"run_{fmt}"),
        )
        assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [
            "step-00000002",
            "step-00000003",
        ]
        for kind in ("hf", "dcp"):
            assert (
                main(["export", str(ckpt), "--format", kind, str(tmp_path / f"{kind}_{fmt}")]) == 0
            )
    hf_dcp = load_file(tmp_path / "hf_dcp" / "model.safetensors")
    hf_ours = load_file(tmp_path / "hf_shardwise" / "model.safetensors")
    assert hf_dcp.keys() == hf_ours.keys() and all(
        torch.equal(hf_dcp[k], hf_ours[k]) for k in hf_ours
    )
    a, b = _tensors_of_export(tmp_path / "dcp_dcp"), _tensors_of_export(tmp_path / "dcp_shardwise")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    # a training checkpoint is not a model's state dict: init_from says what to do instead
    step = tmp_path / "dcp" / "step-00000003"
    with pytest.raises(ConfigError, match=r"shardwise training checkpoint .* `shardwise export "):
        run_here(case(f"--model.init_from={step}", "--train.steps=1"), str(tmp_path / "init"))


def _tensors_of_export(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP export, read at full shape with DCP alone."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state
