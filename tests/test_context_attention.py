"""Context-parallel attention kernels (ring and Ulysses): exact against causal SDPA on the full
sequence, forward and backward, at cp 1 (in this process), 2 and 4 (one gloo world each, run
side by side), and the cp traffic they record.

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
    for result in worlds[n]["bytes"]:
        for kernel, phases in expected.items():
            assert result[kernel]["dims"] == ["cp"]
            for phase, (nbytes, calls) in phases.items():
                assert result[kernel][phase] == pytest.approx((nbytes, calls)), (kernel, phase)
