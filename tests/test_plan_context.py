"""Context parallelism's step time in the planner (plan/context.py): the attention of a rank's
local queries over the whole sequence, and the exchange, hidden behind the ring's blocks or
exposed for Ulysses. Checked against the attention kernel's own price at the whole length and
against the bytes traffic.cp_traffic counts, so the cp terms follow from the model's physics
rather than restating the code."""

import dataclasses
import json

import pytest

from shardwise.cli.main import main
from shardwise.config import Config
from shardwise.errors import ConfigError
from shardwise.job.auto import apply_layout
from shardwise.models.presets import preset
from shardwise.models.spec import spec_from_config
from shardwise.plan import gpu, peers, search, traffic
from shardwise.plan import memory as mem
from shardwise.plan.hardware import CATALOG, get_hardware
from shardwise.plan.layout import Job, Layout

SPEC = dataclasses.replace(preset("7b"), max_seq_len=1 << 20)
H100 = CATALOG["h100-sxm"]


def _job(seq: int, hw=H100, devices: int = 8, batch: int = 1) -> Job:
    return Job(SPEC, hw, devices, seq, batch, "bf16", "bf16")


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("fused", ["ulysses", "peer flash ring"])
def test_a_rank_computes_one_cp_th_of_the_whole_attention(cp, fused):
    """With the causal mask balanced over the ranks each one computes 1/cp of the s x s
    triangle: on fused kernels the equivalent's attention at s/cp plus the added time equals
    the attention kernel priced at the whole length, divided by cp (to the launch cost of the
    extra kernels)."""
    seq = 16384 * cp
    job = _job(seq, batch=8 // cp)
    if fused == "peer flash ring":
        job = peers.run_by(job, peers.Deviations(name="peer", cp_fused_blocks=True))
    mode = "ulysses" if fused == "ulysses" else "ring"
    lay = Layout(dp=8 // cp, cp=cp, cp_mode=mode, zero=3, micro_batch=1, recompute="none")
    added = search.evaluate(job, lay)["time"]["cp_attention_s"]
    peak = H100.peak["bf16"]
    local = sum(gpu.attention_seconds(H100, SPEC, 1, 1, seq // cp, 2, peak))
    whole = sum(gpu.attention_seconds(H100, SPEC, 1, 1, seq, 2, peak))
    mine = SPEC.n_layers * local + added  # one micro-batch a step here
    assert mine == pytest.approx(SPEC.n_layers * whole / cp, rel=1e-3)


def test_our_ring_is_priced_as_the_fp32_blocks_it_computes():
    """Our ring kernel multiplies each block pair's scores in fp32 (parallel/context_comm.py):
    on an H100 its attention costs more than the fused bf16 kernel a peer's ring or Ulysses
    runs, by more than the fp32/bf16 peak ratio's half, so `plan` prefers Ulysses there."""
    job = _job(131072, batch=2)
    ours = search.evaluate(job, Layout(dp=2, cp=4, zero=3))
    uly = search.evaluate(job, Layout(dp=2, cp=4, cp_mode="ulysses", zero=3))
    ratio = ours["time"]["cp_attention_s"] / uly["time"]["cp_attention_s"]
    assert ratio > H100.peak["bf16"] / H100.peak["fp32"] / 2
    assert ours["step_time_s"] > uly["step_time_s"]


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


LONG = [
    "--model.name=7b", "--model.max_seq_len=131072", "--data.seq_len=131072",
    "--hardware", "h100-sxm", "--devices", "8", "--train.global_batch=8",
    "--precision.compute=bf16", "--precision.reduce=bf16", "--json", "--top", "3",
]  # fmt: skip


def _plan_json(capsys, *args) -> dict:
    assert main(["plan", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_searches_cp_and_prints_the_flags_that_run_it(capsys):
    """A 7B at 128K tokens on 8 H100s: only a sequence split fits the activations, so the
    search's best layouts split it, and their train flags carry the cp degree and mode."""
    best = _plan_json(capsys, *LONG)["candidates"][0]
    assert best["cp"] > 1 and best["tp"] * best["pp"] * best["dp"] * best["cp"] == 8
    assert f"--parallel.cp={best['cp']}" in best["train_flags"]
    assert f"--parallel.cp_mode={best['cp_mode']}" in best["train_flags"]


def test_a_pinned_cp_is_kept(capsys):
    """--parallel.cp pins the search like the other layout keys."""
    got = _plan_json(capsys, *LONG, "--parallel.cp=8", "--parallel.cp_mode=ulysses")
    assert {(c["cp"], c["cp_mode"]) for c in got["candidates"]} == {(8, "ulysses")}


def test_cp_is_not_searched_where_the_engine_does_not_split_attention(capsys):
    """GPT-2 with dropout (its masks would change with the split) is never given a cp > 1."""
    got = _plan_json(
        capsys, "--model.name=gpt2-125m", "--model.dropout=0.1", "--hardware", "h100-sxm",
        "--devices", "8", "--data.seq_len=1024", "--train.global_batch=64", "--json", "--top", "50",
    )  # fmt: skip
    assert got["candidates"] and all(c["cp"] == 1 for c in got["candidates"])


def test_plan_auto_applies_the_chosen_cp():
    """--plan auto runs what the search chose: the candidate's cp and mode reach the config."""
    cfg = Config()
    chosen = apply_layout(
        cfg, {**search.evaluate(_job(8192, batch=4), Layout(dp=4, cp=2)), "sp": False}
    )
    assert (chosen.parallel.cp, chosen.parallel.cp_mode) == (2, "ring")
    assert (cfg.parallel.cp, chosen.parallel.zero) == (1, 0)


def test_model_max_seq_len_overrides_the_preset():
    """model.max_seq_len lifts a RoPE preset's limit (its angles exist for any position), and
    transformers' own class (model.name=hf) refuses it: its config.json sets positions."""
    cfg = Config()
    cfg.model.name, cfg.model.max_seq_len = "7b", 131072
    assert spec_from_config(cfg).max_seq_len == 131072
    cfg.model.name, cfg.model.init_from = "hf", "some-dir"
    with pytest.raises(ConfigError, match=r"model\.max_seq_len does not apply"):
        spec_from_config(cfg)
