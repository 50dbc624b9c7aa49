"""Cluster launchers without a cluster: multi-node options and placement, the Slurm script
(syntax, and the command line it really hands to each node), and Kubernetes PyTorchJob
manifests validated with the official client models and compared with golden files.

Regenerate the golden files after a deliberate change with
`SHARDWISE_UPDATE_GOLDEN=1 pytest tests/test_launchers.py`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from shardwise.cli.main import main
from shardwise.config import load_config
from shardwise.launchers.nodes import Nodes, placement, placement_line, route_to

GOLDEN = Path(__file__).parent / "golden" / "k8s"


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# --- multi-node train options -----------------------------------------------------------------

NODE_ERRORS = [
    (["--nnodes", "2", "--rdzv", "h:1"], ["--node-rank", "Fix: --node-rank 0"]),
    (["--nnodes", "2", "--node-rank", "0"], ["--rdzv HOST:PORT", "node 0"]),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv", "h:1"], ["--node-rank=2", "0..1"]),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv", "h"], ["--rdzv 'h'", "HOST:PORT"]),
    (["--nnodes", "two"], ["--nnodes 'two'", "Fix: --nnodes 2"]),
    (["--nnodes", "0"], ["--nnodes=0", ">= 1"]),
    (["--nnodes", "1", "--max-restarts", "-1"], ["--max-restarts '-1'"]),
    (["--nnodes", "1", "--max-restarts", "2"], ["checkpoint.every=0 saves none"]),
]


@pytest.mark.parametrize(("argv", "needles"), NODE_ERRORS)
def test_multinode_options_fail_clearly_before_anything_starts(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    code, _, err = run_main(["train", "--nproc", "2", *argv], capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_explain_takes_the_world_of_all_nodes(capsys) -> None:
    code, out, err = run_main(
        ["explain", "--nnodes", "3", "--nproc", "2", "--train.global_batch=12", "--json"], capsys
    )
    assert code == 0, err
    assert json.loads(out)["world"] == 6
    code, _, err = run_main(["explain", "--nnodes", "3", "--rdzv", "h:1"], capsys)
    assert code == 2 and "--rdzv is an option of train" in err


def test_node_rank_defaults_to_slurm_nodeid(monkeypatch) -> None:
    from shardwise.launchers.nodes import parse_nodes

    monkeypatch.setenv("SLURM_NODEID", "1")
    assert parse_nodes("2", None, "head:29400", 4) == Nodes(2, 1, "head", 29400, 4)
    assert parse_nodes("2", None, "head:29400", 4).world == 8


def test_placement_keeps_tp_inside_a_node_and_pp_across() -> None:
    # 8 ranks on 2 nodes of 4: rank = (pp, dp, tp) row-major, nodes take 4 consecutive ranks
    assert placement(4, pp=2, dp=2, tp=2) == {"pp": False, "dp": True, "tp": True}
    assert placement(8, pp=2, dp=2, tp=2) == {"pp": True, "dp": True, "tp": True}
    assert placement(2, pp=1, dp=2, tp=4) == {"pp": True, "dp": False, "tp": False}
    line = placement_line(Nodes(2, 0, "h", 1, 4), pp=2, dp=2, tp=2)
    assert line == "nodes: 2 x 4 ranks; tp=2 inside a node, pp=2 across nodes, dp=2 inside a node"
    warned = placement_line(Nodes(4, 0, "h", 1, 2), pp=1, dp=2, tp=4)
    assert "warning: tp=4 groups span nodes (2 ranks per node)" in warned
    assert "Fix: --parallel.tp in [1, 2]" in warned


def test_route_to_finds_the_interface_that_reaches_the_host() -> None:
    assert route_to("127.0.0.1", 29400) == ("127.0.0.1", "lo")


# --- Slurm --------------------------------------------------------------------------------------

CFG = ["--model.n_layers=4", "--train.global_batch=32", "--data.dataset=/data/my corpus/"]


def _sbatch(tmp_path: Path, capsys, *argv: str) -> str:
    out = tmp_path / "job.sbatch"
    code, stdout, err = run_main(["launch", "slurm", *argv, *CFG, "-o", str(out)], capsys)
    assert code == 0, err
    assert stdout == f"wrote {out}\n"
    return out.read_text()


def test_slurm_script_for_gpu_nodes(tmp_path: Path, capsys) -> None:
    script = _sbatch(
        tmp_path, capsys, "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
        "--time", "02:00:00", "--account", "proj1",
    )  # fmt: skip
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=shardwise-tiny",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=02:00:00",
        "#SBATCH --account=proj1",
        "#SBATCH --signal=TERM@120",  # a stop signal before the time limit: save, exit 143
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=%x-%j.out",
        f"#SBATCH --chdir={Path.cwd()}",
    ]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_slurm_script_hands_every_node_the_same_job(tmp_path: Path, capsys) -> None:
    """Run the script with stand-ins for srun/scontrol: the words srun receives must be
    the agent's command line, with the config reproduced exactly (quoting included)."""
    script = _sbatch(
        tmp_path, capsys, "--nodes", "2", "--cpus-per-node", "8", "--nproc-per-node", "4"
    )
    assert "#SBATCH --cpus-per-task=8" in script and "export OMP_NUM_THREADS=2" in script
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text(
        '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo gpu-a17 && exit 0\n'
        'echo "NodeName=gpu-a17 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=gpu-a17"\n'
    )
    (stubs / "srun").write_text('#!/bin/bash\nprintf \'%s\\n\' "$@" > "$SRUN_ARGS"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    argv_file = tmp_path / "argv"
    env = {
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-a[17-18]",
        "SLURM_JOB_NUM_NODES": "2",
        "SRUN_ARGS": str(argv_file),
    }
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    words = argv_file.read_text().splitlines()
    i = words.index("train")
    assert words[: i - 2] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", words[i - 3]]
    assert words[i - 2 : i] == ["-m", "shardwise.cli.main"]
    own = words[i + 1 : i + 9]
    assert own == ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv", "10.1.2.3:29400",
                   "--max-restarts", "0"]  # fmt: skip
    assert load_config(None, words[i + 9 :]) == load_config(None, CFG)


