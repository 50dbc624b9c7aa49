"""Context parallelism's step time in the planner (plan/context.py): the attention of a rank's
local queries over the whole sequence, and the exchange, hidden behind the ring's blocks or
exposed for Ulysses. Checked against the attention kernel's own price at the whole length and
against the bytes traffic.cp_traffic counts, so the cp terms follow from the model's physics
rather than restating the code."""

import dataclasses

import pytest

from shardwise.models.presets import preset
from shardwise.plan import gpu, peers, search, traffic
from shardwise.plan import memory as mem
from shardwise.plan.hardware import CATALOG, get_hardware
from shardwise.plan.layout import Job, Layout

SPEC = dataclasses.replace(preset("7b"), max_seq_len=1 << 20)
H100 = CATALOG["h100-sxm"]


def _job(seq: int, hw=H100, devices: int = 8, batch: int = 1) -> Job:
    return Job(SPEC, hw, devices, seq, batch, "bf16", "bf16")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_rank_computes_one_cp_th_of_the_whole_attention(cp):
    """With the causal mask balanced over the ranks each one computes 1/cp of the s x s
    triangle: the equivalent's attention at s/cp plus the added time equals the attention
    kernel priced at the whole length, divided by cp (to the launch cost of the extra kernels)."""
    seq = 16384 * cp
    job = _job(seq, batch=8 // cp)
    lay = Layout(dp=8 // cp, cp=cp, zero=3, micro_batch=1, recompute="none")
    added = search.evaluate(job, lay)["time"]["cp_attention_s"]
    peak = H100.peak["bf16"]
    local = sum(gpu.attention_seconds(H100, SPEC, 1, 1, seq // cp, 2, peak))
    whole = sum(gpu.attention_seconds(H100, SPEC, 1, 1, seq, 2, peak))
    mine = SPEC.n_layers * local + added  # one micro-batch a step here
    assert mine == pytest.approx(SPEC.n_layers * whole / cp, rel=1e-3)


def test_the_ring_hides_its_sends_behind_long_attention_and_ulysses_does_not():
    """At 128K tokens over 4 ranks of one node the ring's K/V blocks travel while the block
    in hand computes (nothing exposed but the positions' all-gather); Ulysses' all-to-alls sit
    between projection and attention, all exposed. Both move the bytes cp_traffic counts."""
    job = _job(131072, batch=2)
    for mode in ("ring", "ulysses"):
        lay = Layout(dp=2, cp=4, cp_mode=mode, zero=3, recompute="full")
        rec = search.evaluate(job, lay)
        t = rec["time"]
        kinds, calls = traffic.cp_traffic(job, lay)
        link = H100.intra_bw * H100.comm_eff
        assert t["cp_comm_s"] == pytest.approx(sum(kinds.values()) / link + calls * H100.latency)
        if mode == "ring":
            gather = kinds["all_gather"] / link
            assert gather <= t["cp_exposed_s"] < gather + calls * H100.latency + 1e-12
        else:
            assert t["cp_exposed_s"] == t["cp_comm_s"] > 0
        assert rec["step_time_s"] == pytest.approx(
            sum(v for k, v in t.items() if k.endswith("_s") and k not in _NOT_SUMMED)
        )


_NOT_SUMMED = {"step_s", "dp_comm_s", "cp_comm_s"}  # (dp_exposed_s, cp_exposed_s are)


def test_a_ring_across_nodes_over_a_slow_link_is_exposed():
    """Short sequences on a slow network: the block's attention is too short to cover its
    sends, and what it leaves is on the step."""
    slow = H100.with_overrides(inter_bw=1e8, per_node=2)
    job = _job(8192, hw=slow, devices=4, batch=1)
    t = search.evaluate(job, Layout(dp=1, cp=4, zero=3))["time"]
    assert t["cp_exposed_s"] > 0.5 * t["cp_comm_s"]


def test_longer_sequences_over_more_ranks_cost_more_per_token():
    """The attention grows with s^2 while the matmuls grow with s: doubling the sequence with
    the cp degree keeps each rank's tokens and lowers tokens/s per device, as published long-
    context runs show (torchtitan's Llama 3.1 8B on 8 H100s, 32K to 256K tokens)."""
    rates = []
    for cp in (1, 2, 4, 8):
        job = _job(32768 * cp, batch=8 // cp)
        lay = Layout(dp=8 // cp, cp=cp, zero=3, recompute="full")
        rates.append(search.evaluate(job, lay)["tokens_per_s"])
    assert rates == sorted(rates, reverse=True)


def test_the_cpu_prices_the_added_attention_too():
    """Without the GPU kernel model the added attention is priced by FLOPs at the CPU's rate."""
    hw = get_hardware("cpu", calibrate=False)
    job = Job(preset("tiny"), hw, 2, 512, 1, "fp32", "fp32")
    t = search.evaluate(job, Layout(dp=1, cp=2))["time"]
    assert t["cp_attention_s"] > 0 and t["cp_comm_s"] > 0


def test_a_peer_ring_on_fused_blocks_holds_no_block_scores():
    """PyTorch's context_parallel (torchtitan) runs each block pair through the flash kernel:
    its transient lacks exactly the fp32 scores, probabilities and their gradient of one block
    pair (3 x 4 bytes x b x H x (s/cp)^2) that ours materialises."""
    job = _job(65536, batch=4)
    lay = Layout(dp=4, cp=2, zero=3)
    peer = peers.run_by(job, peers.Deviations(name="peer", cp_fused_blocks=True))
    local = 65536 // 2
    scores = 3 * 4 * 1 * SPEC.n_heads * local * local
    assert mem.cp_transient(job, lay) - mem.cp_transient(peer, lay) == scores
