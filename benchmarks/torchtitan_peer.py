"""torchtitan's Llama 3 at the widths of a shardwise decoder: cuda_speed.py's torchtitan rows.

torchtitan (the PyTorch team's reference trainer) has no stable model API: its 0.3.0 release
builds a Llama 3 from a tree of per-module configs (`Llama3Model.Config`), so this file builds
the tree as its own presets do (`llama3._build_llama3_layers`, a private helper of that
release: the version is checked, not guessed) at the decoder's widths: layers, width, heads,
kv heads, SwiGLU hidden width, vocabulary, RMSNorm eps and RoPE base (no frequency scaling:
ours has none), untied head, its fused qkv projection. The parameter count must equal ours.
Attention is SDPA, as ours: 0.3.0 builds language models on FlexAttention (fast only compiled,
with block masks) and refuses "sdpa" by name there, so its SDPA module is put in each layer's
config by hand; it asks for cuDNN, then Flash, then the math kernel, which may differ from
the kernel our SDPA call gets.

What torchtitan's trainer does on one device, done here by its own functions: float8 through
its converter (`Float8LinearConverter`: rowwise recipes only in 0.3.0; the head left in bf16
through `filter_fqns`, as ours); `parallelize_llama` on a one-rank mesh, which compiles each
block (`apply_compile`, `fullgraph=True`) and applies FSDP2 whatever the rank count, for its
mixed precision (bf16 parameters in compute, fp32 gradients reduced and fp32 master weights: no
autocast); its `init_weights`; its loss compiled with the blocks (its default
`compile.components`; on plain tensors its `cross_entropy_loss` is the AMP peer's sum of token
cross-entropies over fp32 logits); fused AdamW. Left out: activation checkpointing (its
trainer's default is selective; ours runs without recomputation, so torchtitan does too);
its trainer, data loader and config registry, and with them its gradient clipping (max norm
1.0: per-step work it would pay), its garbage-collection schedule and its training context
(which, on one rank, change no number): the loop, data order and AdamW settings are the AMP
peer's (cuda_profile.peer), so the rows differ in the model code, its precision path, its
compile and its FP8.

cuda_speed.py runs each row as `python benchmarks/torchtitan_peer.py ... --json FILE`, a
process of its own: torchtitan's global switches (dynamo's and inductor's configs), its
compiled modules' memory and any import failure of a release built against another torch end
with it, under the run's timeout. On the GPU machine its wheels (and the few its model code
imports: spmd_types, tyro) come from benchmarks/gpu_wheels.sh; torch's CUDA wheels bring
triton, which it imports too. 0.3.0 needs torch >= 2.12: its FSDP code imports one type
2.11 (the GPU machine's) lacks, so on 2.11 a stand-in class takes that name (`stand_in`; on
one rank it is never built: every other torch name this path uses was checked against
2.11.0's sources), and each row says so below the table; an older torch is skipped in one
line. On a CPU (the smoke)
torchtitan's mesh would still ask for CUDA: its device type is set to "cpu" there.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

VERSION = "0.3.0"  # the model-config API this file builds with
NEEDS_TORCH = "2.12"  # the oldest torch whose FSDP API that release imports
# the older torch it runs on with a stand-in for that one name (`stand_in`), read, not guessed:
# every torch name this path imports or calls, checked against 2.11.0's sources
STAND_IN_TORCH = "2.11"


def unavailable() -> str:
    """Why the torchtitan rows cannot run here ("" when they can), without importing it: a
    release that fails to import says so in its own row."""
    try:
        found = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return f"torchtitan not installed (benchmarks/gpu_wheels.sh fetches {VERSION})"
    except Exception as exc:  # unreadable metadata: the same outcome, said
        return f"torchtitan's metadata: {type(exc).__name__}: {exc}"
    if found != VERSION:
        return f"torchtitan {found} installed; this script builds with {VERSION}'s model API"
    if importlib.util.find_spec("torchtitan") is None:
        return f"torchtitan {VERSION}'s metadata is here but not its package"
    import torch.distributed.fsdp as fsdp

    minor = ".".join(torch.__version__.split(".")[:2])
    if not hasattr(fsdp, "DataParallelMeshDims") and minor != STAND_IN_TORCH:
        return (
            f"torchtitan {VERSION} needs torch >= {NEEDS_TORCH} (its FSDP code imports "
            f"torch.distributed.fsdp.DataParallelMeshDims; {STAND_IN_TORCH} runs it with a "
            f"stand-in); this torch is {torch.__version__}"
        )
    return ""


def stand_in() -> str:
    """On torch 2.11, a class under the one name torchtitan 0.3.0 imports from a newer torch
    (torch.distributed.fsdp.DataParallelMeshDims, 2.12): its FSDP code names it in
    annotations and builds one only for a multi-dimensional data-parallel mesh, never on one
    rank (its `resolve_fsdp_mesh` passes None there). What the row then says of itself ("":
    nothing stood in)."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return ""

    class DataParallelMeshDims:
        """Stands in for torch 2.12's type; never built on one rank."""

    fsdp.DataParallelMeshDims = DataParallelMeshDims
    return (
        f"torchtitan {VERSION} on torch {torch.__version__}, older than the {NEEDS_TORCH} it "
        "supports: a stand-in for torch.distributed.fsdp.DataParallelMeshDims, which it imports "
        "and on one rank never builds"
    )


