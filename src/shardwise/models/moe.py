"""Mixture-of-experts feed-forward layer for the built-in decoder; nothing here knows about ranks.

A router scores every token against `n_experts` SwiGLU experts (Shazeer et al. 2017, "Outrageously
Large Neural Networks"); each token goes to its top-k (token choice) and the outputs are summed,
weighted by the router scores, plus optional always-on shared experts (DeepSeekMoE, Dai et al.
2024). The experts' weights are stacked parameters [n_experts, ...], so ZeRO flattens them like
any other and a checkpoint names them `blocks.N.mlp.w1` etc.

Load balancing (training/moe.py reduces the statistics kept here over the global batch):
* the auxiliary loss n_experts · Σ_i f_i · P_i (Fedus et al. 2021, "Switch Transformers", eq. 4),
  taken per sequence: the product of two batch means is no sum over tokens, so over a
  micro-batch it would depend on how the batch is split; per sequence (DeepSeek-V3 2024, §2.1.2,
  eq. 17-20, the sequence-wise balance loss) every layout computes the same terms;
* DeepSeek-V3's auxiliary-loss-free bias (§2.1.2, eq. 16): a per-expert buffer added to the
  scores for the top-k choice only, moved after each step towards the mean load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from shardwise.models.decoder import MLP, Decoder, SwiGLUAct
from shardwise.models.expert_lora import adapter_delta
from shardwise.models.presets import ModelSpec

BASE_STD = 0.02  # as models/init.py: the stacked expert weights draw like nn.Linear ones

# torch._grouped_mm (one kernel over all experts' uneven token groups) where it runs, probed
# once per (device type, dtype) on a 2-expert product with an empty group, forward and backward.
# Measured with torch 2.13: CPU fp32 and bf16 run it (equal to the loop to 1e-6 in fp32). On
# CUDA torch's kernel is built for bf16 on Hopper (sm90) and newer: the probe decides there.
# Elsewhere, and for fp32 on meta/fake tensors (the meta kernel takes bf16 only), a loop over
# experts, one matmul each.
_GROUPED: dict[tuple[str, torch.dtype], bool] = {}


def _has_data(t: torch.Tensor) -> bool:
    """False for meta and fake tensors (the planner's models): no values, no host counts."""
    from torch._subclasses.fake_tensor import is_fake

    return not (t.is_meta or is_fake(t))


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        a = torch.ones(2, 8, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([0, 2], device=device, dtype=torch.int32)  # group 0 empty
        torch._grouped_mm(a, b, offs=offs).backward(torch.ones(2, 8, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, values: bool = True) -> bool:
    """Whether `torch._grouped_mm` computes forward and backward for `dtype` on `device`;
    `values` False: for tensors without values (meta, fake), whose kernel takes bf16 only."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "meta" or not values:  # never probed: a probe would be fake too
        return dtype == torch.bfloat16
    key = (device.type, dtype)
    if key not in _GROUPED:
        # the answer is cached for the process; the probe runs in a thread of its own, so none
        # of the first caller's thread-local state reaches it: no_grad evaluation, a fake
        # planner forward, or a recomputation's saved-tensor hooks (which would count the
        # probe's tensors in a checkpointed forward and not in its replay)
        with ThreadPoolExecutor(1) as pool:
            _GROUPED[key] = pool.submit(_probe_grouped_mm, device, dtype).result()
    return _GROUPED[key]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: _grouped_mm's backward refuses the expanded
    (stride-0) gradient that a `.sum()` downstream hands it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def expert_matmul(
    xs: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None
) -> torch.Tensor:
    """Rows of `xs` [sum(counts), in] grouped by expert (counts [E]) times that expert's `w`
    [E, in, out]. `grouped` forces the kernel (tests); None picks it as above."""
    if grouped is None:
        grouped = grouped_mm_runs(xs.device, xs.dtype, _has_data(xs))
    if grouped:
        offs = counts.cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(xs, w, offs=offs))
    # loop: the counts on the host (one sync); a model without values splits evenly (the
    # planner measures the bytes saved, which do not depend on the split)
    parts = xs.split(counts.tolist()) if _has_data(xs) else xs.tensor_split(w.shape[0])
    return torch.cat([p @ w[e] for e, p in enumerate(parts)])


def _equal_groups(xs: torch.Tensor, w: torch.Tensor, counts: None) -> torch.Tensor:
    """Rows in E equal groups (the capacity layout) times their expert's `w` [E, in, out]:
    one batched matmul."""
    g = xs.view(w.shape[0], -1, xs.shape[-1])
    return torch.bmm(g, w).reshape(-1, w.shape[-1])


class MoE(nn.Module):
    """Token-choice top-k routed SwiGLU experts (+ shared experts): x [B, S, dim] -> [B, S, dim].

    Each forward leaves `last` (detached: per-expert chosen counts [E], dropped assignments,
    the sum of the per-sequence balance losses, sequences) and `aux` (the differentiable balance
    term, to be divided by the global token count). A replayed forward (activation
    recomputation) overwrites both with the same values, so readers take them once per forward.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        e, d, f = spec.n_experts, spec.dim, spec.ffn_dim
        self.n_experts, self.top_k, self.n_layers = e, spec.top_k, spec.n_layers
        self.sigmoid = spec.router == "sigmoid"
        self.capacity_factor = spec.capacity_factor
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, d, f))  # gate, as MLP.w1
        self.w3 = nn.Parameter(torch.empty(e, d, f))  # up, as MLP.w3
        self.w2 = nn.Parameter(torch.empty(e, f, d))  # down, as MLP.w2
        self.act = SwiGLUAct()  # named as the dense MLP's: selective recomputation finds it
        self.shared: nn.Module | None = None
        if spec.n_shared_experts:  # k always-on experts = one SwiGLU k times as wide
            wide = dataclasses.replace(spec, arch="decoder", ffn_dim=f * spec.n_shared_experts)
            self.shared = MLP(wide)
        # the balancing bias: state, not a parameter (no gradient, no optimizer), identical on
        # every rank because training/moe.py moves it by the globally reduced loads
        self.register_buffer("expert_bias", torch.zeros(e))
        self.last: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None
        # expert parallelism (parallel/expert.py) sets a callable that runs the rows on the
        # ranks holding their experts; None: this module holds every expert
        self.exchange: Callable | None = None
        # sequence parallelism (parallel/expert.py) sets an object that returns the counts of
        # the other shards of this layer's sequences (parallel/expert_comm.SequenceShards);
        # None: this module sees whole sequences
        self.shards = None
        # the layer's place among the model's MoE layers (set by MoEDecoder): a pipeline stage
        # holds some of them, and the step's statistics are tabled by it (training/moe.py)
        self.index, self.n_moe_layers = 0, 1

    def init_std(self, leaf: str, spec: ModelSpec) -> float:
        """models/init.py's std for a stacked weight: the down projection scaled like MLP.w2."""
        return BASE_STD / math.sqrt(2 * spec.n_layers) if leaf == "w2" else BASE_STD

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoE:
        # to_empty (meta -> a device) leaves the bias uninitialised; it starts at zero
        was_meta = self.expert_bias.is_meta
        out = super()._apply(fn, recurse)
        if was_meta and not self.expert_bias.is_meta:
            with torch.no_grad():
                self.expert_bias.zero_()
        return out

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [T, E] fp32, chosen experts [T, k], their combine weights [T, k] fp32)."""
        logits = self.router(flat).float()  # routing in fp32: ties and tiny gaps decide top-k
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        # the bias shifts the choice only, never the weights (DeepSeek-V3 eq. 16)
        chosen = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.sigmoid:  # sigmoid gates are normalised over the chosen (DeepSeek-V3 eq. 13)
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        e, k, t = self.n_experts, self.top_k, b * s
        flat = x.reshape(t, d)
        scores, chosen, weights = self.route(flat)
        expert = chosen.reshape(-1)  # assignment a = token * k + j, tokens row-major
        row = torch.arange(t * k, device=x.device) // (s * k)
        ones = torch.ones_like(expert)
        per_row = torch.zeros(b * e, dtype=torch.long, device=x.device)
        per_row = per_row.index_add(0, row * e + expert, ones).view(b, e)  # chosen per sequence
        # a shard of each sequence (sequence parallelism): the whole sequences decide
        total, before, n = per_row, None, 1
        if self.shards is not None:
            (total, before), n = self.shards.counts(per_row), self.shards.n
        self._balance(scores.view(b, s, e), total, s * n)
        if self.capacity_factor > 0 and self.exchange is None:
            y, dropped = self._capacity(flat, expert, row, weights.reshape(-1), b, s * n, before)
        elif self.capacity_factor > 0:  # the same drops, then only the kept rows travel
            keep = self._kept(expert, row, b, s * n, before)
            y, dropped = self._dropless(flat, expert, weights.reshape(-1), keep), (~keep).sum()
        else:
            y, dropped = self._dropless(flat, expert, weights.reshape(-1)), per_row.new_zeros(())
        if self.shared is not None:
            y = y + self.shared(flat)
        load = per_row.sum(0).to(torch.float64)
        # each of the n shards counts 1/n of its sequences: summed over them, each once
        rows = torch.full((), b / n, dtype=torch.float64, device=x.device)
        self.last = torch.cat([load, torch.stack([dropped.to(load.dtype), self._aux_rows, rows])])
        return y.view(b, s, d)

    def _balance(self, scores: torch.Tensor, per_row: torch.Tensor, s: int) -> None:
        """The per-sequence balance loss L = E · Σ_i f_i · P_i, f_i = chosen_i / (k·S), P_i the
        mean routing probability (sigmoid scores normalised per token, DeepSeek-V3 eq. 19).
        `aux` = Σ_seq S·L, a sum over tokens like the LM loss (the loop divides both by the
        global token count); L = 1 when balanced. `per_row`: the whole sequences' counts and
        `s` their length; `scores` may be a shard of them, whose terms sum to the whole's."""
        probs = scores / scores.sum(-1, keepdim=True) if self.sigmoid else scores
        per_seq = (per_row.to(probs.dtype) * probs.sum(1)).sum(-1) * self.n_experts
        per_seq = per_seq / (self.top_k * s)  # = S·L per sequence
        aux = per_seq.sum()
        self._aux_rows = (aux.detach() / s).to(torch.float64)
        self.aux = aux if torch.is_grad_enabled() and self.training else None

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """SwiGLU of every expert on its rows: w2(silu(x w1) * x w3); counts None: E equal
        groups (the capacity layout), one batched matmul each."""
        h = self.act(self._product("w1", xs, counts), self._product("w3", xs, counts))
        return self._product("w2", h, counts)

    def _product(self, leaf: str, xs: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """The rows times their expert's weight `leaf`, plus its LoRA adapter's delta if it has
        one (models/expert_lora.py)."""
        matmul = expert_matmul if counts is not None else _equal_groups
        y = matmul(xs, getattr(self, leaf), counts)
        delta = adapter_delta(self, leaf, xs, counts, matmul)
        return y if delta is None else y + delta

    def _dropless(self, flat, expert, weights, keep: torch.Tensor | None = None):
        """Every assignment (or every kept one) computed: rows sorted by expert (stable:
        token order within one)."""
        if keep is None:
            order = torch.argsort(expert, stable=True)
        else:
            kept = keep.nonzero().squeeze(1)
            order = kept[torch.argsort(expert[kept], stable=True)]
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=flat.device)
        counts = counts.index_add(0, expert[order], torch.ones_like(order))
        token = order // self.top_k
        if self.exchange is None:
            y = self._experts(flat[token], counts)
        else:
            y = self.exchange(flat[token], counts, self._experts)
        y = y * weights[order, None].to(flat.dtype)
        return torch.zeros_like(flat).index_add(0, token, y)

    def _kept(self, expert, row, b: int, s: int, before=None) -> torch.Tensor:
        """Per assignment, whether `_capacity`'s rule keeps it (the same rule, on its own)."""
        e, k = self.n_experts, self.top_k
        c = math.ceil(self.capacity_factor * s * k / e)
        key = expert * b + row
        order = torch.argsort(key, stable=True)
        sizes = torch.zeros(e * b, dtype=torch.long, device=expert.device)
        sizes = sizes.index_add(0, key, torch.ones_like(key))
        start = sizes.cumsum(0) - sizes
        pos = torch.arange(key.numel(), device=expert.device) - start[key[order]]
        if before is not None:  # positions after the earlier shards' tokens
            pos = pos + before.t().reshape(-1)[key[order]]
        return torch.zeros_like(key, dtype=torch.bool).scatter(0, order, pos < c)

    def _capacity(self, flat, expert, row, weights, b: int, s: int, before=None):
        """Capacity C = ceil(capacity_factor · S · k / E) slots per expert and sequence (GShard,
        Lepikhin et al. 2020; Switch eq. 3, taken per sequence so no layout changes who is
        dropped). Rule: within a sequence, an expert takes the tokens that chose it in position
        order; from the (C+1)-th on they are dropped (their weight lost, the residual carries
        them). Slots are laid out [E, B, C] (equal groups: a batched matmul). `before` [B, E]: the
        assignments of each (sequence, expert) in the earlier shards of a split sequence."""
        e, k, t = self.n_experts, self.top_k, flat.shape[0]
        c = math.ceil(self.capacity_factor * s * k / e)
        key = expert * b + row  # one group per (expert, sequence), expert-major
        order = torch.argsort(key, stable=True)
        sizes = torch.zeros(e * b, dtype=torch.long, device=flat.device)
        sizes = sizes.index_add(0, key, torch.ones_like(key))
        start = sizes.cumsum(0) - sizes
        pos = torch.arange(t * k, device=flat.device) - start[key[order]]
        if before is not None:  # positions after the earlier shards' tokens
            pos = pos + before.t().reshape(-1)[key[order]]
        kept = pos < c
        slot = torch.where(kept, key[order] * c + pos, e * b * c)  # dropped: a scratch slot
        src = torch.full((e * b * c + 1,), t * k, dtype=torch.long, device=flat.device)
        src = src.scatter(0, slot, order)[:-1]  # the assignment in each slot; t*k: empty
        token = src // k  # t: an empty slot reads the zero row below
        pad = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
        w = torch.cat([weights, weights.new_zeros(1)])[src].to(flat.dtype)
        y = self._experts(pad[token], None) * w[:, None]
        out = torch.zeros_like(pad).index_add(0, token, y)[:t]
        return out, (~kept).sum()


