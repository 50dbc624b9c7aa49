"""The planner's GPU cost model (plan/gpu.py, the NCCL ring model in plan/time.py) and the
published runs it is checked against (benchmarks/published/, benchmarks/published_runs.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from shardwise.models.presets import ModelSpec, preset
from shardwise.plan import activations as act
from shardwise.plan import gpu, peers, search, traffic
from shardwise.plan import time as tm
from shardwise.plan.hardware import get_hardware
from shardwise.plan.layout import Job, Layout
from shardwise.plan.peers import Deviations, PeerJob, run_by
from support.bench import bench_module
from support.livepeak import LivePeak

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
A100 = get_hardware("a100-80gb")


@pytest.fixture(scope="module")
def runs():
    return bench_module("published_runs")


def test_every_published_row_names_its_source_and_quotes_it(runs):
    rows = [
        json.loads(line)
        for path in sorted((BENCH / "published").glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    assert len(rows) >= 100
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))
    for r in rows:
        assert r["source"] and r["quote"].strip(), r["id"]
        if {"mem_gib_per_gpu", "mem_gb_per_gpu_max"} & r["measured"].keys():  # says what it counts
            assert r["measured"]["mem_counts"] in ("allocated", "reserved", "device"), r["id"]
    cases, skipped = runs.split_cases(rows)
    assert len(cases) >= 200 and all(why for _, why in skipped)
    for c in cases:
        assert c.measured_s > 0 and c.job.devices == c.row["hardware"]["n_gpus"], c.row["id"]


def test_small_gemms_run_further_from_peak_than_large_ones():
    """The roofline plus a fixed cost per kernel: a 512-token micro-batch of a tp-8 shard
    reaches a smaller fraction of the GEMM peak than 8192 tokens of the whole layer."""
    peak = A100.peak["bf16"]

    def achieved(m, n, k):
        return 2 * m * n * k / gpu._gemm(A100, 2, m, n, k, peak) / peak

    small, large = achieved(512, 4096 // 8, 4096), achieved(8192, 4096, 4096)
    assert small < 0.8 * large
    assert large == pytest.approx(A100.matmul_eff, rel=0.05)


def test_fused_causal_attention_costs_less_than_the_unfused_square():
    spec = ModelSpec("gpt2", 1, 4096, 32, 32, 16384, 50304, 4096, tie_embeddings=True)
    peak = A100.peak["bf16"]
    fused = gpu._attention(A100, spec, 1, 1, 4096, 2, peak, unfused=False)
    unfused = gpu._attention(A100, spec, 1, 1, 4096, 2, peak, unfused=True)
    assert sum(fused) < sum(unfused)
    # selective recomputation repeats the attention core's forward only
    job = Job(spec, A100, 8, seq_len=4096, global_batch=8)
    none = gpu.micro_batch_seconds(A100, job, Layout(dp=8, recompute="none"), 1)
    sel = gpu.micro_batch_seconds(A100, job, Layout(dp=8, recompute="selective"), 1)
    assert sel - none == pytest.approx(fused[0], rel=1e-9)


def test_a_rings_traffic_crosses_all_the_nics_of_a_node():
    """ZeRO-3 over 64 GPUs (8 nodes): 8 ranks of the group share a node, so the node's 8 NICs
    carry the ring together; with tp 8 the same-sized dp groups have one rank per node."""
    spec = preset("7b")
    job = Job(spec, A100, 64, seq_len=4096, global_batch=64)
    wide = tm.step_time(job, Layout(dp=64, zero=3), {"optimizer": 8.0})
    one_nic = A100.with_overrides(per_node=1)
    narrow = tm.step_time(
        dataclasses.replace(job, hardware=one_nic), Layout(dp=64, zero=3), {"optimizer": 8.0}
    )
    calls = traffic.collective_calls(job, Layout(dp=64, zero=3))["dp"]
    # every call pays its ring's 63 steps: with 8 nodes 7 cross the network and 56 NVLink;
    # with a rank per node all 63 cross it (NCCL's tuning model)
    hops = {"wide": 7 * A100.hop_s + 56 * A100.nvlink_hop_s, "narrow": 63 * A100.hop_s}
    latency = {k: calls * (A100.latency + v) for k, v in hops.items()}
    assert narrow["dp_comm_s"] - latency["narrow"] == pytest.approx(
        8 * (wide["dp_comm_s"] - latency["wide"])
    )


def test_other_frameworks_costs_where_they_differ():
    """Megatron-LM's scatter/gather pipeline sends carry 1/tp of the activation; its
    data-parallel all-reduce after backward is all exposed."""
    spec = preset("175b")
    megatron = Deviations(
        "megatron-lm",
        block_memory="paper",
        unfused_attention=True,
        overlap_dp=False,
        pp_scatter_gather=True,
    )
    lay = Layout(tp=8, pp=8, dp=2, micro_batch=1, recompute="full")
    ours = Job(spec, A100, 128, seq_len=2048, global_batch=64)
    theirs = run_by(ours, megatron)
    assert traffic.traffic(theirs, lay)["pp"] == pytest.approx(traffic.traffic(ours, lay)["pp"] / 8)
    t = search.evaluate(theirs, lay)["time"]
    assert t["dp_exposed_s"] == t["dp_comm_s"] > 0
    assert search.evaluate(ours, lay)["time"]["dp_exposed_s"] < t["dp_comm_s"]
    # llm-foundry's fused cross entropy keeps 16-bit logits, its gradient written over them
    from shardwise.plan import memory as mem

    fused = run_by(ours, Deviations("foundry", fused_loss=True))
    one = Layout(dp=128, micro_batch=1)
    logits = 2048 * spec.vocab_size
    saved = mem.activation_bytes(ours, one, 0) - mem.activation_bytes(fused, one, 0)
    assert saved == pytest.approx((4 - 2) * logits)
    assert mem.backward_transient(fused, one) == 0 < mem.backward_transient(ours, one)
    # DeepSpeed's 2021 ZeRO-3: a blocking gather per parameter tensor, so one tensor is held
    # and each layer pays a call per tensor
    ours = dataclasses.replace(ours, global_batch=128)
    ds = run_by(ours, Deviations("ds", zero3_per_tensor=True))
    z3 = Layout(dp=128, zero=3, micro_batch=1, recompute="full")
    tensors = sum(len(u.entries) * u.count for u in mem.stage_units(ours, z3, 0))
    units = sum(u.count for u in mem.stage_units(ours, z3, 0))
    assert traffic.collective_calls(ds, z3)["dp"] > traffic.collective_calls(ours, z3)["dp"] * 2
    assert tensors > 2 * units
    assert mem.predict_memory(ds, z3)["buffers"] < mem.predict_memory(ours, z3)["buffers"] / 2


def test_other_frameworks_are_data_beside_the_record(tmp_path):
    """shardwise's own jobs carry no deviations; every other framework's come from
    published/frameworks.toml, each deviation with its source, a `base` extended."""
    rows = bench_module("published_case")
    assert peers.of(Job(preset("7b"), A100, 8)) == peers.NONE == Deviations()
    mg, mg22 = rows.FRAMEWORKS["megatron-lm"], rows.FRAMEWORKS["megatron-lm-2022"]
    assert mg.overlap_dp is False and mg.unfused_attention
    assert mg22 == dataclasses.replace(
        mg, name="megatron-lm-2022", sp_regather=True, tp_overlap_backward=True
    )
    bad = tmp_path / "frameworks.toml"
    bad.write_text('[x]\nfused_loss = { value = true, source = "" }\n')
    with pytest.raises(ValueError, match="no source"):
        rows.load_frameworks(bad)
    bad.write_text('[x]\nfused_los = { value = true, source = "a paper" }\n')
    with pytest.raises(ValueError, match="not a Deviations field"):
        rows.load_frameworks(bad)


def test_the_published_3d_runs_are_predicted_within_15_percent(runs):
    """Held out from the calibration: every Megatron-LM 3D row (Narayanan et al. 2021 Table 1
    and Table 2's PTD-P rows, Korthikanti et al. 2022, the README's GPT-3 175B on 1,024 A100s)
    and BLOOM-176B's logged iterations, each within the required 15 % and fitting in memory."""
    keep = ("narayanan2021-t1-", "korthikanti2022-t5-", "megatron-readme-gpt3", "bloom-tr11-")
    rows = [r for r in runs.load_rows() if r["id"].startswith(keep) or r["id"].endswith("-ptdp")]
    cases, _ = runs.split_cases(rows)
    assert len(cases) >= 30
    for c in cases:
        if runs.calibration(c.row):
            continue
        pred, unfit = runs.predict(c)
        assert unfit is None, c.row["id"]
        assert abs(pred / c.measured_s - 1) <= 0.15, (c.row["id"], pred, c.measured_s)


