"""Checkpoints: the self-describing sharded format, bitwise resume in the same
layout, resuming in another layout, and corruption detection.

Two spawned worlds run everything: a 4-rank world saves dp4 ZeRO-3; a 2-rank world runs each
configuration uninterrupted (saving at steps 4 and 8) and again resumed from its step-4
checkpoint, and resumes the dp4 checkpoint as dp2 ZeRO-1. Single-process resumes run in
this process."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import io as io
from shardwise.checkpoint import slices
from shardwise.launchers.harness import run_here, run_world
from support.compare import case, max_param_diff, max_rel

RUN = ["--train.steps=8", "--checkpoint.every=4"]
HALF = "step-00000004"
FP16 = ["--precision.compute=fp16", "--precision.loss_scale=4194304", "--precision.scale_window=2"]
EXACT = {
    "dp": [],
    "z1_accum": ["--parallel.zero=1", "--train.micro_batch=2"],
    "z2": ["--parallel.zero=2"],
    "z3": ["--parallel.zero=3"],
    "dp_fp16_accum": [*FP16, "--train.micro_batch=2"],
    "tp2": ["--parallel.tp=2"],
    # PowerSGD's per-rank error memory, warm-start Q and random stream (a fresh Q each step)
    "powersgd": ["--parallel.grad_compression=powersgd"],
    "powersgd_cold": [
        "--parallel.grad_compression=powersgd",
        "--parallel.powersgd_warm_start=false",
    ],
    "z3_bf16_offload_accum": [
        "--parallel.zero=3",
        "--precision.compute=bf16",
        "--memory.offload=optimizer+params",
        "--train.micro_batch=2",
    ],
}
# (resumed case, uninterrupted run it continues): the required reshard matrix
RESHARD = {
    "dp4_z3_to_dp2_z1": "dp4_z3",
    "z2_to_z3": "z2",
    "dp2_to_1": "dp",
    "tp2_to_tp1": "tp2",
    "dp2_tp2_z1_to_dp2": "dp2_tp2_z1",
}


def _ckpt(root: Path, name: str, *extra: str, resume: str | None = None) -> dict:
    more = [f"--checkpoint.resume={root / resume}"] if resume else []
    return case(*RUN, *extra, f"--checkpoint.dir={root / name}", *more)


def _worlds(root: Path) -> tuple[dict, dict]:
    world4 = {
        "dp4_z3": _ckpt(root, "dp4_z3", "--parallel.zero=3"),
        "dp2_tp2_z1": _ckpt(root, "dp2_tp2_z1", "--parallel.tp=2", "--parallel.zero=1"),
        "powersgd_dp4": _ckpt(root, "powersgd_dp4", *EXACT["powersgd"]),
    }
    world2 = {}
    for name, extra in EXACT.items():
        world2[name] = _ckpt(root, name, *extra)
        world2[f"{name}_resumed"] = _ckpt(root, f"{name}_r", *extra, resume=f"{name}/{HALF}")
    world2["dp4_z3_to_dp2_z1"] = _ckpt(
        root, "dp4_to_dp2", "--parallel.zero=1", resume=f"dp4_z3/{HALF}"
    )
    world2["z2_to_z3"] = _ckpt(root, "z2_to_z3", "--parallel.zero=3", resume=f"z2/{HALF}")
    world2["tp2_to_tp1"] = _ckpt(root, "tp2_to_tp1", resume=f"tp2/{HALF}")
    world2["dp2_tp2_z1_to_dp2"] = _ckpt(root, "2d_to_dp2", resume=f"dp2_tp2_z1/{HALF}")
    world2["powersgd_off"] = _ckpt(
        root, "powersgd_off", *EXACT["powersgd"], "--checkpoint.per_rank_state=false"
    )
    world2["powersgd_dp4_to_dp2"] = _ckpt(
        root, "psgd_dp4_to_dp2", *EXACT["powersgd"], resume=f"powersgd_dp4/{HALF}"
    )
    world2["z3_async"] = _ckpt(root, "z3_async", "--parallel.zero=3", "--checkpoint.async=true")
    return world4, world2


def _run(cases: dict, nproc: int) -> dict:
    out = {}
    for name, per_rank in zip(cases, run_world(nproc, list(cases.values())), strict=True):
        for r in per_rank:
            assert "error" not in r, f"{name}: {r['error']}"
        out[name] = per_rank[0]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    world4, world2 = _worlds(root)
    out = {"root": root, **_run(world4, 4), **_run(world2, 2)}
    out["dp2_to_1"] = run_here(
        _ckpt(root, "dp2_to_1", resume=f"dp/{HALF}"), str(tmp_path_factory.mktemp("one"))
    )
    return out


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = io.read_index(path)
    return {key: slices.read_tensor(path, key, index) for key in index["tensors"]}


# -- exact resume -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXACT))
def test_resume_in_the_same_layout_is_bitwise(runs: dict, name: str) -> None:
    """8 steps uninterrupted == 4 steps + save + resume + 4 steps: the same losses, loss
    scales, skipped steps and parameters bit for bit, and the same final checkpoint
    (masters and Adam moments included)."""
    full, resumed = runs[name], runs[f"{name}_resumed"]
    assert len(full["losses"]) == 8 and [r["step"] for r in resumed["records"]] == [5, 6, 7, 8]
    assert resumed["losses"] == full["losses"][4:]
    assert resumed["scales"] == full["scales"][4:]
    assert resumed["skipped"] == full["skipped"][4:]
    for key, value in full["params"].items():
        assert torch.equal(resumed["params"][key], value), key
    a = _all_tensors(runs["root"] / name / "step-00000008")
    b = _all_tensors(runs["root"] / f"{name}_r" / "step-00000008")
    assert a.keys() == b.keys() and any(k.startswith("exp_avg_sq/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    if "fp16" in name:  # the loss scaler's state matters: overflow steps were skipped
        assert any(full["skipped"][:4]), full["skipped"]


# -- the format -------------------------------------------------------------------------------
@pytest.mark.slow
def test_index_describes_the_run(runs: dict) -> None:
    from shardwise.config import config_from_dict
    from shardwise.optim import lr_at

    path = runs["root"] / "dp_fp16_accum" / HALF
    index = io.read_index(path)
    assert index["step"] == 4 and index["layout"]["dp"] == 2 and index["layout"]["zero"] == 0
    cfg = config_from_dict(index["config"])
    assert cfg.train.micro_batch == 2 and cfg.precision.compute == "fp16"
    loop = index["loop"]
    assert loop["data"] == {"seed": 0, "global_batch": 8, "position": 32}
    assert loop["lr_schedule"]["next_lr"] == lr_at(4, cfg)
    full = runs["dp_fp16_accum"]
    assert loop["loss_scaler"]["enabled"] and loop["loss_scaler"]["scale"] == full["scales"][4]
    assert loop["optimizer"]["adam_step"] == 4 - sum(full["skipped"][:4])
    assert loop["seeds"] == {"train": 0}
    kinds = {k.split("/", 1)[0] for k in index["tensors"]}
    assert kinds == {"param", "master", "exp_avg", "exp_avg_sq"}
    for key, entry in index["tensors"].items():
        # the slices of every tensor are disjoint ranges that cover it exactly once
        spans = sorted(tuple(s["span"]) for s in entry["slices"])
        numel = torch.Size(entry["shape"]).numel()
        assert spans[0][0] == 0 and spans[-1][1] == numel, key
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), key
    assert io.check_files(path, index["files"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3", "dp"])
def test_every_rank_writes_only_its_own_share(runs: dict, name: str) -> None:
    """Each rank wrote one file with about half of the bytes (ZeRO-3: its own slices; data
    parallel: replicated tensors split between the ranks), and the files reassemble the
    final parameters exactly."""
    path = runs["root"] / name / "step-00000008"
    index = io.read_index(path)
    sizes = [index["files"][io.shard_name(r)]["bytes"] for r in range(2)]
    assert max(sizes) / min(sizes) < 1.2, sizes
    for key, value in runs[name]["params"].items():
        assert torch.equal(slices.read_tensor(path, f"param/{key}", index), value), key
    assert io.latest(runs["root"] / name) == path


@pytest.mark.slow
def test_an_async_save_writes_the_same_checkpoint(runs: dict) -> None:
    """Saving in a background thread while training goes on changes nothing: the same
    losses and the same checkpoints, bit for bit; each save records its training stall."""
    got, ref = runs["z3_async"], runs["z3"]
    assert got["losses"] == ref["losses"]
    for step in ("step-00000004", "step-00000008"):
        a = _all_tensors(runs["root"] / "z3" / step)
        b = _all_tensors(runs["root"] / "z3_async" / step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    stalls = [r.get("checkpoint_stall_s") for r in got["records"]]
    assert [i + 1 for i, s in enumerate(stalls) if s is not None] == [4, 8]


# -- resharding -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("name", "reference"), list(RESHARD.items()))
def test_resume_in_another_layout_continues_the_run(runs: dict, name: str, reference: str):
    got, ref = runs[name], runs[reference]
    assert [r["step"] for r in got["records"]] == [5, 6, 7, 8]
    assert max_rel(got["losses"], ref["losses"][4:]) <= 1e-5
    assert max_param_diff(got["params"], ref["params"]) <= 1e-5


@pytest.mark.slow
def test_per_rank_state_restarts_in_another_layout(runs: dict) -> None:
    """PowerSGD's error memory and Q belong to a rank of the layout that saved them: dp4's
    checkpoint resumed as dp2 restarts them (and says so) instead of reading ranks 0-1's, the
    parameters and Adam state continue; the same layout restores them (no note); with
    checkpoint.per_rank_state=false they are not saved."""
    got = runs["powersgd_dp4_to_dp2"]
    assert [r["step"] for r in got["records"]] == [5, 6, 7, 8]
    assert all(math.isfinite(x) for x in got["losses"])
    assert "start afresh" in got["resume_note"] and "world 4 dp 4" in got["resume_note"]
    assert runs["powersgd_resumed"]["resume_note"] is None
    index = io.read_index(runs["root"] / "powersgd_dp4" / HALF)
    assert {f"powersgd_rng/rank{r}" for r in range(4)} <= set(index["tensors"])
    # checkpoint.per_rank_state=false: the model's state only, the same training
    off = io.read_index(runs["root"] / "powersgd_off" / HALF)
    assert not any(k.startswith("powersgd") for k in off["tensors"])
    assert runs["powersgd_off"]["losses"] == runs["powersgd"]["losses"]


def test_explain_counts_per_rank_state_in_the_checkpoint_size() -> None:
    """The disk check before training (check_room) sizes a checkpoint with every rank's
    PowerSGD state when it is kept: at most the fp32 size of the gradients each rank reduces."""
    from shardwise.config import load_config
    from shardwise.job.explain import checkpoint_bytes, explain_record

    args = ["--parallel.grad_compression=powersgd", "--model.n_layers=2"]
    kept = explain_record(load_config(None, args), 2)
    off = explain_record(load_config(None, [*args, "--checkpoint.per_rank_state=false"]), 2)
    per_rank = kept["checkpoint_per_rank_bytes"]
    assert per_rank == kept["mem_bytes"]["grads"]  # fp32 buffers: 4 bytes an element
    assert "checkpoint_per_rank_bytes" not in off
    assert checkpoint_bytes(kept) == checkpoint_bytes(off) + 2 * per_rank


def test_slices_reassemble_across_tensor_parallel_and_zero_cuts(tmp_path: Path) -> None:
    """The slice algebra without a training run: a fused q|k|v weight split over tp=2 along
    its columns (three boxes per rank) and a vocabulary-parallel weight with a padding row,
    each cut again by ZeRO spans of the local tensor over dp=2, are written as files; the
    index reassembles both, and a rank of another layout (tp1, ZeRO over 3) reads its slices."""
    from shardwise.checkpoint.state import slices_of
    from shardwise.models.init import LocalSlice

    full = {"qkv": torch.randn(6, 12), "vocab": torch.randn(5, 3)}
    cuts = {  # tp rank -> (dim, ranges, padded)
        "qkv": [(1, [(k * 4 + r * 2, k * 4 + r * 2 + 2) for k in range(3)], 12) for r in range(2)],
        "vocab": [(0, [(3 * r, 3 * r + 3)], 6) for r in range(2)],
    }
    path, tensors, files = tmp_path / "ckpt", {}, {}
    path.mkdir()
    writer = 0
    for name, g in full.items():
        for dim, ranges, padded in cuts[name]:
            cut = LocalSlice(tuple(g.shape), dim, tuple(ranges), padded)
            local = cut.take(g)
            local.tp_slice = cut
            n = local.numel()
            for span in ((0, n // 2 - 1), (n // 2 - 1, n)):  # two dp ranks, uneven
                values = local.reshape(-1)[span[0] : span[1]].clone()
                pieces = slices_of(f"param/{name}", local, span, values)
                shard = {io.file_key(lo.piece): lo.values() for lo in pieces}
                files[io.shard_name(writer)] = io.write_shard(path / io.shard_name(writer), shard)
                for lo in pieces:
                    entry = tensors.setdefault(
                        lo.piece.key, {"shape": list(g.shape), "dtype": "float32", "slices": []}
                    )
                    entry["slices"].append(
                        {
                            "file": io.shard_name(writer),
                            "key": io.file_key(lo.piece),
                            "box": [list(b) for b in lo.piece.box],
                            "span": list(lo.piece.span),
                        }
                    )
                writer += 1
    index = {"tensors": tensors, "files": files}
    assert io.check_files(path, files) == []
    reader = slices.ShardReader(path)
    for name, g in full.items():
        assert torch.equal(slices.read_tensor(path, f"param/{name}", index), g), name
        flat = torch.zeros(g.numel())
        n = g.numel()
        for span in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)):  # tp1, ZeRO over 3
            (local,) = slices_of(f"param/{name}", g, span, flat[span[0] : span[1]])
            local.load(
                lambda dst, lo=local: slices.load_piece(
                    dst, lo.piece, tensors[lo.piece.key], reader
                )
            )
        assert torch.equal(flat.view_as(g), g), name
    reader.close()


# -- corruption -------------------------------------------------------------------------------
def _damage(root: Path, how: str) -> tuple[Path, int]:
    """Damage a copy of the dp run's checkpoints (steps 4 and 8); returns the path the
    warning must name and the step the resume must continue from."""
    newest = root / "step-00000008"
    shard = newest / io.shard_name(1)
    data = shard.read_bytes()
    if how == "flipped_byte":
        pos = len(data) - 1000  # inside the tensor data (the header is at the start)
        shard.write_bytes(data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :])
        return shard, 4
    if how == "truncated_file":
        shard.write_bytes(data[: len(data) // 2])
        return shard, 4
    # a save killed halfway: a temporary directory with one rank's file and no index
    half = root / "step-00000012.tmp"
    half.mkdir()
    shutil.copy(shard, half / shard.name)
    return half, 8


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flipped_byte", "truncated_file", "half_written_tmp_dir"])
def test_damaged_checkpoints_are_detected_and_the_previous_one_used(
    runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    root = tmp_path / "ckpts"
    shutil.copytree(runs["root"] / "dp", root)
    named, resume_step = _damage(root, how)
    steps = 8 if resume_step == 4 else 10
    got = run_here(
        case(*RUN, f"--train.steps={steps}", f"--checkpoint.dir={root}"), str(tmp_path / "run")
    )
    err = capsys.readouterr().err
    assert f"{named}" in err and "warning:" in err, err
    assert [r["step"] for r in got["records"]] == list(range(resume_step + 1, steps + 1))
    if resume_step == 4:  # it continued the saved run (one process now, two then)
        assert max_rel(got["losses"], runs["dp"]["losses"][4:]) <= 1e-5
    else:
        assert not named.exists()  # the leftover is removed


def _files(*roots: Path) -> dict[Path, bytes]:
    """Every file's bytes but the job's own lock (training/lock.py writes its holder there)."""
    return {
        p: p.read_bytes()
        for r in roots
        for p in r.rglob("*")
        if p.is_file() and p.name != ".shardwise.lock"
    }


@pytest.mark.slow
def test_all_checkpoints_damaged_is_refused_and_nothing_changes(runs: dict, tmp_path: Path) -> None:
    """When every checkpoint is damaged, starting over would throw the run's
    progress away in silence: refused, naming each checkpoint and what is wrong, with the
    checkpoints and metrics.jsonl left byte for byte."""
    from shardwise.errors import CheckpointError

    root, run_dir = tmp_path / "ckpts", tmp_path / "run"
    shutil.copytree(runs["root"] / "dp", root)
    for step in ("step-00000004", "step-00000008"):
        shard = root / step / io.shard_name(0)
        shard.write_bytes(shard.read_bytes()[:100])
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 8, "loss": 1.0}\n')
    before = _files(root, run_dir)
    with pytest.raises(CheckpointError) as info:
        run_here(case(*RUN, "--train.steps=12", f"--checkpoint.dir={root}"), str(run_dir))
    msg = str(info.value)
    assert "holds 2 checkpoint(s) and none is valid" in msg and "step-00000004:" in msg, msg
    assert "step-00000008:" in msg and "Nothing was changed" in msg, msg
    after = _files(root, run_dir)
    assert after == before


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_with_one_message(
    runs: dict, tmp_path: Path
) -> None:
    from shardwise.errors import CheckpointError

    other = ["--model.n_layers=3", "--model.ffn_dim=96", "--model.tie_embeddings=true"]
    with pytest.raises(CheckpointError) as info:
        run_here(_ckpt(runs["root"], "other", *other, resume=f"dp/{HALF}"), str(tmp_path))
    msg = str(info.value)
    assert "missing: " in msg and "param/blocks.2.attn.wq.weight" in msg, msg
    assert "of another shape: " in msg and "exp_avg/blocks.0.mlp.w1.weight" in msg, msg
    assert "1 not in this model: param/head.weight" in msg, msg
    assert msg.count("Fix:") == 1


@pytest.mark.slow
def test_a_changed_data_order_is_refused(runs: dict, tmp_path: Path) -> None:
    from shardwise.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"train\.global_batch=8 .* Fix: "):
        bigger = _ckpt(runs["root"], "gb", "--train.global_batch=16", resume=f"dp/{HALF}")
        run_here(bigger, str(tmp_path))


@pytest.mark.slow
def test_a_failure_between_save_and_log_keeps_that_steps_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process dying after step 4's checkpoint is committed but before step 4's line reaches
    metrics.jsonl: the resume at step 4 writes the record the checkpoint stored, so the file
    holds every step once, with the uninterrupted run's losses (bitwise: same layout)."""
    from shardwise.training.metrics import MetricsLogger

    log = MetricsLogger.log

    def dies_at_step_4(self, record: dict) -> None:
        if record["step"] == 4:
            raise RuntimeError("killed between the save and the log line")
        log(self, record)

    run_dir, first = tmp_path / "run", _ckpt(tmp_path, "c")
    monkeypatch.setattr(MetricsLogger, "log", dies_at_step_4)
    with pytest.raises(RuntimeError, match="between the save"):
        run_here(first, str(run_dir))
    monkeypatch.setattr(MetricsLogger, "log", log)
    assert (tmp_path / "c" / HALF).is_dir()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == [1, 2, 3]  # the failure left step 4 out
    run_here(_ckpt(tmp_path, "c", resume="c"), str(run_dir))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == run_here(_ckpt(tmp_path, "u"), str(tmp_path))["losses"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["train", "--max-restarts", "-1"], ["-1", ">= 0"]),
        (["train", "--max-restarts", "2"], ["checkpoint.every=0", "--checkpoint.every"]),
        (["train", "--max-restarts", "x"], ["'x'", "--max-restarts 3"]),
        (
            ["train", "--max-restarts", "1", "--checkpoint.every=5", "--checkpoint.resume=none"],
            ["checkpoint.resume=auto"],
        ),
        (["explain", "--checkpoint.resume=/no/such/dir"], ["/no/such/dir", "auto"]),
    ],
)
def test_bad_checkpoint_options_fail_before_launch(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from shardwise.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


# -- restarts ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_ends_bitwise_equal(
    runs: dict, tmp_path: Path
) -> None:
    """`shardwise train --max-restarts`: one rank is SIGKILLed after a random step; torch
    elastic restarts both, they resume from the newest checkpoint, and the final checkpoint
    equals the uninterrupted run's bit for bit (parameters, masters and Adam moments)."""
    import random
    import sys

    from support.chaos import run_and_kill

    rng = random.Random()
    at = rng.randint(1, 7)
    run_dir = tmp_path / "run"
    overrides = [*case(*RUN)["overrides"], "--checkpoint.every=2", f"--run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "2"]
    cmd += ["--max-restarts", "2", *overrides, "--log.tensorboard=false", "--log.progress=off"]
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and "SLURM" not in k}
    env["OMP_NUM_THREADS"] = "1"
    result = run_and_kill(cmd, env, run_dir, run_dir / "checkpoints", "step", at, rng)
    assert result.returncode == 0, f"killed after step {at}:\n{result.output[-3000:]}"
    # the restart resumed from the newest checkpoint (step 2's save is logged before step 2
    # is, so only a kill after step 1 may find none yet)
    out = result.output
    restarted = "resumed after restart 1 " in out or (
        at == 1 and "restart 1: no valid checkpoint" in out
    )
    assert result.killed_pid is not None and restarted, out[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["loss"] for r in records] == runs["dp"]["losses"]
    a = _all_tensors(runs["root"] / "dp" / "step-00000008")
    b = _all_tensors(run_dir / "checkpoints" / "step-00000008")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs (killed after step {at})"


