import os

# Tests share one tokenizer/token cache per machine (built once, ~30 s) unless told otherwise.
os.environ.setdefault("SHARDWISE_CACHE", os.path.expanduser("~/.cache/shardwise"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs the suite on 2 pytest-xdist workers, one test file each at a time
# (--dist loadfile: a file's spawned worlds and fixtures stay on one worker). Files are handed
# out in collection order, so the longest go first; otherwise one of them started last keeps
# one worker busy alone at the end (measured: ~2 of 12 minutes; test_launchers' 2-node runs
# were the last file once).
LONGEST_FIRST = [
    "test_benchmarks.py",
    "test_multinode.py",
    "test_launchers.py",
    "test_pipeline.py",
    "test_tensor.py",
    "test_zero.py",
    "test_preempt.py",
    "test_compression.py",
    "test_hf_models.py",
    "test_lora.py",
    "test_checkpoint.py",
    "test_hang.py",
    "test_network.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