def model_config(spec, seq: int, fp8: str, compile_: bool):
    """torchtitan's config tree for the decoder `spec` (FP8 `fp8`: its float8 converter)."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        ScaledDotProductAttention,
    )
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    head_dim = spec.dim // spec.n_heads
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=seq, theta=spec.rope_theta)
    layers = _build_llama3_layers(
        n_layers=spec.n_layers,
        dim=spec.dim,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        hidden_dim=spec.ffn_dim,
        rope=rope,
        attn_backend="flex",  # refuses "sdpa"; replaced below, layer by layer
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = spec.norm_eps
    cfg = Llama3Model.Config(
        dim=spec.dim,
        vocab_size=spec.vocab_size,
        layers=layers,
        tok_embeddings=Embedding.Config(
            num_embeddings=spec.vocab_size, embedding_dim=spec.dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=spec.dim, eps=spec.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=spec.dim,
            out_features=spec.vocab_size,
            param_init=_output_linear_init(spec.dim),
        ),
    )
    if fp8 == "none":
        return cfg
    from torchtitan.components.quantization import Float8LinearConverter

    converter = Float8LinearConverter.Config(
        recipe_name=fp8, filter_fqns=["lm_head"], model_compile_enabled=compile_
    ).build()
    return converter.convert(cfg)


def build(
    spec, seq: int, device: torch.device, compile_: bool, fp8: str, folder: Path
) -> nn.Module:
    """torchtitan's model for `spec`, parallelised by its `parallelize_llama` on a one-rank
    mesh (compiled blocks when `compile_`, FSDP2's bf16 mixed precision) and initialised by
    its own `init_weights`, as its trainer does; `folder`: the row's, its dump folder."""
    stand_in()  # before torchtitan imports it
    import torchtitan.distributed.parallel_dims as dims
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    if not dist.is_initialized():  # one rank: an in-memory store, no socket
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cpu":
        dims.device_type = "cpu"  # it assumes an accelerator (the smoke's CPU has none)
    one = dims.ParallelDims.from_config(ParallelismConfig(), 1)
    with torch.device("meta"):
        model = model_config(spec, seq, fp8, compile_).build()
    parallelize_llama(
        model,
        parallel_dims=one,
        training=TrainingConfig(),  # mixed precision: bf16 parameters, fp32 reduce
        parallelism=ParallelismConfig(),
        compile_config=CompileConfig(enable=compile_),
        ac_config=None,
        dump_folder=str(folder),
    )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model.train()


def main() -> int:
    """One torchtitan row in this process: its result as JSON in --json FILE."""
    from cuda_profile import add_run_args, peer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, warmup=3)
    p.add_argument("--compile", choices=["false", "blocks"], default="false")
    p.add_argument("--fp8", choices=["none", "rowwise", "rowwise_with_gw_hp"], default="none")
    p.add_argument("--shape", default="[]", help="JSON list: overrides of the model's shape")
    p.add_argument("--folder", type=Path, required=True, help="the run's folder")
    p.add_argument("--json", type=Path, required=True, help="where the result goes")
    a = p.parse_args()
    if a.precision != "bf16":  # its mixed precision (TrainingConfig's default) is bf16
        sys.exit(f"torchtitan rows train in bf16 only, not --precision {a.precision}")
    if why := unavailable():  # (cuda_speed.py skips such rows; this is for a run by hand)
        sys.exit(why)
    compiled = a.compile == "blocks"

    def titan(spec, seq, device):
        return build(spec, seq, device, compiled, a.fp8, a.folder)

    extra = json.loads(a.shape)
    note = stand_in()  # what the row says of itself, if anything stood in
    try:
        r = peer(a, a.folder, a.warmup + a.steps, extra, titan, compile_loss=compiled, amp=False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    a.json.write_text(json.dumps({**r, "note": note} if note else r))
    print(f"torchtitan: {r['step_s'] * 1e3:.1f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