@pytest.mark.slow
def test_only_our_own_leftovers_are_deleted_and_a_hostile_index_is_refused(
    runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory that looks like an unfinished checkpoint but holds
    a file a save does not write, or a final name that lost its index, is reported and kept
    (with the user's files); our own half-written save is removed; an index naming a file
    outside its checkpoint makes that checkpoint invalid (the previous one is resumed)."""
    root = tmp_path / "ckpts"
    shutil.copytree(runs["root"] / "dp", root)
    lost = root / "step-00000003"  # a final name without an index: someone's files
    lost.mkdir()
    (lost / "mine.txt").write_text("my notes\n")
    foreign = root / "step-00000010.tmp"  # our temporary's name, but a file we never write
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me\n")
    ours = root / "step-00000011.tmp"  # a save of ours killed halfway: only a shard
    ours.mkdir()
    shutil.copy(root / "step-00000004" / io.shard_name(0), ours / io.shard_name(0))
    index_path = root / "step-00000008" / io.INDEX
    index = json.loads(index_path.read_text())
    index["files"] = {"../" + k: v for k, v in index["files"].items()}
    index_path.write_text(json.dumps(index))
    hostile = shutil.copytree(index_path.parent, tmp_path / "hostile")  # (step 8 is saved again)
    got = run_here(case(*RUN, f"--checkpoint.dir={root}"), str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert (lost / "mine.txt").read_text() == "my notes\n" and f"keeping {lost}" in err
    assert (foreign / "notes.txt").read_text() == "keep me\n" and f"keeping {foreign}" in err
    assert not ours.exists() and f"removing {ours}" in err
    assert "names files outside the checkpoint directory" in err
    assert [r["step"] for r in got["records"]] == [5, 6, 7, 8]  # from step 4
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        io.read_index(hostile)