def test_the_published_long_context_runs_are_priced_and_held_out(runs):
    """torchtitan's Llama 3.1 8B rows at 32K-256K tokens on 8 H100s (FSDP + CP, compile +
    Float8) are priced as they ran: each with its cp degree (a ring on fused blocks), the
    blocks' GEMMs at the FP8 peak, none in the calibration, each fitting in memory; the
    predicted steps grow with the sequence as the measured ones do. (The errors, +13.5 % to
    -0.7 %, are reported in RESULTS.md, not bounded here: one source, four rows.)"""
    rows = [r for r in runs.load_rows() if r["id"].startswith("torchtitan-llama3.1-8b-8g-fsdp")]
    cases, _ = runs.split_cases([r for r in rows if "-cp" in r["id"]])
    assert [c.layout.cp for c in cases] == [1, 2, 4, 8]
    steps = []
    for c in cases:
        assert not runs.calibration(c.row) and c.job.fp8 == "tensorwise"
        assert c.job.deviations.cp_fused_blocks
        pred, unfit = runs.predict(c)
        assert unfit is None, c.row["id"]
        steps.append((c.measured_s, pred))
    assert [m for m, _ in steps] == sorted(m for m, _ in steps)
    assert [p for _, p in steps] == sorted(p for _, p in steps)


def test_the_published_moe_runs_are_priced_and_held_out(runs):
    """Every published MoE row is priced as it ran, none in the calibration: NeMo's Mixtral
    8x7B and 8x22B on DGX-B200 (Megatron-Core, FP8; the 8x22B at 65,536 tokens over tp 2, pp 4
    interleaved x14, cp 8, ep 8), Megatron-Bridge's Qwen3-30B-A3B on 16 H100s (FP8, pp 2
    interleaved x24, ep 8) and AutoModel's on 8 H100s (bf16, FSDP2, ep 8, full recomputation
    as its benchmark config sets): every degree as the table gives it, Qwen3's 32 heads of 128
    on a 2048-wide model (model.head_dim), whose FLOPs per token are the tables' own (model
    TFLOP/s over tokens/s) within 1 %: with 2048-wide heads they would be 10 % short. The
    Mixtral and Megatron-Bridge runs fit in memory; the planner's memory model says AutoModel's
    does not (RESULTS.md reports that, and the errors, -38.1 %, -0.3 %, -39.5 % and +70.0 %,
    which are not bounded here)."""
    rows = [r for r in runs.load_rows() if r["model"].get("n_experts")]
    cases, skipped = runs.split_cases(rows)
    assert not skipped, skipped
    names = sorted(c.row["model"]["name"] for c in cases)
    assert names == ["Mixtral 8x22B", "Mixtral 8x7B", "Qwen3-30B-A3B", "Qwen3-30B-A3B"]
    for c in cases:
        lay, got, spec = c.row["layout"], c.layout, c.job.spec
        assert (got.tp, got.pp, got.dp, got.cp, got.ep) == tuple(
            lay[k] for k in ("tp", "pp", "dp", "cp", "ep")
        )
        assert (got.pp_virtual, got.micro_batch) == (lay["pp_virtual"] or 1, lay["micro_batch"])
        assert c.job.global_batch == lay["global_batch"] and not runs.calibration(c.row)
        assert c.job.fp8 == ("tensorwise" if lay["float8"] else "none")
        assert (spec.n_experts, spec.top_k) == (
            c.row["model"]["n_experts"],
            c.row["model"]["top_k"],
        )
        assert spec.head_dim == c.row["model"]["head_dim"] == 128
        _, unfit = runs.predict(c)
        if c.row["id"].startswith("automodel-"):
            assert (got.zero, got.recompute) == (3, "full")
            continue
        assert got.zero == 1 and unfit is None, c.row["id"]
        assert c.job.deviations.cp_fused_blocks and c.job.deviations.cp_kv_heads
    for c in (c for c in cases if c.row["model"]["name"] == "Qwen3-30B-A3B"):
        assert (c.job.spec.q_dim, c.job.spec.dim) == (4096, 2048)
        table = (
            c.row["measured"]["tflops_per_gpu"] * 1e12 / c.row["measured"]["tokens_per_s_per_gpu"]
        )
        assert tm.model_flops_per_token(c.job, causal=True) == pytest.approx(table, rel=0.01)
        narrow = dataclasses.replace(
            c.job, spec=dataclasses.replace(c.job.spec, head_dim_override=0)
        )
        assert tm.model_flops_per_token(narrow, causal=True) < 0.91 * table


def test_a_transformer_engine_ring_sends_k_v_at_the_k_v_heads():
    """TransformerEngine's p2p ring (Megatron-Core's cp) sends each K/V block as its grouped-query
    kernels take it; ours repeats it to the query heads first: H / KV times the bytes. The
    positions' all-gather and Ulysses' all-to-alls are the same."""
    spec = ModelSpec("decoder", 2, 1024, 16, 4, 2816, 32000, 8192)
    ours = Job(spec, A100, 8, seq_len=8192, global_batch=8)
    te = run_by(ours, Deviations("te", cp_kv_heads=True))
    ring = Layout(dp=2, cp=4)
    (mine, calls), (theirs, te_calls) = traffic.cp_traffic(ours, ring), traffic.cp_traffic(te, ring)
    assert theirs["send"] == mine["send"] * 4 / 16 and calls == te_calls
    assert theirs["all_gather"] == mine["all_gather"]
    uly = dataclasses.replace(ring, cp_mode="ulysses")
    assert traffic.cp_traffic(te, uly) == traffic.cp_traffic(ours, uly)


