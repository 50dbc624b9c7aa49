#!/usr/bin/env bash
# Download, here, the wheels benchmarks/cuda_run.sh installs on the GPU machine, which has no
# network: what its Python (3.12, torch 2.11.0+cu130) lacks for the GPU benchmarks. Into .whl/
# (git-ignored), which then travels with the working tree (the run's carry [".whl"]).
#
#   bash benchmarks/gpu_wheels.sh
#
# torchao: `import shardwise`, the bf16 runs, the peer and the profile need nothing more
# there (checked by tests/test_cuda_run.py with the missing packages blocked). torchao 0.18.0:
# the float8 training API parallel/fp8.py calls (Float8LinearConfig.from_recipe_name,
# convert_to_float8_training, float8_linear.matmul_with_hp_or_float8_args), the version
# pyproject's fp8 extra pins; from 0.17 torchao needs torch >= 2.11 (its __init__'s
# min_torch_version gate), so 2.11 is the oldest torch it runs on. Its compiled kernels (mxfp8,
# cutlass) may not load under CUDA 13 and are not used: float8 training is Python over
# torch._scaled_mm.
#
# And torchtitan 0.3.0 for cuda_speed.py's torchtitan rows (benchmarks/torchtitan_peer.py
# builds with that release's model API), without its declared dependencies (its `datasets<4.8`
# pin and its trainer's data and logging stack are not what its model code imports): only
# those its model code imports, spmd_types and tyro (with tyro's docstring_parser, typeguard and
# a typing_extensions new enough for typeguard). torch's CUDA wheels bring the triton it also
# imports. 0.3.0 supports torch >= 2.12 (its FSDP code imports torch.distributed.fsdp.
# DataParallelMeshDims): under the 2.11 above a stand-in class takes that name
# (benchmarks/torchtitan_peer.py, stand_in) and its rows say so.
# Checked on CPU under torch 2.13: the same files in a --target folder train its eager and
# compiled rows of the smoke's shape.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(torchao==0.18.0 torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0
    typeguard==4.6.1 typing_extensions==4.16.0)
MAX_MIB=32  # everything that travels is capped at 64 MiB: leave room for the tree
mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
mib=$(du -sm .whl | cut -f1)
ls -l .whl
echo "gpu_wheels: .whl/ holds ${mib} MiB"
if [ "$mib" -gt "$MAX_MIB" ]; then
    echo "gpu_wheels: over ${MAX_MIB} MiB: too large to travel with the tree" >&2
    exit 1
fi
