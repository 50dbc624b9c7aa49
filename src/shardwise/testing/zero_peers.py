"""ZeRO peers: PyTorch FSDP2 (`fully_shard`) and DeepSpeed ZeRO-1/2/3 on exactly our model, data
order, AdamW groups, schedule, loss normalisation and clipping, as oracles and benchmark peers.

Same contract as `shardwise.testing.peers.ddp_peer`: a function of the config that runs inside
a `run_world` world and returns `losses` (global mean per step), `params` (full-shape fp32 CPU
tensors by our parameter names, gathered on every rank), `step_times`, and `state_bytes`: the
model-state bytes this rank holds by category, counted from the peer's own tensors.

DeepSpeed is optional (the `bench` extra). It runs on CPU under `DS_ACCELERATOR=cpu` with the
gloo group the harness created; our torch AdamW is its client optimizer, so none of its C++
optimizer ops is needed, but its communication backend builds a shared-memory op on first use:
`TORCH_EXTENSIONS_DIR` defaults to a folder under the shardwise cache so that happens once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise import device as dev
from shardwise.config import Config
from shardwise.data import GlobalSampler, load_data, split_for_rank
from shardwise.models import build_model, init_weights
from shardwise.optim import lr_at
from shardwise.runtime import data_spec, init_distributed
from shardwise.validate import Derived, derive


@dataclass
class _Setup:
    """What every peer shares with ours: the model (full, on this rank), data and optimizer."""

    cfg: Config
    d: Derived
    info: dev.DeviceInfo
    model: nn.Module
    data: object
    sampler: GlobalSampler
    rank_count: int  # tokens of this rank's part of the global batch: the loss normaliser


def _setup(cfg: Config) -> _Setup:
    info = init_distributed(cfg)
    d = derive(cfg, dist.get_world_size())
    data = load_data(data_spec(cfg, d.spec.vocab_size), "train")
    with torch.device(info.device):
        model = build_model(d.spec)
    init_weights(model, cfg.train.seed)  # (seed, name): every rank holds the same full model
    sampler = GlobalSampler(len(data), cfg.train.global_batch, cfg.train.seed)
    rank_count = cfg.train.global_batch // d.dp * d.tokens_per_sample
    return _Setup(cfg, d, info, model, data, sampler, rank_count)


def _adamw(cfg: Config, params: list[nn.Parameter]) -> torch.optim.AdamW:
    """Our AdamW: decay only on matrices (ndim >= 2), foreach implementation."""
    o = cfg.optim
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.train.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=True,
    )


def _loss_sum(model: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="sum")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        _nbytes([_local(v)]) for state in opt.state.values() for v in state.values() if torch.is_tensor(v)
    )


def _train(
    s: _Setup,
    opt: torch.optim.Optimizer,
    micro_step: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor],
    optimizer_step: Callable[[], None],
) -> tuple[list[float], list[float]]:
    """The loop of `ddp_peer`: lr, micro-batches, step. `micro_step(x, y, i, n)` returns the
    detached rank-normalised loss of micro-batch i of n."""
    losses, times = [], []
    for step in range(s.cfg.train.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.cfg)
        t0 = time.perf_counter()
        micro = split_for_rank(
            s.sampler.global_indices(step), dist.get_rank(), s.d.dp, s.d.micro_batch
        )
        total = torch.zeros(())
        for i, idx in enumerate(micro):
            x, y = (t.to(s.info.device) for t in s.data.get_batch(idx))
            total += micro_step(x, y, i, len(micro)).cpu()
        optimizer_step()
        dev.synchronize(s.info)
        times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(float(total) / s.d.dp)
    return losses, times


# -- FSDP2 ------------------------------------------------------------------------------------
def _fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """Each block of a repeated container (as our ZeRO units), then the root."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList) or (
            name.startswith("layer") and isinstance(child, nn.Sequential)
        ):
            out += list(child)
    return [*out, model]