def test_stated_peak_memory_is_predicted_within_10_percent_like_for_like(runs):
    """Where a source says what its memory figure counts, the prediction is within the required
    10 %: our own H200 run's peak allocation against the planner's tensors, torchtitan's
    allocator reservation against the tensors and the reserve. (BLOOM's `Mem`, a whole device's
    use read off nvidia-smi, is not: benchmarks/published_runs.py prints it, 57 of 74 rows
    within 10 %.)"""
    cases, _ = runs.split_cases(runs.load_rows())
    checks = [c for c in runs.stated_memory(cases) if c[1] != "device"]
    assert {k for _, k, *_ in checks} == {"allocated", "reserved"}, checks
    for rid, _, stated, peak in checks:
        assert abs(peak / stated - 1) <= 0.10, (rid, stated, peak)


def _norm(x):
    """torchtitan's RMSNorm (its weight left out: ones): computed in fp32, cast back."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


class _TitanBlock(torch.nn.Module):
    """torchtitan's Llama block in miniature: fp32 RMSNorm, q/k/v/o projections with grouped
    k/v heads repeated for SDPA, SwiGLU MLP, in that forward order."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f, hd = spec.dim, spec.ffn_dim, spec.head_dim
        self.spec = spec
        shapes = {name: (k, n) for name, k, n, _ in act.linears(spec)}
        for name, (k, n) in shapes.items():
            setattr(self, name, torch.nn.Linear(k, n, bias=False))
        assert hd * spec.n_heads == h and f

    def forward(self, x):
        sp, (b, s, _) = self.spec, x.shape
        y = _norm(x)
        q = self.wq(y).view(b, s, sp.n_heads, -1).transpose(1, 2)
        rep = sp.n_heads // sp.n_kv_heads
        k = self.wk(y).view(b, s, sp.n_kv_heads, -1).transpose(1, 2).repeat_interleave(rep, 1)
        v = self.wv(y).view(b, s, sp.n_kv_heads, -1).transpose(1, 2).repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        z = _norm(x)
        return x + self.w2(F.silu(self.w1(z)) * self.w3(z))


