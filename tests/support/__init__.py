"""Test and benchmark rigs: PyTorch peers (DDP, FSDP2, DTensor, DeepSpeed), fault hooks,
chaos, Slurm and netns rigs. Imported as `support` (tests/ is on `sys.path`: pyproject's
pytest `pythonpath`, PYTHONPATH set by tests/conftest.py for the processes tests start, and
benchmarks/common.py for the benchmark scripts)."""
