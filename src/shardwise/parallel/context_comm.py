"""Exact context-parallel attention over the `cp` dimension of a Comm: ring attention and
Ulysses, as autograd Functions.

Context parallelism splits one sample's sequence over cp ranks. Under a causal mask the work
of a query grows with its position, so the sequence is cut into 2·cp chunks and rank i holds
chunks i and 2·cp−1−i (the zig-zag layout of Brandon et al. 2023, "Striped Attention", as
Megatron-Core and torchtitan use it): every rank then holds as many (query, visible key)
pairs as any other.

* Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the K/V
  blocks travel the cp ring; each rank attends its queries to every block in turn and merges
  the partial outputs by their log-sum-exp (the online softmax of Milakov & Gimelshein 2018
  and FlashAttention). Each block's transfer starts before the block in hand is computed,
  so it hides behind the compute. Backward recomputes each block's probabilities from the
  merged log-sum-exp and sends each block's dK/dV home to the rank that owns it.
* Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses", §3): an all-to-all turns the
  sequence-sharded q/k/v into head-sharded ones over the whole sequence, attention runs
  locally, and a second all-to-all turns the output back; cp must divide the heads.

Both are exact: causal attention on the gathered sequence, up to fp32 rounding. Blocks are
computed in fp32 whatever the input dtype; outputs and gradients come back in the input's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd import Function

from shardwise.distributed.comm import Comm

CP = "cp"


def zigzag_positions(seq_len: int, cp: int, index: int, device=None) -> torch.Tensor:
    """Global positions [seq_len // cp] (int64) of the tokens cp rank `index` holds: chunks
    `index` and 2·cp−1−index of the sequence cut into 2·cp equal chunks."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} must be divisible by 2 * cp = 2 * {cp} = {2 * cp}: the "
            "zig-zag layout cuts the sequence into 2 * cp equal chunks"
        )
    if not 0 <= index < cp:
        raise ValueError(f"cp index {index} is outside 0..{cp - 1} (cp = {cp})")
    chunk = seq_len // (2 * cp)
    mirror = 2 * cp - 1 - index
    return torch.cat(
        [
            torch.arange(index * chunk, (index + 1) * chunk, device=device),
            torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device),
        ]
    )


def _peer(comm: Comm, step: int) -> int:
    """Global rank of the cp rank `step` places further along the ring (negative: behind);
    cp ranks are consecutive coordinates of a dp line, tp ranks apart."""
    topo = comm.topo
    n, r = topo.size(CP), topo.coord(CP)
    return topo.rank + ((r + step) % n - r) * topo.tp


