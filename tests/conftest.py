import os

# Tests share one tokenizer/token cache per machine (built once, ~30 s) unless told otherwise.
os.environ.setdefault("SHARDWISE_CACHE", os.path.expanduser("~/.cache/shardwise"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