class MoEDecoder(Decoder):
    """The built-in Llama-style decoder with every `moe_every`-th block's MLP an `MoE`
    (blocks moe_every-1, 2·moe_every-1, ...: with 1, all of them)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(dataclasses.replace(spec, arch="decoder"))
        self.spec = spec
        moe = [self.blocks[i] for i in moe_blocks(spec)]
        for j, block in enumerate(moe):
            block.mlp = MoE(spec)
            block.mlp.index, block.mlp.n_moe_layers = j, len(moe)


def is_moe_block(spec: ModelSpec, i: int) -> bool:
    """Whether block `i` of `spec`'s decoder has an MoE MLP: with routed experts, every
    moe_every-th block (blocks moe_every-1, 2·moe_every-1, ...)."""
    return bool(spec.n_experts) and (i + 1) % spec.moe_every == 0


def moe_blocks(spec: ModelSpec) -> list[int]:
    """The blocks of `MoEDecoder(spec)` whose MLP is an `MoE` (`is_moe_block`)."""
    return [i for i in range(spec.n_layers) if is_moe_block(spec, i)]


def moe_layer_count(spec: ModelSpec) -> int:
    """MoE layers of the whole `MoEDecoder` of `spec` (a pipeline stage holds some)."""
    return len(moe_blocks(spec))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers in forward order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def inactive_params(model: nn.Module) -> int:
    """Expert parameters a token does not use: (E - k)/E of every layer's routed experts (6N
    FLOPs per token counts the active ones only)."""
    return sum(
        (m.n_experts - m.top_k) * 3 * m.w1.shape[1] * m.w1.shape[2] for m in moe_layers(model)
    )
