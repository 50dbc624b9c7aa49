import os
from pathlib import Path

# The test rigs (tests/support/) are imported as `support`: pytest puts tests/ on sys.path
# (pyproject's pythonpath), and PYTHONPATH carries it to the processes the tests start (a
# `python -m support.faultjob`, a `shardwise train` told to run a `support.hooks:` hook).
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p
    )

# Tests share one tokenizer/token cache per machine (built once, ~30 s) unless told otherwise.
os.environ.setdefault("SHARDWISE_CACHE", os.path.expanduser("~/.cache/shardwise"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs the suite on 2 pytest-xdist workers, one test file each at a time
# (--dist loadfile: a file's spawned worlds and fixtures stay on one worker). Files are handed
# out in collection order (the Makefile passes --no-loadscope-reorder: xdist would otherwise
# order them by their number of tests, which put test_multinode's three 2-minute tests last),
# so the longest go first; otherwise one of them started last keeps one worker busy alone at
# the end. Seconds per file measured on 2026-11-26 (pytest --durations=0, 2 workers), > 15 s:
LONGEST_FIRST = [
    "test_benchmarks.py",  # 150
    "test_multinode.py",  # 143
    "test_hf_models.py",  # 111
    "test_pipeline.py",  # 93
    "test_compression.py",  # 87
    "test_cli.py",  # 84
    "test_preempt.py",  # 83
    "test_checkpoint.py",  # 81
    "test_zero.py",  # 65
    "test_compile.py",  # 75 with a cold inductor cache, 22 warm
    "test_tensor.py",  # 50
    "test_lora.py",  # 44
    "test_network.py",  # 40
    "test_adam8bit.py",  # 40
    "test_hang.py",  # 37
    "test_bad_input.py",  # 34
    "test_memory_precision.py",  # 22
    "test_plan_time.py",  # 20
    "test_default_job.py",  # 19
    "test_python_api.py",  # 19
    "test_parity.py",  # 18
    "test_locks.py",  # 17
    "test_pretrained_tokenizer.py",  # 16
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
