#!/usr/bin/env bash
# The GPU benchmarks in one command on a machine borrowed for minutes, without network, whose
# results come back only as files in $OUT: installs the wheels of .whl/ (benchmarks/
# gpu_wheels.sh, run beforehand where there is network) into a scratch folder, records the
# versions and nvidia-smi, then runs benchmarks/cuda_speed.py and benchmarks/cuda_profile.py,
# each under a timeout so the whole stays under CUDA_RUN_DEADLINE_S (default 530 s: a borrowed
# machine's command may run 10 minutes, of 15 in all with the machine's start). Every result
# is written into $OUT as it is produced, so a timeout still returns what finished:
#
#   env.txt             versions, nvidia-smi, what was installed
#   cuda_speed.log      cuda_speed.py's output, per step as it trains
#   cuda_speed.jsonl    one object per run (measured, skipped or failed), as each ends
#   cuda_speed.md       the table so far, rewritten after every run
#   cuda_profile.log    cuda_profile.py's output (the device's ledger of the traced step)
#   published.jsonl     both scripts' runs as rows of the published record (--row)
#
#   OUT=/some/dir bash benchmarks/cuda_run.sh            # on the GPU machine
#   OUT=$(mktemp -d) PYTHONPATH=tests/support/device_site PYTHON=.venv/bin/python \
#       bash benchmarks/cuda_run.sh --smoke              # rehearsal on a CPU (docs/profile.md)
#
# PYTHON (default python3) runs everything; CUDA_RUN_SITE (default: a new temporary folder)
# receives the wheels; CUDA_SPEED_BUDGET_S (default 430) is cuda_speed.py's --budget-s (its
# estimates, from the first H200 runs rounded up, come to ~410 s for the eleven rows of ours
# and the AMP peer's, which took ~300 s, and ~125 s for torchtitan's three; a row starts while
# its own estimate fits what is left, so at the measured pace all fit, torchtitan's FP8 last;
# a cuda_speed.py that takes its whole budget leaves cuda_profile.py under its ~80 s: the
# speed rows come first);
# cuda_profile.py gets what is left before the deadline (~80 s needed by the same kind of
# estimate: a profile, `explain` and the peer), and is skipped with under 60 s.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${CUDA_RUN_SITE:-$(mktemp -d)}
DEADLINE=${CUDA_RUN_DEADLINE_S:-530}
BUDGET=${CUDA_SPEED_BUDGET_S:-430}
SMOKE=()
[ "${1:-}" = "--smoke" ] && SMOKE=(--smoke)
export PYTHONUNBUFFERED=1
left() { echo $((DEADLINE - SECONDS)); }

{
    date -u
    if compgen -G ".whl/*.whl" > /dev/null; then
        echo "installing into $SITE:" .whl/*.whl
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl || echo "install failed: the FP8 and torchtitan runs will say why"
    else
        echo "no .whl/ here (bash benchmarks/gpu_wheels.sh): nothing installed"
    fi
} 2>&1 | tee "$OUT/env.txt"
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
{
    "$PY" -c 'import sys; print("python", sys.version.split()[0])'
    "$PY" - << 'PY'
import importlib.util

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())
for name in ("triton", "transformers", "torchao", "torchtitan", "datasets", "shardwise"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(name, "missing")
        continue
    module = importlib.import_module(name)
    print(name, getattr(module, "__version__", "?"), spec.origin)
PY
    nvidia-smi || echo "nvidia-smi: not here"
} 2>&1 | tee -a "$OUT/env.txt"

echo "== cuda_speed.py: budget ${BUDGET} s, $(left) s left of ${DEADLINE}"
timeout -k 10 $((BUDGET + 45)) "$PY" benchmarks/cuda_speed.py "${SMOKE[@]}" \
    --budget-s "$BUDGET" --out "$OUT" --row "$OUT/published.jsonl" 2>&1 | tee "$OUT/cuda_speed.log"
speed=${PIPESTATUS[0]}

profile_s=$(($(left) - 10))
if [ "$profile_s" -ge 60 ]; then
    echo "== cuda_profile.py: ${profile_s} s"
    # the profile and its peer; the ledger's A/B (--ledger-rounds) is a run of its own
    timeout -k 10 "$profile_s" "$PY" benchmarks/cuda_profile.py "${SMOKE[@]}" --ledger-rounds 0 \
        --row "$OUT/published.jsonl" 2>&1 | tee "$OUT/cuda_profile.log"
    profile=${PIPESTATUS[0]}
else
    echo "cuda_profile.py skipped: ${profile_s} s left" | tee "$OUT/cuda_profile.log"
    profile=skipped
fi
# 124: killed by its timeout (what finished is in $OUT all the same)
echo "== cuda_run: cuda_speed exit ${speed}, cuda_profile exit ${profile}, ${SECONDS} s"
ls -l "$OUT"
[ "$speed" = 0 ] && { [ "$profile" = 0 ] || [ "$profile" = skipped ]; }