def _op_policy(meta, ctx, func, *args, **kwargs):
    """torchtitan's per-op policy: save matmuls except every second one, and the fused
    attention (on the CPU, its flash kernel)."""
    mm = torch.ops.aten.mm.default
    save = {mm, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
    if func == mm:
        meta[key] += 1
    keep = func in save and not (func == mm and meta[key] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def test_per_op_selective_checkpointing_saves_what_torch_keeps():
    """activations.op_sac_terms against PyTorch's own selective checkpointing run with
    torchtitan's policy on its block: three blocks keep exactly three blocks' terms (the first
    block's input is made outside, the last block's output counted instead), in bf16."""
    spec = ModelSpec("decoder", 3, 64, 4, 2, 160, 100)
    s, b = 32, 2
    torch.manual_seed(0)
    blocks = [_TitanBlock(spec).to(torch.bfloat16) for _ in range(3)]
    x = torch.randn(b, s, spec.dim, dtype=torch.bfloat16, requires_grad=True)

    def context():  # a fresh count per block, as torchtitan's context_fn makes
        counts = {"forward_mm_count": 0, "recompute_mm_count": 0}
        return create_selective_checkpoint_contexts(functools.partial(_op_policy, counts))

    with LivePeak() as meter:
        y = x
        for block in blocks:
            y = checkpoint(
                block, y, use_reentrant=False, context_fn=context, preserve_rng_state=False
            )
        kept = meter.live
        y.float().sum().backward()
    assert kept == 3 * act.layer_bytes(act.op_sac_terms(spec, s, b, 2))
    # what it recomputes: every second matmul and the element-wise work, less than a forward
    job = Job(spec, A100, 8, seq_len=s, global_batch=8)
    titan = run_by(job, Deviations("titan", selective_ops=True))
    lay = Layout(dp=8, micro_batch=1, recompute="selective")
    fwd, _, attn = gpu.block_seconds(A100, spec, 1, 1, s, 2, False, A100.peak["bf16"])
    redo = gpu.op_recompute_seconds(A100, spec, 1, 1, s, 2, False, A100.peak["bf16"])
    assert attn < redo < fwd
    again = 2 * spec.n_layers * sum(k * n for _, k, n, _ in act.linears(spec)[1::2])
    base = tm.hardware_flops_per_token(titan, dataclasses.replace(lay, recompute="none"))
    assert tm.hardware_flops_per_token(titan, lay) == pytest.approx(base + again)


def test_an_upcast_loss_holds_two_fp32_logit_gradients():
    """torchtitan's loss, F.cross_entropy on the logits cast to fp32: log-softmax keeps its
    fp32 output, and its backward makes a new fp32 gradient while the loss's own is alive,
    8 bytes per logit over the kept 4 (ours: the fp32 gradient and a 16-bit copy, 4 + 2)."""
    from shardwise.plan import memory as mem

    n, v, h = 256, 2048, 32
    w = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    with LivePeak() as meter:
        logits = x @ w.t()
        loss = F.cross_entropy(logits.float(), torch.randint(0, v, (n,)))
        del logits
        loss.backward()
    assert meter.peak == 12 * n * v + 2 * 4  # and two fp32 scalars: the loss, its gradient
    spec = ModelSpec("decoder", 1, h, 4, 4, 64, v)
    job = Job(spec, A100, 1, seq_len=n, global_batch=1)
    titan = run_by(job, Deviations("titan", loss_upcast=True))
    one = Layout(micro_batch=1)
    assert mem.backward_transient(titan, one) == 8 * n * v
    assert mem.backward_transient(job, one) == (4 + 2) * n * v


def test_deepspeed_2021_gathers_into_a_list_of_per_rank_views():
    """DeepSpeed's 2021 ZeRO-3 (`_allgather_param`: torch.distributed.all_gather into a list
    of dp views): c10d copies the gathered tensor out slice by slice, a launch per rank per
    gather, so its cost grows with the data-parallel degree; its blocking calls hold only the
    tensor being gathered (twice: c10d's flat buffer) or used with its gradient."""
    from shardwise.plan import memory as mem

    spec = preset("175b")
    blocking = Deviations(
        "ds", block_memory="paper", unfused_attention=True, overlap_dp=False, zero3_per_tensor=True
    )
    listed = dataclasses.replace(blocking, list_all_gather=True)
    extra = {}
    for dp in (384, 1536):
        job = PeerJob(spec, A100, dp, seq_len=2048, global_batch=1536, deviations=blocking)
        lay = Layout(dp=dp, zero=3, micro_batch=1536 // dp, recompute="full")
        t_block = search.evaluate(job, lay)["time"]["dp_comm_s"]
        t_list = search.evaluate(run_by(job, listed), lay)["time"]
        launches = traffic.zero3_gathers(job, lay) * dp * A100.launch_s
        assert t_list["dp_comm_s"] - t_block > launches
        extra[dp] = t_list["dp_comm_s"] - t_block
        ag = traffic.traffic_by_kind(job, lay)["dp"]["all_gather"] * dp / (dp - 1)
        assert extra[dp] == pytest.approx(launches + 2 * ag / (A100.hbm_bw * A100.mem_eff))
    assert extra[1536] > 3 * extra[384]  # the copies' launches grow with the ranks
    # memory: the largest weight (the embedding here, 50,304 x h), gathered twice over or
    # held with its gradient
    job = PeerJob(spec, A100, 384, seq_len=2048, global_batch=1536, deviations=listed)
    lay = Layout(dp=384, zero=3, micro_batch=4, recompute="full")
    assert spec.vocab_size * spec.dim > spec.ffn_dim * spec.dim
    largest = -(-spec.vocab_size * spec.dim // 384) * 384 * 2
    assert mem.predict_memory(job, lay)["buffers"] == pytest.approx(2 * largest, rel=1e-3)


def test_a_bf16_optimizer_keeps_an_fp32_gradient_of_every_parameter_it_holds(runs):
    """DeepSpeed's BF16_Optimizer (BLOOM from 2022-02-28) accumulates gradients in fp32 beside
    the 16-bit ones: 4 bytes per parameter of the rank's tp shard, not split over dp. The
    runs a source says ran out of memory are built for the memory report, never timed."""
    from shardwise.plan import memory as mem

    spec = preset("175b")
    job = PeerJob(spec, A100, 64, seq_len=2048, global_batch=64, deviations=Deviations("megatron"))
    bf16 = run_by(job, Deviations("ds-bf16", fp32_grads=True))
    lay = Layout(tp=8, dp=8, zero=1, micro_batch=1, recompute="full")

    def numel(layout: Layout) -> int:
        us = mem.stage_units(job, layout, 0)
        return sum(u.count * sum(e[0] for e in u.entries if e[1]) for u in us)

    held = numel(lay)  # the tp shard: 1/8 of the model but its replicated norms and biases
    assert held == pytest.approx(numel(Layout(dp=64)) / 8, rel=0.01)
    extra = mem.predict_memory(bf16, lay)["grads"] - mem.predict_memory(job, lay)["grads"]
    assert extra == 4 * held
    rows = runs.load_rows()
    ooms, _ = runs.oom_cases(rows)
    timed, skipped = runs.split_cases(rows)
    assert len(ooms) >= 4 and all(c.oom and c.measured_s != c.measured_s for c in ooms)
    assert not {c.row["id"] for c in ooms} & {c.row["id"] for c in timed}
    reasons = dict(skipped)
    assert all(reasons[c.row["id"]].startswith("ran out of memory") for c in ooms)


def test_each_nccl_communicator_a_rank_uses_holds_device_memory():
    """NCCL's buffers, per communicator (NVIDIA/nccl issue #964, A100s: 688 MB a group, 544 MB
    a pair): ours uses the world's, one per parallel dimension and the pipeline's; DeepSpeed's
    pipeline a pair per neighbouring stage, and Megatron-DeepSpeed two groups and the tied
    embedding's pair more. None on one device, none on a CPU (gloo's are host memory)."""
    from shardwise.plan import memory as mem
    from shardwise.plan.hardware import get_hardware

    group, pair = A100.comm_buffer_bytes, A100.pair_buffer_bytes
    assert (group, pair) == (688 * 10**6, 544 * 10**6)
    job = Job(preset("7b"), A100, 64, seq_len=2048, global_batch=64)
    assert mem.communicator_bytes(job, Layout(tp=2, pp=4, dp=8)) == 4 * group
    assert mem.communicator_bytes(job, Layout(dp=64)) == 2 * group
    bloom = run_by(job, Deviations("md", pp_pairs=True, extra_groups=2, extra_pairs=1))
    assert mem.communicator_bytes(bloom, Layout(tp=2, pp=4, dp=8)) == 5 * group + 2 * pair
    assert mem.communicator_bytes(bloom, Layout(tp=8, pp=2, dp=4)) == 5 * group + 2 * pair
    assert mem.communicator_bytes(dataclasses.replace(job, devices=1), Layout()) == 0
    cpu = dataclasses.replace(job, hardware=get_hardware("cpu", calibrate=False))
    assert mem.communicator_bytes(cpu, Layout(tp=2, pp=4, dp=8)) == 0
    lay = Layout(tp=2, pp=4, dp=8, micro_batch=1)
    rec, plain = search.evaluate(job, lay), mem.predict_memory(job, lay)
    transient = mem.backward_transient(job, lay)
    assert rec["peak_bytes"] == int(plain["total"] + transient + A100.reserve + 4 * group)


def test_a_zero1_step_that_copies_gradients_can_set_the_peak():
    """DeepSpeed's ZeRO-1/2 step (`Deviations.step_grad_copies`; measured against DeepSpeed itself
    in test_zero_peers): the other ranks' 16-bit gradients freed, the rank's share copied to a
    16-bit flat buffer and to fp32. With the model states dominating (BLOOM's 02-17 runs) that
    moment, not backward, is the device's peak; shardwise's own step allocates none of it."""
    from shardwise.plan import memory as mem

    job = PeerJob(
        preset("175b"), A100, 64, seq_len=2048, global_batch=64, deviations=Deviations("mg")
    )
    ds = run_by(job, Deviations("ds", step_grad_copies=True))
    for dp in (1, 8):
        lay = Layout(tp=8, dp=dp, zero=1 if dp > 1 else 0, micro_batch=1, recompute="full")
        us = mem.stage_units(job, lay, 0)
        held = sum(u.count * sum(e[0] for e in u.entries if e[1]) for u in us)
        states = {k: v for k, v in mem.predict_memory(job, lay).items() if k != "activations"}
        states.pop("total")
        step = mem.step_peak(ds, lay)
        assert step == sum(states.values()) - 2 * held + 2 * held / dp + 6 * held / dp
        assert mem.step_peak(job, lay) == 0.0
        plain, copies = search.evaluate(job, lay), search.evaluate(ds, lay)
        overhead = mem.device_overhead(job, lay)  # the reserve and NCCL's communicators
        assert copies["peak_bytes"] == max(plain["peak_bytes"], int(step + overhead))
        if dp == 1:  # 22 bytes a parameter at the step
            assert copies["peak_bytes"] > plain["peak_bytes"]
    assert copies["peak_bytes"] == plain["peak_bytes"]  # dp 8: backward's peak is higher


def test_deepspeeds_pipeline_stages_keep_the_hidden_states_they_received_and_sent():
    """DeepSpeed's PipelineEngine (BLOOM's runs; `Deviations.pp_stage_copies`) keeps per micro-batch
    in flight the hidden state a stage received and the one it sent, beside the block inputs
    full recomputation saves: one more 16-bit s x b x h tensor on the first stage (what it
    sent), two on a middle one, one on the last (what it received). Model states and the
    step's time do not change."""
    from shardwise.plan import memory as mem

    job = PeerJob(
        preset("175b"), A100, 64, seq_len=2048, global_batch=64, deviations=Deviations("mg")
    )
    ds = run_by(job, Deviations("ds", pp_stage_copies=True))
    lay = Layout(tp=8, pp=4, pp_schedule="1f1b", dp=2, zero=1, micro_batch=2, recompute="full")
    hidden = 2 * 2048 * 2 * job.spec.dim  # one bf16 hidden state of the micro-batch
    for stage, kept in ((0, 1), (1, 2), (2, 2), (3, 1)):
        extra = mem.activation_bytes(ds, lay, stage) - mem.activation_bytes(job, lay, stage)
        assert extra == kept * hidden * (4 - stage)  # 1F1B: p - stage micro-batches in flight
    one = dataclasses.replace(lay, pp=1, pp_schedule="1f1b", dp=8)
    assert mem.activation_bytes(ds, one, 0) == mem.activation_bytes(job, one, 0)
    a, b = search.evaluate(job, lay), search.evaluate(ds, lay)
    assert a["step_time_s"] == b["step_time_s"]
    # the second stage holds the most where stages are short (p > L/p + 2): 24 stages of 3
    many = dataclasses.replace(lay, tp=2, pp=24, dp=1, zero=0, micro_batch=1)
    job72 = dataclasses.replace(ds, spec=dataclasses.replace(job.spec, n_layers=72))
    per_stage = [mem.activation_bytes(job72, many, st) for st in range(24)]
    assert max(per_stage) == per_stage[1] > per_stage[0]
    assert mem.predict_memory(job72, many)["activations"] == per_stage[1]
    assert {k: v for k, v in a["mem_bytes"].items() if k not in ("activations", "total")} == {
        k: v for k, v in b["mem_bytes"].items() if k not in ("activations", "total")
    }


def _gpt22b(peer: Deviations) -> Job:
    """Korthikanti et al.'s 22B (Table 3) on one A100 node, fp16."""
    spec = ModelSpec(
        arch="gpt2", n_layers=48, dim=6144, n_heads=64, n_kv_heads=64, ffn_dim=24576,
        vocab_size=51200, max_seq_len=2048, dropout=0.1, attn_dropout=0.1,
    )  # fmt: skip
    return PeerJob(spec, A100, 8, 2048, 4, "fp16", "fp16", deviations=peer)


def test_megatron_lm_recomputes_whole_blocks_and_regathers_for_sp():
    """Megatron-LM's full recomputation re-runs a layer's whole forward, both its tp
    all-reduces (sp: 4 halves), where ours stops at the last saved tensor (1; sp 3 halves);
    its sp all-gathers each norm's output again in backward (2 more all-gathers per layer).
    Counted in bytes and in calls."""
    ours, mg = _gpt22b(Deviations()), _gpt22b(Deviations("mg", recompute_whole_block=True))
    regather = _gpt22b(Deviations("mg", sp_regather=True))
    act = 4 * 2048 * 6144 * 2 * 7 / 8  # one half (all-gather or reduce-scatter) of a layer's
    for sp in (False, True):
        full = Layout(tp=8, sp=sp, micro_batch=4, recompute="full")
        a, b = traffic.traffic_by_kind(ours, full)["tp"], traffic.traffic_by_kind(mg, full)["tp"]
        extra = sum(b.values()) - sum(a.values())
        assert extra == pytest.approx(48 * act * (1 if sp else 2))  # 4 halves - 3; 2 AR - 1
        calls = (
            traffic.collective_calls(mg, full)["tp"] - traffic.collective_calls(ours, full)["tp"]
        )
        assert calls == 48 * 1
        rc = dataclasses.replace(full, recompute="selective")
        a, b = traffic.traffic_by_kind(ours, rc)["tp"], traffic.traffic_by_kind(regather, rc)["tp"]
        extra = b.get("all_gather", 0.0) - a.get("all_gather", 0.0)
        assert extra == pytest.approx(48 * 2 * act if sp else 0.0)
        calls = (
            traffic.collective_calls(regather, rc)["tp"] - traffic.collective_calls(ours, rc)["tp"]
        )
        assert calls == (48 * 2 if sp else 0)


def test_megatron_2022_hides_backwards_tp_reduction_but_not_the_recomputed_forwards():
    """Korthikanti et al. §6.2: full recomputation costs 39 %, not the expected 33 %, because
    backward's all-reduce runs behind the weight-gradient GEMMs and the recomputed forward's
    all-reduces have nothing to hide behind (`Deviations.tp_overlap_backward`)."""
    mg = Deviations("mg", recompute_whole_block=True, sp_regather=True)
    plain, hiding = _gpt22b(mg), _gpt22b(dataclasses.replace(mg, tp_overlap_backward=True))

    def tp(job, rc, sp=False):
        lay = Layout(tp=8, sp=sp, micro_batch=4, recompute=rc)
        return search.evaluate(job, lay)["time"]["tp_comm_s"]

    def step(job, rc, sp=False):
        return search.evaluate(job, Layout(tp=8, sp=sp, micro_batch=4, recompute=rc))

    # a layer's 2 backward all-reduces (of 4; 6 with recompute) are hidden whole, in both
    # modes: on this shape the weight-gradient GEMMs take longer than they do
    act = 4 * 2048 * 6144 * 2
    one = 2 * act * 7 / 8 / (A100.intra_bw * A100.comm_eff) + A100.latency
    _, wgrad = gpu.backward_gemm_seconds(A100, plain.spec, 8, 4 * 2048, 2, A100.peak["fp16"])
    assert wgrad > 2 * one
    for rc in ("none", "full"):
        assert tp(plain, rc) - tp(hiding, rc) == pytest.approx(48 * 2 * one)
    # so recomputation's overhead grows when backward hides its communication
    over = {
        name: step(j, "full")["step_time_s"] / step(j, "none")["step_time_s"]
        for name, j in (("plain", plain), ("hiding", hiding))
    }
    assert over["hiding"] > over["plain"]
    # with sp, the reduce-scatters and the re-gathers hide; the backward's other all-gathers
    # (the reduce-scatter's conjugate) stay exposed
    assert 0 < tp(plain, "none", sp=True) - tp(hiding, "none", sp=True) < tp(plain, "none", sp=True)
    cpu = dataclasses.replace(hiding, hardware=get_hardware("cpu", calibrate=False))
    assert tp(cpu, "none") == tp(run_by(cpu, mg), "none")  # GPUs only


def test_korthikantis_per_layer_overheads_are_predicted(runs):
    """Korthikanti et al.'s Table 4 (one 22B layer by recomputation and sp, not a calibration
    input): the planner's overhead of each mode against the baseline layer within 3 points of
    the measured one (the table gives ms to 0.1, half a point of a 20 ms layer), and the
    layer itself within 10 %."""
    times = runs.layer_times(runs.load_rows())
    assert [t[0] for t in times][:1] == ["Baseline no recompute"] and len(times) == 5
    (_, meas0, pred0), *rest = times
    for name, meas, pred in rest:
        assert abs((pred / pred0 - 1) - (meas / meas0 - 1)) <= 0.03, (name, meas, pred)
    for name, meas, pred in times:
        assert abs(pred / meas - 1) <= 0.10, (name, meas, pred)


def test_misaligned_gemm_dimensions_are_flagged_on_gpus():
    """The planner prices GEMMs by size, not alignment, and BLOOM's 14400-wide runs (head
    dims 450, 225, 150) are its held-out worst: `explain`/`plan` warn on a GPU when a 16-bit
    GEMM dimension is not a multiple of 8, with heads that fix it; not on the CPU, not in fp32,
    not for 13824 x 64 heads."""
    from shardwise.config import load_config
    from shardwise.job.explain import alignment_warning, explain_record

    def spec(dim: int, heads: int) -> ModelSpec:
        return ModelSpec("decoder", 2, dim, heads, vocab_size=512, ffn_dim=4 * dim)

    a100, cpu = get_hardware("a100-80gb"), get_hardware("cpu")
    line = alignment_warning(spec(14400, 32), "bf16", a100, tp=8)
    assert "head dim 450" in line and "--model.n_heads=30 (head dim 480)" in line
    assert alignment_warning(spec(13824, 64), "bf16", a100, tp=8) is None
    assert alignment_warning(spec(14400, 32), "bf16", cpu) is None
    assert alignment_warning(spec(14400, 32), "fp32", a100) is None
    only_tp = alignment_warning(spec(8288, 28), "bf16", a100, tp=8)  # head dim 296
    assert only_tp.startswith("warning: width per tp rank 1036:") and "Fix" not in only_tp
    args = ["--model.dim=1800", "--model.n_heads=4", "--model.n_layers=1"]
    cfg = load_config(None, [*args, "--model.vocab_size=512", "--precision.compute=bf16"])
    (shown,) = explain_record(cfg, 2, a100)["warnings"]  # head dim 450 again
    assert shown.startswith("warning: head dim 450")


def test_a_misaligned_head_dim_slows_the_unfused_attention_gemms_only(runs):
    """`Hardware.misaligned_slowdown` multiplies the unfused attention's 16-bit batched GEMMs
    when the head dim is off the 8-element alignment, nothing else; the A100's value is what
    `fit_misaligned` returns on the named pair (13824 wide, 128 heads vs 96, one layout)."""
    hw = get_hardware("a100-80gb")
    assert hw.misaligned_slowdown > 1
    plain = hw.with_overrides(misaligned_slowdown=1.0)
    peak = hw.peak["bf16"]

    def attn(h: ModelSpec, hw, c=2, unfused=True) -> float:
        return sum(gpu._attention(hw, h, 8, 4, 2048, c, peak, unfused))

    odd = ModelSpec("gpt2", 2, 13824, 128, 128, 4 * 13824, 512)  # head dim 108
    even = ModelSpec("gpt2", 2, 13824, 96, 96, 4 * 13824, 512)  # 144
    gemms = 6 * 4 * (128 / 8) * (gpu._gemm(hw, 2, 2048, 2048, 108, peak) - hw.kernel_s)
    extra = attn(odd, hw) - attn(odd, plain)
    assert extra == pytest.approx((hw.misaligned_slowdown - 1) * gemms, rel=1e-9)
    for spec, kw in ((even, {}), (odd, {"unfused": False}), (odd, {"c": 4})):
        assert attn(spec, hw, **kw) == attn(spec, plain, **kw)
    rows = {r["id"]: r for r in runs.load_rows()}
    pair = [runs.make_case(rows[rid]) for rid in runs.MISALIGNED_PAIR]
    fitted = runs.fit_misaligned(pair, None)
    assert fitted == pytest.approx(hw.misaligned_slowdown, abs=0.05)