def fsdp2_peer(cfg: Config) -> dict:
    """Train `cfg` with torch FSDP2 (`fully_shard` per block, then the root): ZeRO-3's peer.

    fp32 unless `precision.compute` is bf16/fp16, then `MixedPrecisionPolicy` computes in it
    (reducing in `precision.reduce`) over fp32 sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    s = _setup(cfg)
    compute = dev.dtype_of(cfg.precision.compute)
    policy = MixedPrecisionPolicy(
        param_dtype=compute if compute != torch.float32 else None,
        reduce_dtype=dev.dtype_of(cfg.precision.reduce) if compute != torch.float32 else None,
    )
    mesh = init_device_mesh(s.info.type, (dist.get_world_size(),))
    for module in _fsdp2_units(s.model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    model = s.model
    params = list(model.parameters())
    opt = _adamw(cfg, params)
    state: dict[str, int] = {}

    def micro_step(x, y, i, n):
        model.set_requires_gradient_sync(i == n - 1)  # accumulate unsharded until the last
        loss = _loss_sum(model, x, y) / s.rank_count  # FSDP2 averages over ranks, like DDP
        loss.backward()
        return loss.detach()

    def optimizer_step():
        if cfg.optim.grad_clip > 0:
            # Our recipe: the norm of the local shards accumulated in fp64, summed over ranks
            # (Shard(0) pieces are disjoint), then torch's own scaling.
            local = [_local(p.grad) for p in params if p.grad is not None]
            norms = torch._foreach_norm(local, 2.0, dtype=torch.float64)
            norm_sq = torch.stack(norms).square().sum()
            dist.all_reduce(norm_sq)
            torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, norm_sq.sqrt())
        opt.step()
        if not state:
            state.update(
                params=_nbytes(_local(p) for p in params),
                grads=_nbytes(_local(p.grad) for p in params if p.grad is not None),
                master=0,  # the sharded parameters are fp32: they are the masters
                optimizer=_optimizer_state_bytes(opt),
            )
        opt.zero_grad(set_to_none=True)

    losses, times = _train(s, opt, micro_step, optimizer_step)
    full = {n: _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "params": full, "step_times": times, "state_bytes": state}


def _full(p: torch.Tensor) -> torch.Tensor:
    t = p.full_tensor() if hasattr(p, "full_tensor") else p
    return t.detach().float().cpu().clone()


# -- DeepSpeed --------------------------------------------------------------------------------
def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def _deepspeed_env() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cache = os.environ.get("SHARDWISE_CACHE", os.path.expanduser("~/.cache/shardwise"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(cache, "torch_extensions"))


def deepspeed_config(cfg: Config, d: Derived) -> dict:
    """DeepSpeed's config for our run: its defaults except what must match ours."""
    zero: dict = {"stage": cfg.parallel.zero}
    if cfg.parallel.zero == 3:
        # Shard every parameter (its default keeps those < 1e5 elements whole on every rank),
        # so the model states are ZeRO-3's 16Ψ/N like ours and FSDP2's.
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_batch_size": cfg.train.global_batch,
        "train_micro_batch_size_per_gpu": d.micro_batch,
        "gradient_accumulation_steps": d.micro_batches,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW as the client optimizer
        "bf16": {"enabled": cfg.precision.compute == "bf16"},
        "fp16": {"enabled": cfg.precision.compute == "fp16"},
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
    }


def deepspeed_peer(cfg: Config) -> dict:
    """Train `cfg` with DeepSpeed ZeRO stage `parallel.zero` (1-3) and its own clipping."""
    return _deepspeed_run(cfg)


def _deepspeed_run(cfg: Config) -> dict:
    _deepspeed_env()
    t0 = time.perf_counter()
    import deepspeed

    import_s = time.perf_counter() - t0
    if cfg.parallel.zero not in (1, 2, 3):
        raise ValueError(f"deepspeed_peer needs parallel.zero in 1..3, got {cfg.parallel.zero}")
    s = _setup(cfg)
    client = _adamw(cfg, list(s.model.parameters()))
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(
        model=s.model,
        optimizer=client,
        config=deepspeed_config(cfg, s.d),
        dist_init_required=False,
    )
    init_s = time.perf_counter() - t0
    state: dict[str, int] = {}

    def micro_step(x, y, i, n):
        # DeepSpeed divides by gradient_accumulation_steps and averages over ranks itself
        loss = _loss_sum(engine, x, y) / (s.rank_count // n)
        engine.backward(loss)
        if i == n - 1 and not state:
            state.update(_deepspeed_state_bytes(engine, client))
        engine.step()
        return loss.detach() / n

    # engine.step() after every backward: it counts micro-batches and steps on the last
    losses, times = _train(s, client, micro_step, lambda: None)
    full = _deepspeed_full_params(engine, cfg.parallel.zero)
    return {
        "losses": losses,
        "params": full,
        "step_times": times,
        "state_bytes": state,
        "import_s": import_s,
        "init_s": init_s,
    }


def _deepspeed_full_params(engine, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    module = engine.module
    ctx = (
        deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        if stage == 3
        else contextlib.nullcontext()
    )
    with ctx:
        return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


def _deepspeed_state_bytes(engine, client: torch.optim.Optimizer) -> dict[str, int]:
    return {}


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield
