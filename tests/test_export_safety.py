"""`shardwise export` writes only what it may and exports only what the run saved.

The output folder is replaced whole (an earlier export of ours) or refused (someone else's
files, the run's own folders, a second export at once), a stopped or failing export leaves it
as it was, and the weights come from a checkpoint whose checksums were verified, of the run
that was named — found where that run was started, not where the exporter stands.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint import io as cio
from shardwise.checkpoint import slices
from shardwise.cli.main import main
from shardwise.launchers.harness import run_here
from support.compare import case

pytestmark = pytest.mark.slow

# a small run: 1 layer, checkpoints at steps 2, 4 and 6 (about 1.3 MB of fp32 weights)
RUN = ["--model.n_layers=1", "--train.steps=6", "--checkpoint.every=2"]
SHARD = "200KB"  # six output files of that model
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def r3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-process run with checkpoints at steps 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("r3") / "run"
    run_here(case(*RUN), str(run_dir))
    return run_dir


def _export(*args: str) -> int:
    return main(["export", *(str(a) for a in args)])


def _weights(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, as transformers would load it (the single file first)."""
    if (out / "model.safetensors").is_file():
        return load_file(out / "model.safetensors")
    names = set(
        json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    return {k: v for n in sorted(names) for k, v in load_file(out / n).items()}


def _saved_embedding(ckpt: Path) -> torch.Tensor:
    index = cio.read_index(ckpt)
    key = (
        "master/embed.weight" if "master/embed.weight" in index["tensors"] else "param/embed.weight"
    )
    return slices.read_tensor(ckpt, key, index)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_folder_of_someone_elses_files_is_refused_unless_overwrite(r3, tmp_path, capsys):
    """Exporting into a non-empty folder that is not an export of ours would overwrite the
    user's config.json and model.safetensors: refused with one line naming --overwrite, the
    files untouched; with --overwrite the folder becomes the export."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "model.safetensors").write_bytes(b"my weights")
    before = _files(out)
    assert _export(r3, "--format", "hf", out) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "--overwrite" in err and "config.json" in err, err
    assert _files(out) == before
    assert _export(r3, "--format", "hf", out, "--overwrite") == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert torch.equal(_weights(out)[EMBED], _saved_embedding(cio.latest(r3 / "checkpoints")))


def test_a_re_export_replaces_the_whole_earlier_export(r3, tmp_path):
    """A sharded export over an earlier single-file one of another step leaves no stale
    model.safetensors (which transformers would load instead of the shards): the folder holds
    exactly what a fresh export holds."""
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    assert _export(r3 / "checkpoints/step-00000002", "--format", "hf", out) == 0
    assert (out / "model.safetensors").is_file()
    assert _export(r3, "--format", "hf", out, "--max-shard-size", SHARD) == 0
    assert _export(r3, "--format", "hf", fresh, "--max-shard-size", SHARD) == 0
    assert not (out / "model.safetensors").exists()
    got, want = _files(out), _files(fresh)
    got.pop(".shardwise-export.json"), want.pop(".shardwise-export.json")
    assert got == want
    assert torch.equal(_weights(out)[EMBED], _saved_embedding(r3 / "checkpoints/step-00000006"))


_STOP_AFTER_TWO_FILES = """
import os, signal, sys
import safetensors.torch as st
real, written = st.save_file, []
def save_file(*args, **kwargs):
    real(*args, **kwargs)
    written.append(1)
    if len(written) == 2:  # stopped halfway through the export
        os.kill(os.getpid(), signal.SIGTERM)
st.save_file = save_file
from shardwise.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_stopped_export_leaves_the_earlier_export_whole(r3, tmp_path):
    """SIGTERM after two of six shards of step 6 over a sharded export of step 2: the export
    ends 143 with OUT byte for byte the step-2 export (not shards of two checkpoints that
    from_pretrained would load without complaint), and nothing of it left beside OUT."""
    out = tmp_path / "exports" / "out"
    argv = ["export", str(r3), "--format", "hf", str(out), "--max-shard-size", SHARD]
    argv_step2 = [*argv[:1], str(r3 / "checkpoints/step-00000002"), *argv[2:]]
    assert main(argv_step2) == 0
    before = _files(out)
    proc = subprocess.run(
        [sys.executable, "-c", _STOP_AFTER_TWO_FILES, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 143, proc.stderr
    assert "stopped by SIGTERM" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert _files(out) == before
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # no temporary folder, no lock


def _flip_a_byte(ckpt: Path) -> Path:
    shard = ckpt / cio.shard_name(0)
    data = bytearray(shard.read_bytes())
    data[-1000] ^= 0x40  # inside the tensor data (the header is at the start)
    shard.write_bytes(bytes(data))
    return shard


def test_a_corrupted_checkpoint_is_refused_naming_the_file(r3, tmp_path, capsys):
    """One flipped byte in the newest checkpoint (a checksum a resume would catch) is refused
    with the file's name and --step with the steps kept; nothing is written; --step 4 then
    exports that verified checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(r3, run)
    shard = _flip_a_byte(run / "checkpoints/step-00000006")
    out = tmp_path / "out"
    assert _export(run, "--format", "hf", out) == 2
    err = capsys.readouterr().err
    assert str(shard) in err and "SHA-256" in err and "--step" in err and "2, 4" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert _export(run, "--format", "hf", out, "--step", "4") == 0
    assert torch.equal(_weights(out)[EMBED], _saved_embedding(run / "checkpoints/step-00000004"))


def test_an_output_inside_the_run_or_its_checkpoints_is_refused(r3, tmp_path, capsys):
    """OUT equal to the run dir would overwrite its config.json (and break every later export);
    OUT inside the checkpoint.dir or holding the run is refused alike; nothing changes. A run
    dir whose config.json was overwritten that way is one clear line, not a traceback."""
    before = {p: p.read_bytes() for p in r3.rglob("*") if p.is_file() and p.name != ".lock"}
    assert _export(r3, "--format", "hf", r3) == 2
    assert "is inside the run directory" in capsys.readouterr().err
    for out in (r3, r3 / "hf", r3 / "checkpoints", r3 / "checkpoints" / "hf", r3.parent):
        assert _export(r3, "--format", "hf", out, "--overwrite") == 2, out
        err = capsys.readouterr().err
        assert err.startswith("error: OUT=") and "Fix:" in err, err
    assert {p: p.read_bytes() for p in before} == before
    assert not (r3 / "hf").exists() and not (r3 / "checkpoints" / "hf").exists()
    broken = tmp_path / "broken"
    shutil.copytree(r3, broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 512}))
    assert _export(broken, "--format", "hf", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "is not the config of a shardwise run" in err and "Traceback" not in err, err


def test_relative_paths_resolve_where_the_run_was_started(tmp_path, monkeypatch, capsys):
    """Two projects with the same relative run.dir and checkpoint.dir: exporting project A's
    run from project B's folder exports A's checkpoint, not B's."""
    a, b = tmp_path / "a", tmp_path / "b"
    for project, seed in ((a, 1), (b, 2)):
        project.mkdir()
        monkeypatch.chdir(project)
        run_here(case(*RUN, "--checkpoint.dir=ckpts", f"--train.seed={seed}"), "runs/r")
    capsys.readouterr()
    # (cwd is b now)
    assert _export(a / "runs" / "r", "--format", "hf", tmp_path / "out") == 0
    assert f"exported {a / 'ckpts' / 'step-00000006'}" in capsys.readouterr().out
    want = _saved_embedding(a / "ckpts" / "step-00000006")
    assert not torch.equal(want, _saved_embedding(b / "ckpts" / "step-00000006"))
    assert torch.equal(_weights(tmp_path / "out")[EMBED], want)


def test_a_checkpoint_pruned_while_exporting_is_replaced_by_the_newest(
    r3, tmp_path, monkeypatch, capsys
):
    """A training job saves step 8 and prunes step 6 right after the export chose step 6:
    the export takes step 8 instead of failing with FileNotFoundError and an empty OUT."""
    root = tmp_path / "ckpts"
    shutil.copytree(r3 / "checkpoints", root)
    real, calls = cio.read_index, []

    def read_then_prune(path):
        index = real(path)
        if not calls:  # what `commit` does after a save with checkpoint.keep=3
            calls.append(path)
            newer = root / "step-00000008"
            shutil.copytree(root / "step-00000006", newer)
            (root / cio.LATEST).write_text(newer.name + "\n")
            cio.remove(root / "step-00000006")
        return index

    monkeypatch.setattr(cio, "read_index", read_then_prune)
    out = tmp_path / "out"
    assert _export(root, "--format", "hf", out) == 0
    assert calls == [root / "step-00000006"]
    assert f"exported {root / 'step-00000008'}" in capsys.readouterr().out
    assert torch.equal(_weights(out)[EMBED], _saved_embedding(root / "step-00000008"))


def test_a_second_export_to_the_same_folder_is_refused(r3, tmp_path, monkeypatch, capsys):
    """While one export writes OUT, a second one to OUT is refused (both used to report
    success over each other's files); the first completes."""
    import safetensors.torch as st

    out, second = tmp_path / "out", []
    real = st.save_file

    def save_and_race(*args, **kwargs):
        real(*args, **kwargs)
        if not second:
            second.append(_export(r3, "--format", "hf", out))

    monkeypatch.setattr(st, "save_file", save_and_race)
    assert _export(r3, "--format", "hf", out) == 0
    assert second == [2]
    assert "another export is writing" in capsys.readouterr().err
    assert torch.equal(_weights(out)[EMBED], _saved_embedding(cio.latest(r3 / "checkpoints")))


def test_a_failing_write_is_one_line_and_leaves_nothing(r3, tmp_path, monkeypatch, capsys):
    """A full disk halfway through is one line naming OUT and the fix, and leaves neither an
    empty OUT nor a hidden temporary file beside it."""
    import safetensors.torch as st

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", full)
    out = tmp_path / "new" / "out"
    assert _export(r3, "--format", "hf", out) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "Fix:" in err, err
    assert list(tmp_path.iterdir()) == []
