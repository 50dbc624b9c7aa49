# shardwise in a container, built with the same torch pin as everywhere else (constraints.txt).
#
#   CPU:   docker build -t shardwise .
#   CUDA:  docker build -t shardwise:cuda \
#            --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#            --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   run:   docker run --rm -v "$PWD/runs:/workspace/runs" shardwise train --nproc 2
#
# The Kubernetes manifest (`shardwise launch k8s`) names this image by default; Slurm runs it
# through pyxis/enroot with `shardwise launch slurm --container-image shardwise`.
ARG BASE=python:3.11-slim
FROM ${BASE}

# the wheel index torch comes from: CPU wheels by default, a CUDA index for GPU images
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# a CUDA base image has no Python of its own
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /opt/shardwise/src
COPY pyproject.toml constraints.txt README.md ./
COPY src ./src
RUN python3 -m venv /opt/shardwise/venv \
    && /opt/shardwise/venv/bin/pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" \
        -c constraints.txt ".[finetune]" transformers

# not root: the job writes only run.dir and checkpoint.dir, on a mounted volume
RUN useradd --create-home --uid 1000 shardwise && mkdir -p /workspace \
    && chown shardwise:shardwise /workspace
USER shardwise
WORKDIR /workspace
ENV PATH=/opt/shardwise/venv/bin:${PATH} PYTHONUNBUFFERED=1
ENTRYPOINT ["shardwise"]
CMD ["--help"]
