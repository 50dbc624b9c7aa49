"""shardwise's own decoders (models/decoder.py): Llama-style and GPT-2-style blocks."""

from __future__ import annotations

from shardwise.models.decoder import Decoder
from shardwise.models.families.base import BlockShape, Family
from shardwise.models.hf import gpt2, llama


def _block_linear(name: str) -> bool:
    """A linear layer inside a block (blocks.N.attn.wq ... blocks.N.mlp.w2), not the head."""
    return name.startswith("blocks.")


_OURS = dict(
    fp8_linear=_block_linear,
    fp8_tensor_parallel=True,  # slice scales within 2e-3 of one process (tests/test_fp8.py)
    build=Decoder,
    formula=True,
    sequence_parallel=True,
    pipeline="blocks",
    chunked_loss=True,  # models/chunked_loss.LMHead
    compiles=True,
    context_parallel=True,  # AttentionCore.context; GPT-2's positions through pos_embed
    cp_composes=True,  # tp and pp under cp (tests/test_context_parallel_measured.py)
    kind="a shardwise decoder",
)

DECODER = Family(
    name="decoder",
    archs=("decoder",),
    block=BlockShape(gated_mlp=True, rotary=True, rms_norm=True),
    hf_config=llama.config,  # transformers' Llama: attention dropout only
    **_OURS,
)

GPT2 = Family(
    name="gpt2",
    archs=("gpt2",),
    block=BlockShape(layer_norm=True, biases=True, learned_positions=True),
    hf_config=gpt2.config,
    hf_keeps_dropout=True,  # resid_pdrop / embd_pdrop
    **_OURS,
)
