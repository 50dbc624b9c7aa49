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

Packed rows (models/packing.py): `starts` gives, per sample and local query, the global
position where its record starts. Records are contiguous, so key j is visible to query i iff
starts[i] <= pos_k[j] <= pos_q[i]: the single process's per-record causal mask, from the
queries' side alone. The ring needs nothing more from other ranks; a block pair no query of
which sees a key of is not computed, and a query row that sees nothing of a block adds
nothing to the log-sum-exp merge (never a NaN). Which rank sends dK/dV to which still follows
the positions alone (a pair masked by records alone sends zeros), so the traffic does not
depend on where records end and the planner predicts it exactly. Ulysses gathers the starts
with the positions (one all-gather) and masks the whole sequence it holds per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd import Function

from shardwise.distributed.comm import Comm
from shardwise.distributed.device import attention_with_lse

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


def _all_positions(positions: torch.Tensor, comm: Comm, starts=None):
    """[cp, S_local]: every cp rank's positions, in rank order (one small gather per call);
    with `starts` [B, S_local], also every rank's starts [cp, B, S_local] (the same gather)."""
    n, local = comm.topo.size(CP), positions.numel()
    part = positions.to(torch.int64).reshape(-1)
    if starts is not None:
        part = torch.cat([part, starts.to(torch.int64).reshape(-1)])
    full = part.new_empty(n * part.numel())
    comm.all_gather(full, part.contiguous(), CP)
    full = full.view(n, -1)
    if starts is None:
        return full
    return full[:, :local], full[:, local:].view(n, *starts.shape)


@dataclass(frozen=True)
class _Block:
    """What of one K/V block the local queries see: the rows (queries) that see some key of
    it and the columns (keys) that some query sees. A contiguous run is a slice (a view, no
    gather): with the zig-zag layout an off-diagonal block is half of one side."""

    rows: slice | torch.Tensor
    cols: slice | torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_start: torch.Tensor | None = None  # [B, rows]: where each query's record starts
    empty: bool = False  # packed rows: no query sees a key of this block (nothing computed)
    # what the mask of the seen part is: "full" (nothing hidden), "causal" (a square whose
    # keys are its queries: the zig-zag's own block), else "mask" (anything else: packed
    # rows); the first two run on a fused kernel where the device has one
    kind: str = "mask"

    def hidden(self) -> torch.Tensor:
        """True where the key is masked: in the query's future [rows, cols], or also before
        its record's start [B, 1, rows, cols] (packed rows)."""
        future = self.k_pos[None, :] > self.q_pos[:, None]
        if self.q_start is None:
            return future
        return (future | (self.k_pos[None, None, :] < self.q_start[:, :, None]))[:, None]


def _index(mask: torch.Tensor, device) -> slice | torch.Tensor:
    """`mask`'s True entries: a slice when they form one run, else indices on `device`."""
    idx = mask.nonzero().squeeze(1)
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    return slice(lo, hi) if hi - lo == idx.numel() else idx.to(device)


def _blocks(pos: torch.Tensor, r: int, device, starts=None) -> list[_Block | None]:
    """Per source cp rank, the part of its K/V block rank r's queries see; None where every
    key lies in every query's future (the pair is skipped). `pos` [cp, S_local] and `starts`
    (packed rows: [B, S_local] of rank r's queries) on the CPU: the plan costs one device sync
    per call, not one per block."""
    q_pos, plan = pos[r], []
    for k_pos in pos:
        rows = q_pos >= k_pos.min()
        if not rows.any():
            plan.append(None)
            continue
        ri, ci = _index(rows, device), _index(k_pos <= q_pos.max(), device)
        q_start, empty = None, False
        if starts is not None:
            # keys of this block in [start, position] of some query: counted by binary search
            keys = k_pos.sort().values
            seen = torch.searchsorted(keys, q_pos[rows].repeat(len(starts), 1), right=True)
            seen -= torch.searchsorted(keys, starts[:, rows])
            q_start, empty = starts[:, rows].to(device), not bool((seen > 0).any())
        kind = "mask" if starts is not None else _kind(q_pos[ri], k_pos[ci])
        block = _Block(ri, ci, q_pos[ri].to(device), k_pos[ci].to(device), q_start, empty, kind)
        plan.append(block)
    return plan


def _kind(q_pos: torch.Tensor, k_pos: torch.Tensor) -> str:
    """The `_Block.kind` of queries at `q_pos` over keys at `k_pos` (CPU tensors)."""
    future = k_pos[None, :] > q_pos[:, None]
    if not future.any():
        return "full"
    square = len(q_pos) == len(k_pos) and torch.equal(q_pos, k_pos)
    return (
        "causal"
        if square and torch.equal(future, future.new_ones(future.shape).triu(1))
        else "mask"
    )


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


def _fused(blk: _Block, device: torch.device):
    """The device's fused (forward, backward) kernel pair for this block, or None."""
    return None if blk.kind == "mask" else attention_with_lse(device.type)


