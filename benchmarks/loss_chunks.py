"""The chunked head + loss (`train.loss_chunks`) vs PyTorch's full-logits loss, side by side.

One process, the output head and cross-entropy alone on hidden states [tokens, dim]: ours
(models/chunked_loss.py, the gradients made chunk by chunk in forward) against the plain peer
`F.cross_entropy((h @ W.T).float(), targets, reduction="sum")` with autograd. Saved bytes are
counted by the engine's saved-tensor accounting (training/memory.ActivationMeter, W a
parameter), and the peak of forward + backward as the bytes of the tensors they make alive at
once (counted at the dispatcher by tests/support/livepeak.py, any device; h, W and the
targets not included). Step time (forward + backward) is the median
of alternating rounds (peer, ours, ours, peer, ...); the loss and both gradients are compared.

    .venv/bin/python benchmarks/loss_chunks.py [--tokens 4096] [--vocab 32768] [--dim 256]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch import nn

from common import add_smoke, mb, median, preamble, table
from shardwise.models.chunked_loss import chunked_loss_sum
from shardwise.training.memory import ActivationMeter
from support.livepeak import LivePeak


def _step(ours: int, h, head: nn.Linear, targets, measure: bool) -> tuple[float, int, int, tuple]:
    """(seconds, saved bytes, peak bytes of the tensors made, (loss, grad h, grad W)) of one
    forward + backward; bytes only when `measure` (the counting slows the step)."""
    w = head.weight
    h.grad = w.grad = None
    meter = ActivationMeter(head)  # W is a parameter: not an activation
    live = LivePeak() if measure else contextlib.nullcontext()
    sync(h.device)
    t0 = time.perf_counter()
    with live, meter.measure():
        if ours:
            loss = chunked_loss_sum(h, w, targets, ours)
        else:
            loss = F.cross_entropy((h @ w.T).float(), targets, reduction="sum")
    with live:
        (loss / targets.numel()).backward()
    sync(h.device)
    seconds = time.perf_counter() - t0
    peak = live.peak if measure else 0
    return seconds, meter.take_peak(), peak, (loss.detach(), h.grad, w.grad)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="micro-batch × sequence")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_smoke(ap)
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.vocab, args.dim, args.chunks, args.rounds = 256, 1024, 32, [4], 1
    preamble()
    device = torch.device(args.device)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.dim, generator=g).to(device, dtype).requires_grad_(True)
    head = nn.Linear(args.dim, args.vocab, bias=False).to(device, dtype)
    with torch.no_grad():
        head.weight.copy_(0.02 * torch.randn(args.vocab, args.dim, generator=g))
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    targets[: args.tokens // 4] = -100  # a prompt mask: no loss, no gradient
    sides = [0, *args.chunks]
    times: dict[int, list[float]] = {s: [] for s in sides}
    saved, peak, out = {}, {}, {}
    for r in range(args.rounds + 1):  # round 0 warms up
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            if r == 0:  # warm-up, and the bytes
                _, saved[side], peak[side], out[side] = _step(side, h, head, targets, True)
            else:
                times[side].append(_step(side, h, head, targets, False)[0])
    ref = out[0]
    print(
        f"\nhead + loss on {args.tokens} tokens, dim {args.dim}, vocab {args.vocab}, "
        f"{args.dtype}, {device.type}; {args.rounds} alternating rounds"
    )
    rows = []
    for side in sides:
        loss, gh, gw = out[side]
        diff = max(
            (loss - ref[0]).abs().item() / args.tokens,
            (gh - ref[1]).abs().max().item(),
            (gw - ref[2]).abs().max().item(),
        )
        rows.append(
            [
                "PyTorch full logits" if side == 0 else f"ours, {side} chunks",
                mb(saved[side]),
                f"{saved[side] / saved[0]:.3f}",
                mb(peak[side]),
                f"{peak[side] / peak[0]:.3f}",
                f"{1000 * median(times[side]):.1f}",
                f"{median(times[side]) / median(times[0]):.2f}",
                f"{diff:.1e}",
            ]
        )
    header = ["loss", "saved MB", "vs peer", "peak MB", "vs peer", "step ms", "vs peer"]
    print(table([*header, "max diff"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
