"""Optimizer state on local disk (`memory.offload=optimizer+nvme`): parity with host offload,
host memory down to the streaming buffers (counted, and predicted), checkpoints that resume
into other layouts with and without NVMe, the folder cleaned up, a full disk refused.

One spawned world of 2 gloo ranks: host offload and NVMe offload (buffers of 64 KB per
region, so a rank's ~250k elements stream in 16 chunks) under ZeRO-1, and ZeRO-3 with its
parameter slices in host memory and on disk (`params+nvme`), 8 steps with a checkpoint at
step 4; the NVMe run's checkpoint resumed under ZeRO-3 without offload, and the host run's
under ZeRO-2 with NVMe.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_world
from shardwise.optim.nvme import NvmeAdamW
from shardwise.plan.hardware import get_hardware
from support.compare import case, max_param_diff, max_rel

RUN = ["--train.steps=8", "--checkpoint.every=4"]
HALF = "step-00000004"
NVME = ["--memory.offload=optimizer+nvme", "--memory.nvme_buffer_mb=0.0625"]
PARAMS_NVME = ["--memory.offload=params+nvme", "--memory.nvme_buffer_mb=0.0625"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme")
    disk = root / "disk"

    def run(name, *extra, resume=None):
        more = [f"--checkpoint.resume={root / resume / HALF}"] if resume else []
        return case(*RUN, *extra, f"--checkpoint.dir={root / name}", *more)

    cases = {
        "host": run("host", "--parallel.zero=1", "--memory.offload=optimizer"),
        "nvme": run("nvme", "--parallel.zero=1", *NVME, f"--memory.nvme_dir={disk}"),
        "nvme_to_z3": run("nvme_to_z3", "--parallel.zero=3", resume="nvme"),
        "z3_host": run("z3_host", "--parallel.zero=3", "--memory.offload=optimizer+params"),
        "z3_disk": run("z3_disk", "--parallel.zero=3", *PARAMS_NVME, f"--memory.nvme_dir={disk}"),
        "host_to_nvme_z2": run(
            "host_to_nvme_z2",
            "--parallel.zero=2",
            *NVME,
            f"--memory.nvme_dir={disk}",
            resume="host",
        ),
    }
    out = {"root": root, "disk": disk}
    for name, per_rank in zip(cases, run_world(2, list(cases.values())), strict=True):
        assert all("error" not in r for r in per_rank), f"{name}: {per_rank[0].get('error')}"
        out[name] = per_rank[0]
    return out


def test_nvme_offload_trains_bitwise_like_host_offload(runs):
    host, nvme = runs["host"], runs["nvme"]
    assert nvme["losses"] == host["losses"]
    assert max_param_diff(nvme["params"], host["params"]) == 0.0


def test_zero3_slices_on_disk_train_bitwise_like_slices_in_host_memory(runs):
    """params+nvme: ZeRO-3's parameter slices in files, the optimizer state too."""
    host, disk = runs["z3_host"], runs["z3_disk"]
    assert disk["losses"] == host["losses"]
    assert max_param_diff(disk["params"], host["params"]) == 0.0
    hm, dm = host["records"][-1]["mem_bytes"], disk["records"][-1]["mem_bytes"]
    assert dm["disk_params"] == hm["host_params"] > 0 and "host_params" not in dm
    assert dm["params"] == hm["params"]  # (0: every slice is offloaded either way)
    cfg = load_config(None, case("--parallel.zero=3", *PARAMS_NVME)["overrides"])
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    for key in ("disk_params", "disk_optimizer", "host_master", "host_optimizer", "params"):
        assert pred[key] == dm[key], key


def test_host_memory_falls_to_the_streaming_buffers_and_the_planner_predicts_it(runs):
    host = runs["host"]["records"][-1]["mem_bytes"]
    nvme = runs["nvme"]["records"][-1]["mem_bytes"]
    state = host["host_master"] + host["host_optimizer"]  # masters + moments in host memory
    slots = 2 * 3 * (64 * 1024)  # two buffers of 64 KB per region, 3 regions
    assert nvme["host_master"] + nvme["host_optimizer"] == slots
    assert slots < state / 7
    assert nvme["disk_optimizer"] == 3 * host["host_master"]  # 12 bytes per element on disk
    for key in ("params", "grads", "master", "optimizer"):
        assert nvme[key] == host[key], key
    cfg = load_config(None, case("--parallel.zero=1", *NVME)["overrides"])
    pred = explain_record(cfg, 2, get_hardware("cpu", calibrate=False))["mem_bytes"]
    for key in ("host_master", "host_optimizer", "disk_optimizer", "params", "grads"):
        assert pred[key] == nvme[key], key


def test_checkpoints_of_nvme_runs_resume_into_other_layouts(runs):
    """Layout-free: an NVMe run continued under ZeRO-3 without offload, a host-offload run
    continued under ZeRO-2 with NVMe, each ends where the uninterrupted run ended (1e-5:
    another ZeRO stage sums and clips in another order, as tests/test_checkpoint.py)."""
    for name, reference in (("nvme_to_z3", "nvme"), ("host_to_nvme_z2", "host")):
        got, ref = runs[name], runs[reference]
        assert [r["step"] for r in got["records"]] == [5, 6, 7, 8], name
        assert max_rel(got["losses"], ref["losses"][4:]) <= 1e-5, name
        assert max_param_diff(got["params"], ref["params"]) <= 1e-5, name


def test_the_state_folders_are_removed_and_nothing_else_is_touched(runs):
    disk: Path = runs["disk"]
    assert disk.is_dir() and list(disk.iterdir()) == []


def test_a_disk_without_room_is_refused_naming_the_folder(tmp_path, monkeypatch):
    keep = tmp_path / "yours.txt"
    keep.write_text("a file of yours")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="No space left on device") as info:
        NvmeAdamW(str(tmp_path), 0, [torch.Size([1000])])
    assert f"memory.nvme_dir='{tmp_path}'" in str(info.value)
    assert "Fix:" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["yours.txt"]  # ours removed


def test_nvme_offload_needs_zero_and_plain_adamw():
    from shardwise.training.validate import derive

    with pytest.raises(ConfigError, match=r"Fix: --parallel\.zero=1"):
        derive(load_config(None, ["--memory.offload=optimizer+nvme"]), 2)
    eight = ["--memory.offload=optimizer+nvme", "--parallel.zero=1", "--optim.name=adamw8bit"]
    with pytest.raises(ConfigError, match=r"Fix: --optim\.name=adamw"):
        derive(load_config(None, eight), 2)
