"""Context-parallel attention kernels (ring and Ulysses): exact against causal SDPA on the full
sequence, forward and backward, at cp 1 (in this process), 2 and 4 (one gloo world each, run
side by side), also on packed records (against SDPA under the single process's per-record
mask), the cp traffic they record, and the cp and tp groups of one mesh.

Every cp comparison gathers the ranks' outputs and gradients back to the full sequence, so a
token that is computed twice, missed, or put at the wrong position fails it."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.distributed.comm import Comm
from shardwise.distributed.topology import Topology
from shardwise.launchers.harness import run_named_worlds
from shardwise.parallel.context_comm import ring_attention, ulysses_attention, zigzag_positions
from support.cp_peers import B, D, H, S

PARITY = {"peer": "support.cp_peers:attention_parity"}
BYTES = {"peer": "support.cp_peers:attention_bytes"}
WORLDS = {n: {"parity": PARITY, "bytes": BYTES} for n in (2, 4)}
TENSORS = ("out", "dq", "dk", "dv")
FP32_TOL = 1e-5
KERNELS = {"ring": ring_attention, "ulysses": ulysses_attention}


@pytest.fixture(scope="module")
def worlds():
    return run_named_worlds(WORLDS)


def test_zigzag_positions():
    """Rank i holds chunks i and 2·cp−1−i of 2·cp: the ranks together hold every position
    once, and each holds the same causal work (the sum of its positions + 1)."""
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_positions(8, 1, 0).tolist() == list(range(8))
    parts = [zigzag_positions(32, 4, i) for i in range(4)]
    assert all(p.dtype == torch.int64 and p.numel() == 8 for p in parts)
    assert torch.cat(parts).sort().values.tolist() == list(range(32))
    assert len({int((p + 1).sum()) for p in parts}) == 1


@pytest.mark.parametrize(("seq_len", "cp", "index"), [(30, 4, 0), (12, 4, 1), (16, 2, 2)])
def test_zigzag_positions_rejects(seq_len, cp, index):
    """A sequence that does not cut into 2·cp equal chunks (or a rank outside the group) is
    an error that names the numbers."""
    with pytest.raises(ValueError, match=str(cp)):
        zigzag_positions(seq_len, cp, index)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_cp1_is_plain_causal_attention(kernel):
    """At cp 1 both kernels are causal attention (to fp32 rounding) and record no traffic."""
    comm = Comm(Topology(world=1, rank=0, pp=1, dp=1, tp=1))
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    out = KERNELS[kernel](q, k, v, torch.arange(S), comm)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip((out, *grads), (ref, *ref_grads), strict=True):
        assert (a - b).abs().max().item() < FP32_TOL
    assert not any(comm.step_bytes.values()) and not any(comm.step_calls.values())


def test_cp_and_tp_groups_in_one_mesh(monkeypatch):
    """pp 2 x dp 2 (one run of cp 2) x tp 2 on 8 ranks (ranks row-major over pp, dp, tp): a
    rank's cp group shares its pp and tp coordinates, its tp group its pp and dp ones, as
    `build_topology` creates them (the groups it makes, recorded here in one process), and
    the ring's next rank (`_peer`) is the other rank of its cp group, tp ranks away."""
    from shardwise.distributed import topology
    from shardwise.parallel.context_comm import _peer

    rank = {"r": 0}
    monkeypatch.setattr(topology.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(topology.dist, "get_rank", lambda: rank["r"])
    monkeypatch.setattr(topology.dist, "new_group", lambda line, **_: sorted(line))
    monkeypatch.setattr(topology.DeviceMesh, "from_group", lambda *a, **k: None)
    topos = []
    for r in range(8):
        rank["r"] = r
        topos.append(topology.build_topology(2, 2, "cpu", 60.0, cp=2))
    for t in topos:  # the groups made are the lines of the coordinates below
        assert t.groups["cp"] == [u.rank for u in topos if _same(u, t, ("pp", "tp", "data"))]
        assert t.groups["tp"] == [u.rank for u in topos if _same(u, t, ("pp", "dp"))]

    def groups(dim: str, keep: tuple[str, ...]) -> list[list[int]]:
        lines: dict[tuple, list[int]] = {}
        for t in topos:
            lines.setdefault(tuple(t.coord(d) for d in keep), []).append(t.rank)
        assert all(len(line) == topos[0].size(dim) for line in lines.values())
        return sorted(lines.values())

    assert groups("cp", ("pp", "tp", "data")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups("tp", ("pp", "dp")) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for t in topos:
        nxt = topos[_peer(Comm(t), 1)]
        assert [nxt.coord(d) for d in ("pp", "tp", "data")] == [
            t.coord(d) for d in ("pp", "tp", "data")
        ]
        assert nxt.coord("cp") == 1 - t.coord("cp") and abs(nxt.rank - t.rank) == t.tp


def _same(a: Topology, b: Topology, dims: tuple[str, ...]) -> bool:
    return all(a.coord(d) == b.coord(d) for d in dims)


def test_ulysses_rejects_heads_not_divisible():
    """Ulysses splits heads over cp: 4 heads over cp 3 is an error naming both."""
    topo = Topology(world=3, rank=0, pp=1, dp=3, tp=1, cp=3)
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match=r"H=4.*cp=3"):
        ulysses_attention(q, q, q, zigzag_positions(18, 3, 0), Comm(topo))


@pytest.mark.parametrize("n", [2, 4])
def test_fp32_matches_full_sequence_sdpa(worlds, n):
    """fp32, zig-zag layout (and a contiguous one, where whole blocks are skipped): the
    output and dq, dk, dv gathered to the full sequence are within 1e-5 (max absolute
    difference; entries are O(1)) of causal SDPA on one process, on every rank."""
    for rank, result in enumerate(worlds[n]["parity"]):
        for run, tensors in result.items():
            if run.endswith("float32"):
                assert tensors["dtype"] == tensors["grad_dtype"] == "torch.float32"
                for name in TENSORS:
                    err = tensors[name]["max_abs"]
                    assert err < FP32_TOL, f"cp{n} rank {rank} {run} {name}: {err:.3g}"


@pytest.mark.parametrize("n", [2, 4])
def test_packed_records_match_the_single_process_mask(worlds, n):
    """Packed records (support/cp_peers.RECORDS: block pairs no query sees, rows that see
    nothing of a block, padding): fp32 output and dq, dk, dv within 1e-5 of SDPA under the
    per-record mask of models/packing.py on one process, zig-zag and contiguous, on every
    rank; no NaN (it would fail the bound)."""
    for rank, result in enumerate(worlds[n]["parity"]):
        for kernel in KERNELS:
            for layout in ("zigzag", "contiguous"):
                tensors = result[f"{kernel}/{layout}/packed/float32"]
                for name in TENSORS:
                    err = tensors[name]["max_abs"]
                    assert err < FP32_TOL, f"cp{n} rank {rank} {kernel} {layout} {name}: {err}"


def test_packed_records_change_the_result():
    """The packed reference differs from plain causal attention (the mask has something to
    do), the per-record starts the kernels take restart where the records do, and at cp 4
    the ring skips a block pair that positions alone would compute (rank 0's queries, rank
    3's keys: the parity test above covers the skip)."""
    from shardwise.parallel.context_comm import _blocks
    from support.cp_peers import RECORDS, _inputs, _reference, _starts

    full = _inputs(torch.float32)
    plain, packed = _reference(full), _reference(full, packed=True)
    assert (plain[0] - packed[0]).abs().max() > 0.1
    assert _starts(torch.arange(S)).tolist()[0] == [0] * 8 + [8] * 8 + [16] * 12 + [28] * 4
    assert RECORDS.shape == (B, S)
    pos = torch.stack([zigzag_positions(S, 4, i) for i in range(4)])
    assert _blocks(pos, 0, "cpu")[3] is not None
    plan = _blocks(pos, 0, "cpu", _starts(pos[0]))
    assert plan[3].empty and not any(b.empty for b in plan[:3])


@pytest.mark.parametrize("n", [2, 4])
def test_bf16_within_one_rounding(worlds, n):
    """bf16 inputs: blocks are computed in fp32 and the result rounded once to bf16 (the
    dK/dV contributions travel home in fp32), so each entry of the output and gradients
    is within one bf16 rounding (2^-8 of itself) plus fp32 noise (1e-5) of fp32 causal
    SDPA on the same bf16 inputs."""
    for result in worlds[n]["parity"]:
        for kernel in KERNELS:
            tensors = result[f"{kernel}/zigzag/bfloat16"]
            assert tensors["dtype"] == tensors["grad_dtype"] == "torch.bfloat16"
            for name in TENSORS:
                assert tensors[name]["bf16_excess"] < FP32_TOL, (n, kernel, name, tensors[name])


@pytest.mark.parametrize("n", [2, 4])
def test_cp_traffic(worlds, n):
    """Bytes per rank are recorded under "cp" only. Ring forward: the positions gathered
    once plus cp−1 K/V blocks around the ring; backward: cp−1 K/V blocks again plus cp−1
    dK/dV blocks sent home (fp32). Ulysses: all-to-alls of (cp−1)/cp of q, k, v and the
    output, and the same of their gradients."""
    s_local = S // n
    block = B * H * s_local * D * 4  # one fp32 [B, H, S/cp, D] tensor
    positions = (n - 1) * s_local * 8
    expected = {
        "ring": {
            "forward": (positions + (n - 1) * 2 * block, 1 + (n - 1)),
            "backward": ((n - 1) * 4 * block, 2 * (n - 1)),
        },
        "ulysses": {
            "forward": (positions + (n - 1) / n * 4 * block, 3),
            "backward": ((n - 1) / n * 4 * block, 2),
        },
    }
    # packed records: the ring sends the same (the send-home schedule follows positions);
    # Ulysses gathers every rank's [B, S/cp] int64 record starts with the positions
    expected["ring/packed"] = expected["ring"]
    starts = (n - 1) * B * s_local * 8
    fwd, bwd = expected["ulysses"]["forward"], expected["ulysses"]["backward"]
    expected["ulysses/packed"] = {"forward": (fwd[0] + starts, fwd[1]), "backward": bwd}
    for result in worlds[n]["bytes"]:
        for kernel, phases in expected.items():
            assert result[kernel]["dims"] == ["cp"]
            for phase, (nbytes, calls) in phases.items():
                assert result[kernel][phase] == pytest.approx((nbytes, calls)), (kernel, phase)


@pytest.mark.parametrize("n", [2, 4])
def test_zigzag_blocks_run_on_the_fused_kernel(n):
    """With the zig-zag (or a contiguous) layout every block pair a rank computes is fully
    visible or its own causal square, so on the CPU each runs on ATen's fused flash kernel
    (no s x s scores) and returns the same output, log-sum-exp and gradients as the explicit
    masked computation (the path packed rows keep) to fp32 rounding."""
    import dataclasses

    from shardwise.parallel import context_comm as cc

    assert cc.attention_with_lse("cpu") is not None  # (else both paths below are explicit)
    g = torch.Generator().manual_seed(3)
    for layout in ("zigzag", "contiguous"):
        part = S // n
        pos = torch.stack(
            [
                zigzag_positions(S, n, r)
                if layout == "zigzag"
                else torch.arange(r * part, (r + 1) * part)
                for r in range(n)
            ]
        )
        for r in range(n):
            blocks = [b for b in cc._blocks(pos, r, torch.device("cpu")) if b is not None]
            assert {b.kind for b in blocks} <= {"full", "causal"} and blocks
            for blk in blocks:
                q = torch.randn(B, H, S // n, D, generator=g)
                kv = torch.randn(2, B, H, S // n, D, generator=g)
                explicit = dataclasses.replace(blk, kind="mask")
                (o1, l1), (o2, l2) = (cc._block_forward(q, kv, b, D**-0.5) for b in (blk, explicit))
                assert (o1 - o2).abs().max() < 1e-5 and (l1 - l2).abs().max() < 1e-5
                do = torch.randn(B, H, S // n, D, generator=g)
                out = torch.zeros(B, H, S // n, D)
                lse = torch.zeros(B, H, S // n)
                out[:, :, blk.rows], lse[:, :, blk.rows] = o1, l1
                delta = (do * out).sum(-1)
                grads = []
                for b in (blk, explicit):
                    dq = torch.zeros_like(out)
                    dkv = cc._block_backward(q, kv, do, out, lse, delta, b, D**-0.5, dq)
                    grads.append((dq, dkv))
                assert (grads[0][0] - grads[1][0]).abs().max() < 1e-5
                assert (grads[0][1] - grads[1][1]).abs().max() < 1e-5
    starts = torch.zeros(B, S // n, dtype=torch.int64)
    packed = cc._blocks(pos, 0, torch.device("cpu"), starts)
    assert {b.kind for b in packed if b is not None} == {"mask"}
