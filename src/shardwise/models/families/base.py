"""What a model family answers (families/__init__.py holds the registry)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from shardwise.models.presets import ModelSpec


@dataclass(frozen=True)
class BlockShape:
    """How the planner's formulas see one block: the parts in which our decoders differ
    (models/decoder.py). A family whose blocks the formulas do not model keeps all False;
    transformers' Llama and GPT-2 presets are our decoders' blocks (their units and GEMMs),
    their saved tensors transformers' own (`transformers`)."""

    gated_mlp: bool = False  # SwiGLU: gate, up and down projections (Shazeer 2020); else GELU
    rotary: bool = False  # RoPE on q and k (Su et al. 2021)
    rms_norm: bool = False  # our fp32 RMSNorm (weight only)
    layer_norm: bool = False  # LayerNorm with weight and bias
    biases: bool = False  # every linear has a bias
    learned_positions: bool = False  # a learned position table beside the token embedding
    # the two norms registered after the linears (transformers' LlamaDecoderLayer), which
    # puts them last in the block's ZeRO unit; ours register each norm before its sub-layer
    norms_last: bool = False
    # q, k and v as one matrix and one bias (GPT-2's Conv1D `c_attn`): one tensor in the unit
    fused_qkv: bool = False
    # transformers' own block (LlamaDecoderLayer, GPT2Block), whose saved tensors differ from
    # ours: norms in its own dtypes, RoPE tables made once per forward, SDPA on un-repeated
    # k/v, GPT-2's tanh GELU as its element-wise ops (plan/activations_hf.py)
    transformers: bool = False
    # (path of block 0's linear in that class, the planner's name of it): which linears a
    # finetune.lora_targets pattern adapts (finetune/lora.py matches the real paths)
    linear_paths: tuple[tuple[str, str], ...] = ()


Recompute = Literal["plans", "checkpoint_blocks", "containers"]


@dataclass(frozen=True)
class Family:
    """One model family: its builder and the answers every layer asks of it."""

    name: str  # in messages, and the key of its recomputation plans (parallel/recompute.py)
    kind: str  # "a ResNet", "your own module": how refusals name it
    archs: tuple[str, ...]  # the ModelSpec.arch values it builds
    build: Callable[[ModelSpec], nn.Module]  # on the current default device (meta is fine)
    task: str | None = None  # for a checkpoint's class: the task it answers for
    data: Literal["tokens", "images", "any"] = "tokens"  # what it trains on
    sized: bool = True  # the spec's sizes (layers, heads, widths) are checked against the layout
    formula: bool = False  # activations priced by formula (else measured on a meta model)
    gemms: bool = True  # its matmuls are a transformer's (the planner's GEMM shapes)
    flops_per_token: bool = True  # 6N + 12·L·h·s applies (MFU)
    classifier: bool = False  # one label per row, from a new head
    from_checkpoint: bool = False  # transformers' own class, structure and weights from a folder
    tensor_parallel: Literal["plan", "checkpoint", "none"] = "plan"
    tp_refusal: str = ""  # why tp > 1 is refused ({name}: model.name, {tp}: the degree)
    sequence_parallel: bool = False
    # transformers' classes: the config model_types whose forward runs sequence-parallel
    # (norms and residuals on s/tp tokens; with routed experts each tp rank's experts compute
    # its shard; parallel/tensor.py hands the forward the whole sequence's positions), each
    # checked against one process (a preset's family names the one class it builds)
    sp_model_types: tuple[str, ...] = ()
    grouped_query: bool = True  # k/v heads may be fewer than query heads
    pipeline: Literal["blocks", "checkpoint", "none"] = "none"
    packs_rows: bool = True  # masks attention per record (data.pack)
    chunked_loss: bool = False  # its head computes the loss in chunks (train.loss_chunks)
    compiles: bool = False  # train.compile=blocks compiles its blocks (tested: parity)
    # its attention cores take a context (parallel/context.py), or transformers' attention
    # calls the cp kernels (parallel/context_hf.py): parallel.cp splits the sequence
    context_parallel: bool = False
    # for a checkpoint's class: the config model_types whose attention and positions the cp
    # transformation reaches (each checked against one process); empty: any it builds
    cp_model_types: tuple[str, ...] = ()
    # cp composes with tp and pp (its stages take the global positions), checked against
    # one process; packed records compose with cp in every cp family (the kernels' starts)
    cp_composes: bool = False
    # its MoE layers take an expert exchange (parallel/expert.py): parallel.ep shards experts
    expert_parallel: bool = False
    recompute: Recompute = "plans"
    # how ZeRO cuts it into units (parallel/zero_units.py): "children" at the top-level
    # children and the blocks of a repeated container (our decoders: embed, blocks.N, norm,
    # head); "blocks" at each instance of transformers' repeated block class
    # (`_no_split_modules`) and at every other maximal subtree owning parameters (embedding,
    # each layer, final norm, head: the planner's units, as FSDP2/torchtitan wrap them), so
    # ZeRO-3 never holds the embedding through the whole forward
    zero_units: Literal["children", "blocks"] = "children"
    # precision.fp8: whether the nn.Linear of this name converts to FP8 (the blocks'
    # projections; embedding, head, norms and routers keep their dtype); None: FP8 training
    # of this family is not tested, and refused (parallel/fp8.py)
    fp8_linear: Callable[[str], bool] | None = None
    # for a checkpoint's class: the config model_types whose block linears fp8_linear names
    # (each trained against bf16 and one process); empty: any it builds
    fp8_model_types: tuple[str, ...] = ()
    # FP8 under tp is checked against one process (each rank scales its own slices); False:
    # precision.fp8 with parallel.tp > 1 is refused
    fp8_tensor_parallel: bool = False
    block: BlockShape = BlockShape()
    # `shardwise export --format hf` of our own modules: the config.json transformers reads
    # (None: no Hugging Face class holds this family; a checkpoint's class writes its own)
    hf_config: Callable[[ModelSpec, str], dict] | None = None
    hf_keeps_dropout: bool = False  # that config carries model.dropout (residual dropout)
    # tensors that class holds and no parameter of ours does (a 0-wide shared expert, GLM-4-MoE's
    # routing biases from the run's buffers by name), each in its dtype (the export's: the str);
    # made once, before the export writes any file, so that its refusals leave OUT as it was
    hf_extra: Callable[[ModelSpec, dict, str], dict] | None = None
    # before writing: refuses what the class would compute differently, given the run's
    # buffers by name (the balancing biases); returns notes on what the export computes
    hf_check: Callable[[ModelSpec, dict], list[str]] | None = None
