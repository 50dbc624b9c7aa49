"""shardwise: train PyTorch models too large or too slow for one device.

`shardwise.train(config, model=..., dataset=..., loss=..., nproc=...)` is the Python entry
point (shardwise/cli/api.py); `shardwise train` the command line."""

import logging


class _Notice(logging.Filter):
    """Drops the messages of a library's logger that contain every one of `needles`: notices
    for that library's maintainers, not for anyone training. Every other message passes."""

    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(needle in message for needle in self.needles)


# torchao 0.18 registers its float8 enums as pytree constants, which torch 2.13 logs as
# deprecated on every import of torchao (transformers and peft import it when installed)
logging.getLogger("torch.utils._pytree").addFilter(
    _Notice("is an Enum subclass and is now natively supported")
)
# torchao 0.18's wheel carries two optional kernel libraries that cannot load everywhere (its
# MX-FP8 ops built for CPython 3.10 only, CUTLASS kernels for SM90) and warns about each on
# every import: `plan` of a Hugging Face config printed both. precision.fp8 uses neither
# (torchao's float8 training calls torch._scaled_mm).
for _library in ("_C_mxfp8", "_C_cutlass"):
    logging.getLogger("torchao").addFilter(_Notice("Failed to load ", f"/torchao/{_library}"))


def __getattr__(name: str):
    if name == "train":  # imported on first use: `import shardwise` stays cheap
        from shardwise.cli.api import train

        return train
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