def test_submit_without_sbatch_says_where_to_run(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    argv = ["launch", "slurm", "--nodes", "2", "--cpus-per-node", "2", "-o", str(tmp_path / "j")]
    code, _, err = run_main([*argv, "--submit"], capsys)
    assert code == 2 and "--submit needs `sbatch`, which is not on PATH" in err
    assert (tmp_path / "j").is_file()  # the script is written either way


# --- Kubernetes ---------------------------------------------------------------------------------

K8S_CASES = {
    # scenario 4 style: GPU nodes, ZeRO-3 bf16, fixed size
    "gpu-zero3": [
        "--nodes", "4", "--gpus-per-node", "8", "--image", "ghcr.io/acme/shardwise:0.1",
        "--name", "llama-7b", "--namespace", "research", "--model.name=7b",
        "--parallel.zero=3", "--precision.compute=bf16", "--train.global_batch=256",
        "--run.dir=runs/llama-7b",
    ],
    # CPU nodes, elastic between 2 and 4 pods
    "cpu-elastic": [
        "--nodes", "2:4", "--cpus-per-node", "8", "--nproc-per-node", "4", "--image",
        "registry.local/shardwise:dev", "--model.n_layers=4", "--train.global_batch=48",
        "--max-restarts", "5", "--claim", "team-ckpt", "--mount-path", "/mnt/ckpt",
    ],
}  # fmt: skip


@pytest.fixture(params=sorted(K8S_CASES))
def manifest(request, tmp_path: Path, capsys) -> tuple[str, str, list[str]]:
    out = tmp_path / "job.yaml"
    code, stdout, err = run_main(
        ["launch", "k8s", *K8S_CASES[request.param], "-o", str(out)], capsys
    )
    assert code == 0, err
    assert stdout == f"wrote {out}  (kubectl apply -f {out})\n"
    return request.param, out.read_text(), K8S_CASES[request.param]


def test_manifest_matches_golden_file(manifest) -> None:
    name, text, _ = manifest
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("SHARDWISE_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()


def _round_trip(data: dict, klass: str) -> dict:
    """Deserialise into the official client models (types checked field by field) and back:
    a misspelt or misplaced field is dropped on the way and shows up as a difference."""
    from kubeflow.training.api_client import ApiClient

    class Response:
        pass

    response = Response()
    response.data = json.dumps(data)
    client = ApiClient()
    return client.sanitize_for_serialization(client.deserialize(response, klass))


def test_manifest_parses_into_the_official_models(manifest) -> None:
    from kubernetes import client as k8s

    _, text, _ = manifest
    job = yaml.safe_load(text)
    # the whole PyTorchJob: Kubeflow training SDK models (they embed kubernetes' V1PodTemplateSpec)
    assert _round_trip(job, "KubeflowOrgV1PyTorchJob") == job
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    api = k8s.ApiClient()
    pod = api._ApiClient__deserialize(template, "V1PodTemplateSpec")
    assert (
        isinstance(pod, k8s.V1PodTemplateSpec) and api.sanitize_for_serialization(pod) == template
    )


def test_round_trip_catches_a_misspelt_field(manifest) -> None:
    _, text, _ = manifest
    job = yaml.safe_load(text)
    job["spec"]["elasticPolicy"]["minReplica"] = job["spec"]["elasticPolicy"].pop("minReplicas")
    assert _round_trip(job, "KubeflowOrgV1PyTorchJob") != job


def test_manifest_follows_the_pytorchjob_schema(manifest) -> None:
    """What the Training Operator requires of a PyTorchJob (kubeflow.org/v1), checked here
    because a custom resource is not validated by the core schemas."""
    _, text, argv = manifest
    job = yaml.safe_load(text)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job["spec"]
    assert set(spec) <= {"pytorchReplicaSpecs", "elasticPolicy", "runPolicy", "nprocPerNode"}
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}  # elastic jobs have no Master
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
    elastic = spec["elasticPolicy"]
    assert elastic["rdzvBackend"] in {"c10d", "etcd", "etcd-v2"}
    assert 1 <= elastic["minReplicas"] <= elastic["maxReplicas"] == worker["replicas"]
    nodes = argv[argv.index("--nodes") + 1]
    assert f"{elastic['minReplicas']}:{elastic['maxReplicas']}".startswith(nodes.split(":")[0])
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the operator finds the container by this name
    nproc = spec["nprocPerNode"]
    assert container["command"] == [
        "torchrun",
        f"--nproc-per-node={nproc}",
        "-m",
        "shardwise.cli.main",
    ]
    gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    assert gpus in (None, nproc)  # one rank per GPU
    (volume,) = pod["volumes"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume["name"] and container["workingDir"] == mount["mountPath"]
    assert "claimName" in volume["persistentVolumeClaim"]
    # the container's arguments reproduce the config given to `launch`
    config_args = [a for a in argv if a.startswith("--") and "." in a.split("=")[0]]
    assert container["args"][0] == "train"
    assert load_config(None, container["args"][1:]) == load_config(None, config_args)


K8S_ERRORS = [
    (["--nodes", "2", "--gpus-per-node", "8", "--image", ""], ["--image is empty", "Dockerfile"]),
    (["--nodes", "2", "--gpus-per-node", "8", "--container-image", "x"],
     ["--container-image does not apply to `launch k8s`"]),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", "x", "--name", "My_Job"],
     ["--name='My_Job'"]),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", "x", "--run.dir=/scratch/r"],
     ["run.dir='/scratch/r' is outside the shared volume mounted at /workspace"]),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", "x", "--partition", "p"],
     ["--partition does not apply to `launch k8s`"]),
    (["--nodes", "3:1", "--gpus-per-node", "8", "--image", "x"], ["--nodes '3:1'"]),
    (["--nodes", "2", "--image", "x"], ["no ranks per node", "--gpus-per-node 8"]),
    (["--nodes", "2", "--gpus-per-node", "2", "--nproc-per-node", "4", "--image", "x"],
     ["--nproc-per-node=4 exceeds --gpus-per-node=2"]),
    (["--nodes", "1:4", "--cpus-per-node", "4", "--image", "x"],
     ["on 3 node(s) x 4 ranks = 12 ranks: train.global_batch=16"]),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", "x", "--run.device=cpu"],
     ["run.device='cpu' but --gpus-per-node=8"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "needles"), K8S_ERRORS)
