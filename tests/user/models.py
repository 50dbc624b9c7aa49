"""A user's own models, defined outside the shardwise package (tests/test_custom_model.py and
the README's example train them through `model.name=tests/user/models.py:NAME`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


def mlp() -> nn.Module:
    """An MLP classifier of 32x32 grey images into 10 classes (the digits data)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(32 * 32, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class TinyLM(nn.Module):
    """A small causal transformer from torch's own layers: token and position embeddings,
    pre-norm encoder layers under a causal mask (a buffer), a final norm and a head."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(s, device=ids.device))
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:s, :s], is_causal=True)
        return self.head(self.norm(x))


def transformer(vocab_size: int, seq_len: int) -> nn.Module:
    return TinyLM(vocab_size, seq_len)


class Scaled(nn.Module):
    """Holds a parameter of its own without reset_parameters(): refused before launch."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(10))
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(32 * 32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def not_a_module() -> dict:
    return {"weights": torch.zeros(3)}


def regressor() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def waves(split: str):
    """A regression set: y = sum(sin(x)) over 8 features (train 256 samples, val 64)."""
    n, seed = (256, 0) if split == "train" else (64, 1)
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, torch.sin(x).sum(-1))


def summed_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.squeeze(-1) - target) ** 2).sum()


def bad_items(split: str):
    return [torch.zeros(8)] * 4 if split == "train" else None


def one_held_out(split: str):
    """64 training samples and a single held-out one: two ranks cannot each evaluate one."""
    data = waves(split)
    return data if split == "train" else torch.utils.data.Subset(data, [0])


@dataclasses.dataclass
class Hidden:
    """A block's output as a dataclass (as some model code returns)."""

    states: torch.Tensor


class _Wrapped:
    """A block's output in a plain object: no structure a framework can look into."""

    def __init__(self, states: torch.Tensor) -> None:
        self.states = states


class _Block(nn.Module):
    def __init__(self, dim: int, box) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.box = box

    def forward(self, x):
        return self.box(x.states + self.body(x.states))


class BoxedLM(nn.Module):
    """A small language model whose blocks pass their hidden states in a box."""

    def __init__(self, vocab_size: int, box, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.box = box
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(_Block(dim, box) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.box(self.embed(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(x.states)


def dataclass_blocks(vocab_size: int) -> nn.Module:
    return BoxedLM(vocab_size, Hidden)


def opaque_blocks(vocab_size: int) -> nn.Module:
    return BoxedLM(vocab_size, _Wrapped)


class _Watched(nn.Sequential):
    """An MLP that reads a statistic of its activations to the host in every forward (as
    user code that logs from inside the model does): a host sync per forward."""

    peak = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.peak = max(self.peak, out.detach().abs().max().item())
        return out


def watched_mlp() -> nn.Module:
    """`mlp` with a `.item()` in its forward (profile tests: a user's host sync)."""
    return _Watched(*mlp())