def _all_positions(positions: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[cp, S_local]: every cp rank's positions, in rank order (one small gather per call)."""
    n = comm.topo.size(CP)
    part = positions.to(torch.int64).contiguous()
    full = part.new_empty(n * part.numel())
    comm.all_gather(full, part, CP)
    return full.view(n, -1)


@dataclass(frozen=True)
class _Block:
    """What of one K/V block the local queries see: the rows (queries) that see some key of
    it and the columns (keys) that some query sees. A contiguous run is a slice (a view, no
    gather): with the zig-zag layout an off-diagonal block is half of one side."""

    rows: slice | torch.Tensor
    cols: slice | torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor

    def future(self) -> torch.Tensor:
        """[rows, cols] True where the key lies in the query's future (masked)."""
        return self.k_pos[None, :] > self.q_pos[:, None]


def _index(mask: torch.Tensor, device) -> slice | torch.Tensor:
    """`mask`'s True entries: a slice when they form one run, else indices on `device`."""
    idx = mask.nonzero().squeeze(1)
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    return slice(lo, hi) if hi - lo == idx.numel() else idx.to(device)


def _blocks(pos: torch.Tensor, r: int, device) -> list[_Block | None]:
    """Per source cp rank, the part of its K/V block rank r's queries see; None where every
    key lies in every query's future (the pair is skipped). `pos` [cp, S_local] on the CPU:
    the plan costs one device sync per call, not one per block."""
    q_pos, plan = pos[r], []
    for k_pos in pos:
        rows = q_pos >= k_pos.min()
        if not rows.any():
            plan.append(None)
            continue
        ri, ci = _index(rows, device), _index(k_pos <= q_pos.max(), device)
        plan.append(_Block(ri, ci, q_pos[ri].to(device), k_pos[ci].to(device)))
    return plan


def _shift(t: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, list]:
    """Send `t` to the next cp rank and receive the previous one's: (its buffer, waitables)."""
    nxt = torch.empty_like(t)
    return nxt, comm.p2p([(t, _peer(comm, 1))], [(nxt, _peer(comm, -1))], dim=CP)


def _landed(transfer: tuple[torch.Tensor | None, list]) -> torch.Tensor | None:
    buf, works = transfer
    for work in works:
        work.wait()
    return buf


def _collect(transfer: tuple[torch.Tensor | None, list], into: torch.Tensor) -> None:
    """Wait for a dK/dV transfer and add what it brought (if anything) into `into`."""
    buf = _landed(transfer)
    if buf is not None:
        into += buf


def _block_forward(q, kv, blk: _Block, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the seeing queries over the seen keys of one block, fp32: (out, lse)."""
    qs = q[:, :, blk.rows].float()
    ks, vs = kv[:, :, :, blk.cols].float()
    s = (qs @ ks.transpose(-1, -2)) * scale
    s = s.masked_fill(blk.future(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # finite: every row sees at least one key
    return torch.exp(s - lse[..., None]) @ vs, lse


def _merge(out, lse, blk: _Block, b_out, b_lse) -> None:
    """Fold a block's partial softmax into the running one (in place): both are normalised
    over their own keys, so each is weighted by its share exp(lse_part - lse_total)."""
    old_out, old_lse = out[:, :, blk.rows], lse[:, :, blk.rows]
    new_lse = torch.logaddexp(old_lse, b_lse)
    out[:, :, blk.rows] = (
        old_out * torch.exp(old_lse - new_lse)[..., None]
        + b_out * torch.exp(b_lse - new_lse)[..., None]
    )
    lse[:, :, blk.rows] = new_lse


def _block_backward(q, kv, do, lse, delta, blk: _Block, scale: float, dq) -> torch.Tensor:
    """Add one block pair's dQ into `dq` and return its dK/dV [2, B, H, S, D] (fp32). The
    probabilities are recomputed from the merged log-sum-exp, so no S×S tensor outlives
    the forward; dS = P ∘ (dP − D) (Dao 2023, FlashAttention-2, alg. 2)."""
    qs = q[:, :, blk.rows].float()
    ks, vs = kv[:, :, :, blk.cols].float()
    s = (qs @ ks.transpose(-1, -2)) * scale
    p = torch.exp(s.masked_fill(blk.future(), float("-inf")) - lse[:, :, blk.rows, None])
    dos = do[:, :, blk.rows]
    ds = p * (dos @ vs.transpose(-1, -2) - delta[:, :, blk.rows, None])
    dq[:, :, blk.rows] += ds @ ks * scale
    grad = kv.new_zeros(kv.shape, dtype=torch.float32)
    grad[0][:, :, blk.cols] = ds.transpose(-1, -2) @ qs * scale
    grad[1][:, :, blk.cols] = p.transpose(-1, -2) @ dos
    return grad


def _send_home(grad, step: int, incoming: bool, like: torch.Tensor, comm: Comm) -> tuple:
    """Send a block's dK/dV (None: the pair was skipped) to the rank `step` behind, which
    owns the block, and receive ours from the rank `step` ahead when its queries saw our
    keys. Sent in fp32: the owner sums cp contributions before its single rounding."""
    sends = [] if grad is None else [(grad, _peer(comm, -step))]
    buf = torch.empty_like(like) if incoming else None
    recvs = [] if buf is None else [(buf, _peer(comm, step))]
    return buf, comm.p2p(sends, recvs, dim=CP)


class _Ring(Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, comm: Comm):
        n, r = comm.topo.size(CP), comm.topo.coord(CP)
        pos = _all_positions(positions, comm).cpu()
        blocks = _blocks(pos, r, q.device)
        scale = q.shape[-1] ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack([k, v])  # one transfer per step instead of two
        for step in range(n):
            # the next block leaves before this one is computed: the transfer hides behind
            # the compute (Liu et al. 2023, §3)
            ring = _shift(kv, comm) if step < n - 1 else None
            blk = blocks[(r - step) % n]
            if blk is not None:  # None: every key in every query's future, nothing to add
                _merge(out, lse, blk, *_block_forward(q, kv, blk, scale))
            if ring is not None:
                kv = _landed(ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.blocks, ctx.scale = comm, blocks, scale
        # sees[a][b]: rank a's queries see some key of rank b (who sends dK/dV home to whom)
        first, last = pos.min(1).values, pos.max(1).values
        ctx.sees = (last[:, None] >= first[None, :]).tolist()
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, blocks = ctx.comm, ctx.blocks
        n, r = comm.topo.size(CP), comm.topo.coord(CP)
        do = dout.float()
        delta = (do * out).sum(-1)  # D_i = Σ_d dO_id·O_id, the softmax backward's row term
        dq = torch.zeros_like(out)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        kv, home = torch.stack([k, v]), (None, [])
        for step in range(n):
            ring = _shift(kv, comm) if step < n - 1 else None
            blk = blocks[(r - step) % n]
            grad = None
            if blk is not None:
                grad = _block_backward(q, kv, do, lse, delta, blk, ctx.scale, dq)
            _collect(home, dkv)  # the previous block's first: one in flight bounds memory
            if step > 0:
                home = _send_home(grad, step, ctx.sees[(r + step) % n][r], dkv, comm)
            elif grad is not None:  # our own block: already home
                dkv += grad
            if ring is not None:
                kv = _landed(ring)
        _collect(home, dkv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, positions, comm: Comm) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys/values.

    q, k, v [B, H, S_local, D] (k/v heads already repeated to H); `positions` [S_local] the
    global positions of the local tokens (`zigzag_positions`): key j is visible to query i
    iff positions_k[j] <= positions_q[i]. Returns [B, H, S_local, D], scale 1/sqrt(D)."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)} (repeat k/v heads to q's first)"
        )
    return _Ring.apply(q, k, v, positions, comm)


def _exchange(x: torch.Tensor, comm: Comm, scatter: int, gather: int) -> torch.Tensor:
    """Cut `x` into cp slices along `scatter`, send slice j to cp rank j, and concatenate
    the slices received (in rank order) along `gather`."""
    n = comm.topo.size(CP)
    inp = torch.stack(x.chunk(n, scatter)).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, CP)
    return torch.cat(out.unbind(0), dim=gather)


class _AllToAll(Function):
    """`_exchange` forward; its inverse (gather and scatter swapped) backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, scatter: int, gather: int):
        ctx.comm, ctx.dims = comm, (scatter, gather)
        return _exchange(x, comm, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather = ctx.dims
        return _exchange(grad.contiguous(), ctx.comm, gather, scatter), None, None, None


def ulysses_attention(q, k, v, positions, comm: Comm) -> torch.Tensor:
    """Same contract as `ring_attention`, computed head-parallel: each cp rank gets H/cp
    heads of the whole sequence, runs causal attention on them, and sends the output back.
    Requires H divisible by cp and distinct positions."""
    n, heads = comm.topo.size(CP), q.shape[1]
    if heads % n:
        raise ValueError(f"Ulysses needs the heads H={heads} divisible by cp={n}")
    # rank order is the order the all-to-all concatenates; sorting it restores the natural
    # order, in which the causal mask is the position mask
    order = torch.argsort(_all_positions(positions, comm).flatten()).to(q.device)
    # q, k, v in one exchange: [3, B, H, S/cp, D] -> [3, B, H/cp, S, D] (Jacobs et al., §3.1)
    qkv = _AllToAll.apply(torch.stack([q, k, v]), comm, 2, 3).index_select(3, order)
    qh, kh, vh = qkv.float()
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).to(q.dtype)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(out.index_select(2, back), comm, 2, 1)
