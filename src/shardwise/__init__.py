"""shardwise: train PyTorch models too large or too slow for one device.

`shardwise.train(config, model=..., dataset=..., loss=..., nproc=...)` is the Python entry
point (shardwise/cli/api.py); `shardwise train` the command line."""


def __getattr__(name: str):
    if name == "train":  # imported on first use: `import shardwise` stays cheap
        from shardwise.cli.api import train

        return train
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
