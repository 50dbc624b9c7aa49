"""shardwise: train PyTorch models too large or too slow for one device.

`shardwise.train(config, model=..., dataset=..., loss=..., nproc=...)` is the Python entry
point (shardwise/cli/api.py); `shardwise train` the command line."""

import logging


class _TorchaoEnumNotice(logging.Filter):
    """torchao 0.18 registers its float8 enums as pytree constants, which torch 2.13 logs as
    deprecated on every import of torchao (transformers and peft import it when installed):
    a notice for torchao's maintainers, not for anyone training. Only that message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())


def __getattr__(name: str):
    if name == "train":  # imported on first use: `import shardwise` stays cheap
        from shardwise.cli.api import train

        return train
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
