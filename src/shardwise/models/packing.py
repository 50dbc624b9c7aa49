"""Packed sequences (`data.pack=true`): several instruction/chat records share one row, and
none of them sees another.

A packed batch is `[B, 2, S]`: token ids and, per position, the number of the record it belongs
to (1, 2, ... in the row; 0 for the padding after the last one). From the record numbers the
model takes, per row:
* positions that restart at 0 where a record starts (RoPE or learned position embeddings see
  each record exactly as if it were alone);
* a block-diagonal causal mask: position i attends to j <= i of the same record only (the
  padding attends to padding, so no row of the softmax is empty). It is additive (0 or -inf)
  in the compute dtype, built once per forward: the attention of every layer adds the same
  tensor, so backward keeps one copy of it (a boolean mask is converted per layer).
So each record's logits equal those of the record alone in a row (up to the float rounding of
a masked vs. a causal attention kernel), and its loss too: the targets already carry -100
outside responses and on the padding. As in transformers' packed training, the mask is dense
([B, S, S] booleans, built once per forward and shared by the layers).

Context parallelism (parallel/context.py) hands each rank a part of every row as `[B, 3, S/cp]`:
the ids, the record numbers and the positions within the record, taken on the whole row
(`packed_part`), because where a record starts may lie on another rank. Such a part builds no
mask: the cp attention kernels mask by record themselves, from those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    positions: torch.Tensor  # [B, S] int64: the index of each token within its record
    # [B, 1, S, S] additive: 0 where query i may attend to key j, else -inf; None for a part
    # of a row (context parallelism), whose attention kernels mask by record themselves
    mask: torch.Tensor | None


def is_packed(tokens: torch.Tensor) -> bool:
    """A packed batch [B, 2, S], or a part of one [B, 3, S_part] (`packed_part`)."""
    return tokens.dim() == 3 and tokens.shape[1] in (2, 3) and not tokens.is_floating_point()


def record_positions(records: torch.Tensor) -> torch.Tensor:
    """[B, S] int64: each token's index within its record (records [B, S]: contiguous runs of
    one number, as the packer writes them)."""
    b, s = records.shape
    index = torch.arange(s, device=records.device).expand(b, s)
    starts = torch.ones_like(records, dtype=torch.bool)
    starts[:, 1:] = records[:, 1:] != records[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def packed_part(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The tokens at `index` of every packed row [B, 2, S] as [B, 3, len(index)]: ids, record
    numbers and positions within the record, the latter counted on the whole row."""
    positions = record_positions(tokens[:, 1])
    return torch.cat([tokens, positions[:, None]], dim=1)[:, :, index]


def unpack(tokens: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Packed]:
    """(ids [B, S], their positions and `dtype` mask) of a packed batch [B, 2, S]; of a part
    of one [B, 3, S] (`packed_part`), the positions it carries and no mask."""
    if tokens.shape[1] == 3:
        return tokens[:, 0], Packed(tokens[:, 2], None)
    ids, records = tokens[:, 0], tokens[:, 1]
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    same = records[:, :, None] == records[:, None, :]
    zero = torch.zeros((), dtype=dtype, device=ids.device)
    mask = torch.where((same & causal)[:, None], zero, float("-inf"))
    return ids, Packed(record_positions(records), mask)


def take_packed_tokens(model: torch.nn.Module) -> None:
    """Let a Hugging Face causal LM take a packed batch as its one positional input: the ids,
    `position_ids` restarting per record and the additive 4-D mask (transformers uses a 4-D
    mask as given). Plain [B, S] ids pass through unchanged. An instance attribute: module
    names do not change."""
    inner = model.forward

    def forward(input_ids=None, **kwargs):
        if input_ids is not None and is_packed(input_ids):
            ids, packed = unpack(input_ids, model.get_input_embeddings().weight.dtype)
            kwargs.update(position_ids=packed.positions, attention_mask=packed.mask)
            return inner(input_ids=ids, **kwargs)
        return inner(input_ids, **kwargs)

    model.forward = forward
