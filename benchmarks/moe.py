"""The MoE decoder: grouped expert GEMM vs per-expert loops, and bias balancing from a skew.

1. Expert paths, side by side in one process (one intra-op thread, as a rank runs): a
   training step (forward, cross-entropy, backward, AdamW) of the same model, `tiny` with
   its MLPs as 8 experts, top-2, at seq 256, on copies of the same initial weights and the
   same batches. Sides: shardwise's `torch._grouped_mm` path and its per-expert loop (the
   probe's cached answer in models/moe.py set for the step, product code unchanged), and
   transformers' `MixtralExperts` on the same weights copied into its layout ([gate; up]
   stacked), routed by our router: its eager per-expert loop and its `grouped_mm` kernel.
   Rounds alternate (A B C D, D C B A, ...); per side the median step over every round and
   the median of the per-round ratios to our grouped path. The logits, loss and every
   gradient of the first batch are compared (fp32 rounding: ~1e-6), and the losses of every
   step after it.
2. Bias balancing (DeepSeek-V3's auxiliary-loss-free bias, `train.moe_bias_balance`): the
   `moe-tiny` model (4 experts, top-2) trained through the engine (the harness, one process
   per run, two runs side by side) from a skewed start (expert 0's routing bias at 0.2: every
   token chooses it, max/mean load 2.0) for 200 steps, balancing off and at several rates.
   Per run: each layer's max/mean expert load (metrics.jsonl `moe_load_max_mean`) at steps 1,
   50, 100, 150, 200, the first step at which every layer is below 1.2, and the worst layer's
   median and maximum over the last 50 steps, and each layer's expert-0 bias minus the
   others' mean at the end (from +0.2 at the start: how far the bias had to travel, i.e. the
   skew plus the preference for expert 0 its router learned while it took every token).

    .venv/bin/python benchmarks/moe.py [--experts 8] [--batch 8] [--seq-len 256] [--rounds 6]
        [--steps 5] [--balance-steps 200] [--rates 0,0.001,0.003,0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from common import add_smoke, median, preamble, table
from shardwise.config import load_config
from shardwise.launchers.harness import run_here, run_side_by_side
from shardwise.models import build_model, init_weights
from shardwise.models import moe as moe_module
from shardwise.models.moe import MoE, moe_layers
from shardwise.models.spec import spec_from_config

SKEW = 0.2  # expert 0's starting bias: above any gap of softmax scores at init (tests/test_moe)
THRESHOLD = 1.2
AT_STEPS = [1, 50, 100, 150, 200]
WARMUP = 2  # untimed steps per side before the rounds: allocator growth, first-call costs


def skew_router(run) -> None:
    """The harness hook of the skewed start: expert 0's bias makes every token choose it
    (the biases are returned: how far they moved says what the router learned meanwhile)."""
    for layer in moe_layers(run.model):
        layer.expert_bias[0] = SKEW
    run.return_buffers = True


class TransformersExperts(nn.Module):
    """An MoE layer whose experts are transformers' `MixtralExperts` (`implementation`:
    "eager", its per-expert loop, or "grouped_mm"), holding `layer`'s expert weights in its
    own layout; the choice and weights come from `layer`'s router (`MoE.route`), so the
    routing is ours exactly (Mixtral's router renormalises its top-k; ours does not)."""

    def __init__(self, layer: MoE, implementation: str) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        e, d, f = layer.w1.shape
        config = MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e)
        config._experts_implementation = implementation
        self.experts = MixtralExperts(config)
        with torch.no_grad():  # [E, 2·ffn, dim] = [gate; up], as transformers' loader merges
            self.experts.gate_up_proj.copy_(torch.cat([layer.w1, layer.w3], -1).transpose(1, 2))
            self.experts.down_proj.copy_(layer.w2.transpose(1, 2))
        self.layer = layer
        for name in ("w1", "w2", "w3"):  # the router and its bias stay; the experts move here
            delattr(layer, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        _, chosen, weights = self.layer.route(flat)
        return self.experts(flat, chosen, weights.to(flat.dtype)).view(b, s, d)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under our names and layout (transformers' experts mapped
    back: gate_up_proj -> w1, w3; down_proj -> w2)."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace(".layer.", ".")
        if name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("experts.gate_up_proj")
            gate, up = p.grad.transpose(1, 2).chunk(2, dim=-1)
            out[prefix + "w1"], out[prefix + "w3"] = gate, up
        elif name.endswith("experts.down_proj"):
            out[name.removesuffix("experts.down_proj") + "w2"] = p.grad.transpose(1, 2)
        else:
            out[name] = p.grad
    return out


@contextlib.contextmanager
def grouped(on: bool | None):
    """models/moe.py's probe answers `on` for CPU fp32 inside (None: leave it as it is)."""
    key = (torch.device("cpu").type, torch.float32)
    moe_module.grouped_mm_runs(torch.device("cpu"), torch.float32)  # probe once, then patch
    probed = moe_module._GROUPED[key]
    if on is not None:
        moe_module._GROUPED[key] = on
    try:
        yield
    finally:
        moe_module._GROUPED[key] = probed


def _sides(spec, seed: int) -> dict[str, tuple[nn.Module, bool | None]]:
    """The sides: (model, the probe's answer while it steps)."""
    base = build_model(spec)
    init_weights(base, seed)
    out = {
        "ours, grouped GEMM": (base, True),
        "ours, per-expert loop": (copy.deepcopy(base), False),
    }
    if not moe_module.grouped_mm_runs(torch.device("cpu"), torch.float32):
        raise SystemExit("torch._grouped_mm does not run here: nothing to compare")
    for label, impl in (
        ("transformers, per-expert loop", "eager"),
        ("transformers, grouped_mm", "grouped_mm"),
    ):
        model = copy.deepcopy(base)
        for block in model.blocks:
            if isinstance(block.mlp, MoE):
                block.mlp = TransformersExperts(block.mlp, impl)
        out[label] = (model, None)
    return out


def _batch(i: int, b: int, s: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    tokens = torch.randint(vocab, (b, s + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()), logits


def _step(model: nn.Module, opt, batch, on: bool | None) -> tuple[float, float]:
    """(seconds, loss) of one training step."""
    with grouped(on):
        t0 = time.perf_counter()
        loss, _ = _loss(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item()


def expert_paths(args) -> None:
    """Part 1: step time of the four expert paths, and their agreement."""
    cfg = load_config(
        None,
        ["--model.name=tiny", f"--model.n_experts={args.experts}", f"--model.top_k={args.top_k}"],
    )
    spec = spec_from_config(cfg)
    sides = _sides(spec, seed=0)
    names = list(sides)
    # agreement on the first batch, before any step
    batch0 = _batch(0, args.batch, args.seq_len, spec.vocab_size)
    logits, losses, grads = {}, {}, {}
    for name, (model, on) in sides.items():
        with grouped(on):
            loss, out = _loss(model, *batch0)
            loss.backward()
        logits[name], losses[name], grads[name] = out.detach(), loss.item(), _grads(model)
        model.zero_grad(set_to_none=True)
    ref = names[0]
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, (m, _) in sides.items()}
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    step_losses: dict[str, list[float]] = {n: [] for n in names}
    batches = [_batch(i, args.batch, args.seq_len, spec.vocab_size) for i in range(64)]
    for name in names:  # warm-up: every side steps on the same batches first
        for i in range(WARMUP):
            step_losses[name].append(
                _step(sides[name][0], opts[name], batches[i], sides[name][1])[1]
            )
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            model, on = sides[name]
            round_times = []
            for i in range(args.steps):
                k = (WARMUP + r * args.steps + i) % len(batches)
                seconds, loss = _step(model, opts[name], batches[k], on)
                round_times.append(seconds)
                step_losses[name].append(loss)
            times[name].append(round_times)
    med = {n: median([t for rt in times[n] for t in rt]) for n in names}
    rows = []
    for name in names:
        ratios = [median(a) / median(b) for a, b in zip(times[name], times[ref], strict=True)]
        dlogit = (logits[name] - logits[ref]).abs().max().item()
        dgrad = max((grads[name][k] - g).abs().max().item() for k, g in grads[ref].items())
        dloss = max(
            abs(a - b) / abs(b) for a, b in zip(step_losses[name], step_losses[ref], strict=True)
        )
        rows.append(
            [
                name,
                f"{med[name] * 1000:.1f}",
                f"{median(ratios):.3f}",
                f"{min(ratios):.3f}-{max(ratios):.3f}",
                f"{dlogit:.1e}",
                f"{dgrad:.1e}",
                f"{dloss:.1e}",
            ]
        )
    tokens = args.batch * args.seq_len
    print(
        f"\n1. expert paths: tiny with {args.experts} experts of {spec.ffn_dim}, top-{args.top_k}, "
        f"batch {args.batch} × seq {args.seq_len} ({tokens} tokens), fp32, 1 thread; "
        f"{args.rounds} alternating rounds of {args.steps} steps per side after {WARMUP} warm-up"
    )
    header = ["expert path", "median step ms", "vs grouped", "per round", "max |Δlogit|"]
    print(table([*header, "max |Δgrad|", "max rel Δloss"], rows))


def balance_cases(args) -> list[list[dict]]:
    """Part 2's runs, dealt to two groups that run side by side."""
    base = [
        "--model.name=moe-tiny",
        f"--train.steps={args.balance_steps}",
        "--train.eval_every=0",
        "--train.eval_batches=0",
        *args.balance_extra,
    ]
    cases = [
        {"overrides": [*base, f"--train.moe_bias_balance={rate}"], "hook": "moe:skew_router"}
        for rate in args.rates
    ]
    return [cases[0::2], cases[1::2]]


def balancing(args) -> None:
    """Part 2: max/mean expert load from a skewed start, balancing off and on."""
    groups = balance_cases(args)
    if args.smoke:  # one case in this process: a spawned world costs seconds of imports
        groups = [groups[0][:1]]
        with tempfile.TemporaryDirectory() as tmp:
            results = [[[run_here(groups[0][0], tmp)]]]
    else:
        results = run_side_by_side(groups)
    by_rate = {}
    for group, out in zip(groups, results, strict=True):
        for case, per_rank in zip(group, out, strict=True):
            if "error" in per_rank[0]:
                raise SystemExit(per_rank[0]["error"])
            rate = case["overrides"][-1].split("=")[1]
            loads = [r["moe_load_max_mean"] for r in per_rank[0]["records"]]
            biases = [b for n, b in per_rank[0]["buffers"].items() if n.endswith("expert_bias")]
            by_rate[rate] = loads, [float(b[0] - b[1:].mean()) for b in biases]
    steps = [s for s in AT_STEPS if s <= args.balance_steps] or [args.balance_steps]
    rows = []
    for rate in (str(r) for r in args.rates if str(r) in by_rate):
        loads, gaps = by_rate[rate]
        worst = [max(per_layer) for per_layer in loads]
        first = next((i + 1 for i, w in enumerate(worst) if w < THRESHOLD), None)
        tail = worst[-50:]
        rows.append(
            [
                "off" if float(rate) == 0 else rate,
                *(" / ".join(f"{v:.2f}" for v in loads[s - 1]) for s in steps),
                str(first) if first else f"not in {len(loads)}",
                f"{median(tail):.3f}",
                f"{max(tail):.3f}",
                " / ".join(f"{g:+.2f}" for g in gaps),
            ]
        )
    print(
        f"\n2. bias balancing: moe-tiny (4 experts, top-2, 4 MoE layers), global batch 16 × seq "
        f"128, expert 0's bias at {SKEW} at the start; max/mean load per layer (blocks 0-3)"
    )
    header = ["bias rate", *(f"step {s}" for s in steps), f"first all < {THRESHOLD}"]
    extra = ["last 50: median of worst", "max of worst", "bias 0 − others' mean at the end"]
    print(table([*header, *extra], rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side and round")
    ap.add_argument("--balance-steps", type=int, default=200)
    ap.add_argument("--rates", default="0,0.001,0.003,0.01", help="0: balancing off")
    add_smoke(ap)
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.balance_extra = []
    if args.smoke:
        args.batch, args.seq_len, args.rounds, args.steps = 1, 32, 1, 1
        args.balance_steps, args.rates = 2, [0.01]
        args.balance_extra = ["--train.global_batch=2", "--data.seq_len=32"]
    preamble()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expert_paths(args)
    finally:
        torch.set_num_threads(threads)
    balancing(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