def _block_forward(q, kv, blk: _Block, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the seeing queries over the seen keys of one block, fp32: (out, lse)."""
    qs = q[:, :, blk.rows].float()
    ks, vs = kv[:, :, :, blk.cols].float()
    if fused := _fused(blk, q.device):  # scores never materialised (FlashAttention-2)
        causal = blk.kind == "causal"
        out, lse = fused[0](
            qs.contiguous(), ks.contiguous(), vs.contiguous(), 0.0, causal, scale=scale
        )[:2]
        return out, lse
    s = (qs @ ks.transpose(-1, -2)) * scale
    s = s.masked_fill(blk.hidden(), float("-inf"))
    # -inf where a row sees no key of this block (packed rows): its output row is then zero
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - _finite(lse)[..., None]) @ vs, lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with -inf (a row that saw no key) as 0, so exp(x - lse) is 0 there, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _merge(out, lse, blk: _Block, b_out, b_lse) -> None:
    """Fold a block's partial softmax into the running one (in place): both are normalised
    over their own keys, so each is weighted by its share exp(lse_part - lse_total)."""
    old_out, old_lse = out[:, :, blk.rows], lse[:, :, blk.rows]
    new_lse = torch.logaddexp(old_lse, b_lse)
    ref = _finite(new_lse)  # a row with no key yet on either side keeps weight 0, not NaN
    out[:, :, blk.rows] = (
        old_out * torch.exp(old_lse - ref)[..., None] + b_out * torch.exp(b_lse - ref)[..., None]
    )
    lse[:, :, blk.rows] = new_lse


def _block_backward(q, kv, do, out, lse, delta, blk: _Block, scale: float, dq) -> torch.Tensor:
    """Add one block pair's dQ into `dq` and return its dK/dV [2, B, H, S, D] (fp32). The
    probabilities are recomputed from the merged log-sum-exp, so no S×S tensor outlives
    the forward; dS = P ∘ (dP − D) (Dao 2023, FlashAttention-2, alg. 2). A fused kernel
    given the merged output and log-sum-exp computes the same D and P itself."""
    qs = q[:, :, blk.rows].float()
    ks, vs = kv[:, :, :, blk.cols].float()
    grad = kv.new_zeros(kv.shape, dtype=torch.float32)
    if fused := _fused(blk, q.device):
        rows = (do[:, :, blk.rows], qs, ks, vs, out[:, :, blk.rows], lse[:, :, blk.rows])
        g = fused[1](*(t.contiguous() for t in rows), 0.0, blk.kind == "causal", scale=scale)
        dq[:, :, blk.rows] += g[0]
        grad[0][:, :, blk.cols], grad[1][:, :, blk.cols] = g[1], g[2]
        return grad
    s = (qs @ ks.transpose(-1, -2)) * scale
    # the merged lse is finite: every query sees at least itself
    p = torch.exp(s.masked_fill(blk.hidden(), float("-inf")) - lse[:, :, blk.rows, None])
    dos = do[:, :, blk.rows]
    ds = p * (dos @ vs.transpose(-1, -2) - delta[:, :, blk.rows, None])
    dq[:, :, blk.rows] += ds @ ks * scale
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
    def forward(ctx, q, k, v, positions, starts, comm: Comm):
        n, r = comm.topo.size(CP), comm.topo.coord(CP)
        pos = _all_positions(positions, comm).cpu()
        blocks = _blocks(pos, r, q.device, None if starts is None else starts.cpu())
        scale = q.shape[-1] ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack([k, v])  # one transfer per step instead of two
        for step in range(n):
            # the next block leaves before this one is computed: the transfer hides behind
            # the compute (Liu et al. 2023, §3)
            ring = _shift(kv, comm) if step < n - 1 else None
            blk = blocks[(r - step) % n]
            if blk is not None and not blk.empty:  # None: every key in the future
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
            if blk is not None and blk.empty:  # masked by records alone: its owner expects
                grad = torch.zeros_like(dkv)  # a transfer (the schedule follows positions)
            elif blk is not None:
                grad = _block_backward(q, kv, do, out, lse, delta, blk, ctx.scale, dq)
            _collect(home, dkv)  # the previous block's first: one in flight bounds memory
            if step > 0:
                home = _send_home(grad, step, ctx.sees[(r + step) % n][r], dkv, comm)
            elif grad is not None:  # our own block: already home
                dkv += grad
            if ring is not None:
                kv = _landed(ring)
        _collect(home, dkv)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, positions, comm: Comm, starts=None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys/values.

    q, k, v [B, H, S_local, D] (k/v heads already repeated to H); `positions` [S_local] the
    global positions of the local tokens (`zigzag_positions`): key j is visible to query i
    iff positions_k[j] <= positions_q[i], and with `starts` [B, S_local] (packed rows: where
    each query's record starts) also starts[i] <= positions_k[j]. Returns [B, H, S_local, D],
    scale 1/sqrt(D)."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(
            f"q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)} (repeat k/v heads to q's first)"
        )
    return _Ring.apply(q, k, v, positions, starts, comm)


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


def ulysses_attention(q, k, v, positions, comm: Comm, starts=None) -> torch.Tensor:
    """Same contract as `ring_attention`, computed head-parallel: each cp rank gets H/cp
    heads of the whole sequence, runs causal attention on them, and sends the output back.
    Requires H divisible by cp and distinct positions."""
    n, heads = comm.topo.size(CP), q.shape[1]
    if heads % n:
        raise ValueError(f"Ulysses needs the heads H={heads} divisible by cp={n}")
    # rank order is the order the all-to-all concatenates; sorting it restores the natural
    # order, in which the causal mask is the position mask
    gathered = _all_positions(positions, comm, starts)
    order = torch.argsort((gathered if starts is None else gathered[0]).flatten()).to(q.device)
    # q, k, v in one exchange: [3, B, H, S/cp, D] -> [3, B, H/cp, S, D] (Jacobs et al., §3.1)
    qkv = _AllToAll.apply(torch.stack([q, k, v]), comm, 2, 3).index_select(3, order)
    qh, kh, vh = qkv.float()
    if starts is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:  # per record: key j visible to query i iff start_i <= j <= i (whole sequence)
        first = gathered[1].permute(1, 0, 2).flatten(1).to(q.device)[:, order]  # [B, S]
        j = torch.arange(order.numel(), device=q.device)
        seen = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] >= first[:, :, None])
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen[:, None])
    out = out.to(q.dtype)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(out.index_select(2, back), comm, 2, 1)