def test_launch_errors_are_one_clear_line(argv, needles, tmp_path: Path, capsys) -> None:
    code, _, err = run_main(["launch", "k8s", *argv, "-o", str(tmp_path / "j.yaml")], capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "j.yaml").exists()  # nothing written


def test_slurm_refuses_k8s_options(tmp_path: Path, capsys) -> None:
    argv = ["launch", "slurm", "--nodes", "2", "--cpus-per-node", "2", "--image", "x"]
    code, _, err = run_main([*argv, "-o", str(tmp_path / "j")], capsys)
    assert code == 2 and "--image does not apply to `launch slurm`" in err


@pytest.mark.slow
def test_a_node_waiting_for_missing_nodes_fails_clearly(tmp_path: Path) -> None:
    """Node 0 of a 2-node job whose other node never starts: one message after the
    rendezvous timeout (parallel.timeout_s), no traceback, no hang."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "shardwise.cli.main", "train", "--nnodes", "2", "--nproc", "1"]
    cmd += ["--node-rank", "0", "--rdzv", f"127.0.0.1:{port}", "--parallel.timeout_s=3"]
    cmd += ["--model.n_layers=1", "--data.seq_len=32", f"--run.dir={tmp_path}", "--run.device=cpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RANK", "WORLD"))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"error: node 0: the rendezvous at 127.0.0.1:{port} failed (RendezvousTimeoutError" in (
        proc.stderr
    )
    assert "Fix: start all 2 nodes with the same --nnodes and --rdzv" in proc.stderr


def test_the_dockerfile_builds_what_the_launchers_name(tmp_path, monkeypatch):
    """No container engine runs here: the Dockerfile is checked as text (base, the torch pin,
    a non-root user, the entry point), and the manifests must name what it builds."""
    from shardwise.cli.launch import launch_main

    text = (Path(__file__).parents[1] / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert "ARG BASE=python:3.11-slim" in lines and "FROM ${BASE}" in lines
    assert "-c constraints.txt" in text and "COPY pyproject.toml constraints.txt" in text
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")  # runs as a user, not root
    assert 'ENTRYPOINT ["shardwise"]' in lines and "WORKDIR /workspace" in lines
    monkeypatch.chdir(tmp_path)
    assert launch_main(["k8s", "--nodes", "2", "--gpus-per-node", "8", "-o", "j.yaml"]) == 0
    assert "image: shardwise:latest" in (tmp_path / "j.yaml").read_text()
    slurm = ["slurm", "--nodes", "2", "--gpus-per-node", "8", "-o", "j.sbatch"]
    assert launch_main([*slurm, "--container-image", "shardwise"]) == 0
    script = (tmp_path / "j.sbatch").read_text()
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --container-image=shardwise " in script
    assert '--container-mounts="$PWD:$PWD"' in script and " python3 -m shardwise.cli.main" in script
