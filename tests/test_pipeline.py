"""Pipeline parallelism reproduces the single-process run: every schedule at p = 2 (× dp 2)
and p = 4, m ∈ {p, 2p}, interleaved with v = 2, ZeRO-1 and tied embeddings; 1F1B holds at
most p micro-batches of activations on the first stage where GPipe holds m; pp traffic is
exactly the activations and gradients the plan sends.

One 4-rank world runs every pipeline case beside the 1-process world of the references and
the 8-rank 3D world."""

import pytest

from shardwise.config import load_config
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_named, run_named_worlds
from shardwise.parallel.schedules import Pass, build_plan
from shardwise.plan.hardware import get_hardware
from shardwise.plan.stage_chunks import interleaved_peak
from support.compare import VOCAB, case, max_rel

pytestmark = pytest.mark.slow

SCHEDULES = {
    "gpipe": ["--parallel.pp_schedule=gpipe"],
    "1f1b": ["--parallel.pp_schedule=1f1b"],
    "zb": ["--parallel.pp_schedule=zb"],
    "interleaved": ["--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"],
}
TIED = "--model.tie_embeddings=true"
# Global batch 8. pp 2 × dp 2: micro-batch 2 or 1 gives m = 2 or 4 (p, 2p); pp 4 × dp 1:
# micro-batch 2 or 1 gives m = 4 or 8. The m = p cases also cover tied embeddings (and ZeRO-1
# at pp 2), so 16 cases cover every schedule, p, m and option once.
LAYOUTS = {
    "pp2_{}_m2_z1_tied": ["--parallel.pp=2", "--train.micro_batch=2", "--parallel.zero=1", TIED],
    "pp2_{}_m4": ["--parallel.pp=2", "--train.micro_batch=1"],
    "pp4_{}_m4_tied": ["--parallel.pp=4", "--train.micro_batch=2", TIED],
    "pp4_{}_m8": ["--parallel.pp=4", "--train.micro_batch=1"],
}


def _layers(name: str) -> int:
    """4 blocks, except 8 for pp 4 × v 2 = 8 chunks (each chunk holds at least one)."""
    return 8 if name.startswith("pp4_interleaved") else 4


def _ref(name: str) -> str:
    tied, drop = "_tied" * ("tied" in name), "_drop" * ("_drop" in name)
    return f"ref{_layers(name)}{tied}{drop}" + SHORT_SUFFIX * name.endswith(SHORT_SUFFIX)


EVAL = "--train.eval_batches=1"  # one held-out batch at the end, forwards through the stages
WORLD4 = {
    layout.format(s): case(f"--model.n_layers={_layers(layout.format(s))}", EVAL, *flags, *extra)
    for layout, extra in LAYOUTS.items()
    for s, flags in SCHEDULES.items()
}
# Beyond the required 20-step matrix, 6 steps against a 6-step reference (a wrong gradient
# shows from step 2; at 20 steps the two cost as much as six matrix cases)
SHORT_STEPS = 6
SHORT, SHORT_SUFFIX = f"--train.steps={SHORT_STEPS}", f"_{SHORT_STEPS}steps"
# dropout (layout-free masks) through the split backward, with whole blocks recomputed in I:
# the recomputation runs zero bubble's deferring linear layers and norms as the forward did
# (checkpoint compares what both saved), and draws the forward's masks again
DROPOUT = ["--model.dropout=0.1", "--model.attn_dropout=0.1", "--memory.recompute=full"]
WORLD4["pp2_zb_m4_drop_6steps"] = case(*WORLD4["pp2_zb_m4"]["overrides"], *DROPOUT, SHORT)
# pp 2 × tp 2 with sequence parallelism: the deferring linear layers are the tp shards
TP_SP = ["--parallel.pp=2", "--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=2"]
WORLD4["pp2_zb_m4_tp2_sp_tied_6steps"] = case(
    "--model.n_layers=4", EVAL, TIED, *TP_SP, *SCHEDULES["zb"], SHORT
)
# and without sp: every tp collective an all-reduce, the stages sending whole sequences
TP_ONLY = [x for x in TP_SP if x != "--parallel.sp=true"]
WORLD4["pp2_1f1b_m4_tp2_tied_6steps"] = case("--model.n_layers=4", EVAL, TIED, *TP_ONLY, SHORT)
# evaluations during training (steps 5, 10, 15) send activations too: none of that traffic may
# count towards the next training step's comm_bytes (test_pp_bytes_are_...)
WORLD4["pp2_gpipe_m4"] = case(*WORLD4["pp2_gpipe_m4"]["overrides"], "--train.eval_every=5")
# Beside the parity matrix (no single-process reference: explain is their reference), one step
# each. LoRA under pp 2 × tp 2 + sp: stage 0 sums over tp the adapter gradients of its own two
# blocks only (explain summed all four: 28,672 B more than measured). The MoE decoder with an
# MoE MLP every 2nd block, interleaved over pp 2 × tp 2 + sp: stage 0 holds chunks 0 and 2,
# blocks 0 and 2, both dense (explain counted 2 // 2 = 1 MoE layer: 821,504 B and 12 calls off)
EXPLAINED4 = {
    "lora_pp2_1f1b_m4_tp2_sp": case(
        "--model.n_layers=4", *TP_SP, "--finetune.lora_rank=4", "--train.steps=1"
    ),
    "moe_every2_pp2_interleaved_m4_tp2_sp": case(
        "--model.name=moe-tiny",
        "--model.n_layers=4",
        "--model.moe_every=2",
        *TP_SP,
        *SCHEDULES["interleaved"],
        "--train.steps=1",
    ),
}
# uneven chunks (interleaved, pp 2 × v 2): 5 blocks cut (0) (3) | (1, 2) (4), 6 blocks (0) (3, 4)
# | (1, 2) (5); the formula's even spread over the chunks held was 16.6 % short and 7.1 % over
UNEVEN4 = {
    f"pp2_interleaved_m4_{n}layers": case(
        *WORLD4["pp2_interleaved_m4"]["overrides"], f"--model.n_layers={n}", "--train.steps=1"
    )
    for n in (5, 6)
}
WORLD1 = {
    f"ref{n}{t}": case(f"--model.n_layers={n}", EVAL, *([TIED] if t else []))
    for n in (4, 8)
    for t in ("", "_tied")
}
WORLD1["ref4_drop" + SHORT_SUFFIX] = case(*WORLD1["ref4"]["overrides"], *DROPOUT, SHORT)
WORLD1["ref4_tied" + SHORT_SUFFIX] = case(*WORLD1["ref4_tied"]["overrides"], SHORT)


RESUME = "resume_pp2_zb_m4_z1_tied"
SAVED = "pp2_1f1b_m4"  # also saves at step 10; resumed in a data-parallel-only layout
SAVES: dict[str, str] = {}  # case name -> its checkpoint directory


def _saves(tmp_path_factory, name: str) -> list[str]:
    """Overrides that make case `name` save at step 10 (of 20), noted in SAVES."""
    root = tmp_path_factory.mktemp("saved")
    SAVES[name] = str(root / "step-00000010")
    return ["--checkpoint.every=10", f"--checkpoint.dir={root}"]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    # The tied 1-process reference also saves at step 10; a pp 2 × dp 2 ZeRO-1 zero-bubble
    # run resumes from it (a checkpoint is layout-free: the tied head is stored once).
    ckpt = tmp_path_factory.mktemp("ckpt")
    world1 = dict(WORLD1)
    world1["ref4_tied"] = case(
        *WORLD1["ref4_tied"]["overrides"], "--checkpoint.every=10", f"--checkpoint.dir={ckpt}"
    )
    world4 = {**WORLD4, **EXPLAINED4, **UNEVEN4}
    world4[SAVED] = case(*WORLD4[SAVED]["overrides"], *_saves(tmp_path_factory, SAVED))
    world4[RESUME] = case(
        *WORLD4["pp2_zb_m2_z1_tied"]["overrides"],
        "--train.micro_batch=1",
        f"--checkpoint.resume={ckpt}/step-00000010",
    )
    # the 3D world too: the three worlds side by side keep both cores busy
    world8 = {"3d": case(*CASE_3D["overrides"], *_saves(tmp_path_factory, "3d")), **MOE_3D}
    return run_named_worlds({1: world1, 4: world4, 8: world8})


def _stage(name: str, rank: int) -> int:
    pp = int(name[2])
    return rank // (4 // pp)  # ranks are laid out pp-major: (pp, dp) row-major


@pytest.mark.parametrize("name", list(WORLD4))
def test_pipeline_matches_single_process(worlds, name):
    ref = worlds[1][_ref(name)][0]
    got = worlds[4][name]
    last = got[3]  # a rank of the last stage
    short = name.endswith(SHORT_SUFFIX)
    assert len(last["losses"]) == len(ref["losses"]) == (SHORT_STEPS if short else 20)
    # every rank reports the global loss (the last stage's, summed over dp)
    for r in got:
        assert max_rel(r["losses"], ref["losses"]) <= 1e-5, name
    assert max_rel([last["records"][-1]["eval_loss"]], [ref["records"][-1]["eval_loss"]]) <= 1e-5
    assert ref["losses"][-1] < ref["losses"][0] - (0.1 if short else 0.5)  # and it trained
    # each stage's parameters are the reference's; together they are the whole model once.
    # Compared tensor by tensor in relative L2: element-wise, Adam divides every coordinate
    # by its own RMS, so a gradient entry that is zero up to fp32 rounding (summed in another
    # order by another layout) can move by up to ±lr per step (testing/compare.py); a few
    # such entries of the embedding differ by ~1e-5 while the tensors agree to ~1e-7.
    seen = set()
    for rank, r in enumerate(got):
        for key, value in r["params"].items():
            ref_key = "embed.weight" if key == "head.weight" and "tied" in name else key
            want = ref["params"][ref_key]
            rel = ((value - want).norm() / want.norm()).item()
            assert rel <= 1e-5, (name, rank, key, rel)
            seen.add(ref_key)
    assert seen == set(ref["params"])


def test_resume_from_a_single_process_checkpoint(worlds):
    ref, got = worlds[1]["ref4_tied"][0], worlds[4][RESUME]
    for r in got:  # steps 11..20 continue the reference exactly as far as fp32 allows
        assert len(r["losses"]) == 10
        assert max_rel(r["losses"], ref["losses"][10:]) <= 1e-5


@pytest.mark.parametrize("name", [*(n for n in WORLD4 if "tied" in n), RESUME])
def test_tied_weight_identical_on_first_and_last_stage(worlds, name):
    got = worlds[4][name]
    first, last = got[0]["params"], got[3]["params"]
    assert "head.weight" not in first and "embed.weight" not in last
    assert (first["embed.weight"] - last["head.weight"]).abs().max().item() == 0.0


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_holds_p_micro_batches_where_gpipe_holds_m(worlds, pp):
    """Measured saved-activation bytes on the first stage, m = 2p."""
    m = 2 * pp
    gpipe = worlds[4][f"pp{pp}_gpipe_m{m}"][0]["records"][-1]["pipeline"]
    one = worlds[4][f"pp{pp}_1f1b_m{m}"][0]["records"][-1]["pipeline"]
    assert gpipe["in_flight"][0] == m and one["in_flight"][0] == pp
    per_mb = one["act_per_mb"][0]
    assert per_mb > 0 and gpipe["act_per_mb"][0] == per_mb
    assert gpipe["act_peak"][0] == m * per_mb
    assert one["act_peak"][0] == pp * per_mb
    rec = worlds[4][f"pp{pp}_1f1b_m{m}"][0]["records"][-1]
    assert rec["mem_bytes"]["activations"] == max(one["act_peak"])


def _act_bytes(micro: int) -> int:
    return micro * 32 * 128 * 4  # micro-batch × seq_len × dim, fp32


@pytest.mark.parametrize("name", ["pp4_1f1b_m8", "pp2_gpipe_m4", "pp4_interleaved_m8", "pp2_zb_m4"])
def test_pp_bytes_are_the_activations_and_gradients_sent(worlds, name):
    pp, m = int(name[2]), int(name.rsplit("m", 1)[1])
    v = 2 if "interleaved" in name else 1
    act = _act_bytes(8 // (4 // pp) // m)  # global batch 8 over dp = 4 / pp
    for rank, r in enumerate(worlds[4][name]):
        stage = _stage(name, rank)
        # each chunk sends its output forward (but the last) and its input gradient back
        # (but the first); p2p counts the bytes sent
        chunks = [k * pp + stage for k in range(v)]
        sends = sum((c < pp * v - 1) + (c > 0) for c in chunks)
        for rec in r["records"]:
            assert rec["comm_bytes"]["pp"] == sends * m * act, (name, rank)


def _zero1_padded(params: dict) -> int:
    """Elements of this stage's ZeRO-1 units (one per block, one per other top-level module),
    each padded to a multiple of dp = 2."""
    units: dict[str, int] = {}
    for key, value in params.items():
        parts = key.split(".")
        root = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        units[root] = units.get(root, 0) + value.numel()
    return sum(-(-n // 2) * 2 for n in units.values())


@pytest.mark.parametrize("rank", [0, 3])
def test_tied_sum_and_zero1_traffic(worlds, rank):
    """ZeRO-1 with pp: one reduce-scatter and one all-gather per step over dp (not one per
    micro-batch); the tied gradient crosses the pipeline once per step, and only this rank's
    reduced half of it (an all-reduce over 2 ranks counts 2·(2-1)/2·S = S)."""
    r = worlds[4]["pp2_1f1b_m2_z1_tied"][rank]
    tied = r["params"]["embed.weight" if rank == 0 else "head.weight"].numel() * 4
    padded = _zero1_padded(r["params"])
    for rec in r["records"]:
        assert rec["comm_bytes"]["pp"] == 2 * _act_bytes(2) + tied / 2
        assert rec["comm_bytes"]["dp"] == 2 * (2 - 1) / 2 * padded * 4


def test_dp_reduces_once_per_step(worlds):
    """DP all-reduce of this stage's parameters once per step, whatever m."""
    for s in SCHEDULES:
        r = worlds[4][f"pp2_{s}_m4"][0]
        n = sum(p.numel() for p in r["params"].values())
        assert r["records"][-1]["comm_bytes"]["dp"] == 2 * (2 - 1) / 2 * n * 4, s


def test_bubble_is_reported_per_stage(worlds):
    rep = worlds[4]["pp4_1f1b_m8"][0]["records"][-1]["pipeline"]
    assert rep["schedule"] == "1f1b" and len(rep["bubble"]) == 4
    assert all(0.0 < b < 1.0 for b in rep["bubble"])
    assert all(0.0 < busy <= rep["makespan_s"] for busy in rep["busy_s"])


# -- 3D: pp 2 × dp 2 × tp 2 (8 ranks), ZeRO-1, tied embeddings, sequence parallelism ------------

CASE_3D = case(
    "--model.n_layers=4",
    EVAL,
    TIED,
    "--parallel.pp=2",
    "--parallel.tp=2",
    "--parallel.sp=true",
    "--parallel.zero=1",
    "--train.micro_batch=1",  # m = 8 / (1 · dp 2) = 4
)


@pytest.fixture(scope="module")
def world8(worlds):
    return worlds[8]["3d"]


def test_pipeline_checkpoints_resume_as_data_parallel_only(worlds, world8):
    """The reshard matrix's pp2 -> pp1 and 3D -> dp only: the step-10 checkpoints of pp 2 × dp 2
    1F1B and of pp 2 × dp 2 × tp 2 + sp ZeRO-1 (tied) resume as dp 2 (ZeRO-1 for the 3D one)
    and continue the single-process run within 1e-5."""
    resumed = run_named(
        2,
        {
            name: case("--model.n_layers=4", *extra, f"--checkpoint.resume={SAVES[name]}")
            for name, extra in ((SAVED, []), ("3d", [TIED, "--parallel.zero=1"]))
        },
    )
    for name, ref in ((SAVED, "ref4"), ("3d", "ref4_tied")):
        want = worlds[1][ref][0]["losses"][10:]
        for r in resumed[name]:
            assert len(r["losses"]) == 10
            assert max_rel(r["losses"], want) <= 1e-5, name


def test_3d_matches_single_process(worlds, world8):
    ref = worlds[1]["ref4_tied"][0]
    for r in world8:  # ranks (pp, dp, tp) row-major: 0-3 the first stage, 4-7 the last
        assert max_rel(r["losses"], ref["losses"]) <= 1e-5
    assert (
        max_rel([world8[7]["records"][-1]["eval_loss"]], [ref["records"][-1]["eval_loss"]]) <= 1e-5
    )
    seen = set()
    for rank, r in enumerate(world8):  # tp shards and ZeRO slices gathered to full shape
        for key, value in r["params"].items():
            want = ref["params"]["embed.weight" if key == "head.weight" else key]
            rel = ((value - want).norm() / want.norm()).item()
            assert rel <= 1e-5, (rank, key, rel)
            seen.add("embed.weight" if key == "head.weight" else key)
    assert seen == set(ref["params"])
    # the tied weight: identical on the first and the last stage
    assert (
        world8[0]["params"]["embed.weight"] - world8[7]["params"]["head.weight"]
    ).abs().max() == 0


def test_3d_sends_sequence_shards(world8):
    """With sp the activation sent between stages is this tp rank's sequence shard: micro-batch
    1 × 32/2 tokens × 128 × 4 bytes; plus, once per step, the tied gradient's ZeRO-1 slice of
    this rank's vocabulary shard (VOCAB/2 × 128 / dp 2 elements) summed over the two ends."""
    shard = 1 * 16 * 128 * 4
    tied = VOCAB // 2 * 128 // 2 * 4
    for rank in (0, 7):
        for rec in world8[rank]["records"]:
            assert rec["comm_bytes"]["pp"] == 4 * shard + tied, rank
            assert rec["comm_bytes"]["tp"] > 0 and rec["comm_bytes"]["dp"] > 0


@pytest.mark.parametrize(
    "name", [*(n for n in WORLD4 if "tp2" not in n and "drop" not in n), *UNEVEN4]
)
def test_explain_prices_every_schedules_activations(worlds, name):
    """explain's activations (the busiest stage's) equal the largest measured on any rank, for
    every schedule, p and m. Interleaved with m = p runs every forward first (no steady state),
    so its last stage holds every micro-batch's logits and loss, as GPipe's does (explain held
    one: 7.0 % and 10.5 % short). Interleaved with m = 2p: the first stage's peak comes in the
    steady state, holding 4 forwards of its first chunk (which embeds: its token ids) and 1 of
    its second at p 2, 8 and 3 at p 4 (explain spread the ids evenly over the 5 and 11 chunks
    held: 396 and 660 B short of 1,807,136 and 3,975,488); explain replays the schedule, and
    so prices uneven chunks too (UNEVEN4: measured 2,167,296 and 2,529,304 B; the even spread
    said 1,806,740 and 2,709,780)."""
    cfg = load_config(None, {**WORLD4, **UNEVEN4}[name]["overrides"])
    pred = explain_record(cfg, 4, get_hardware("cpu", calibrate=False))["mem_bytes"]
    got = max(r["records"][-1]["mem_bytes"]["activations"] for r in worlds[4][name])
    assert pred["activations"] == got, (pred["activations"], got)


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_interleaved_peak_is_the_schedules_replayed_peak(p, v):
    """The planner's interleaved peak, whose replay stops at 3p micro-batches (the steady
    state repeats every p·v passes), equals the whole schedule's replay for every stage and
    m up to 6p, chunks saving different bytes (as the first chunk's ids make them)."""
    chunk_bytes = (1000.0, 7.0, 300.0)[:v]
    for m in range(p, 6 * p + 1, p):
        for stage in range(p):
            held = peak = 0.0
            for a in build_plan("interleaved", p, m, v)[stage]:
                held += chunk_bytes[a.chunk] * (1 if a.kind is Pass.F else -1)
                peak = max(peak, held)
            assert interleaved_peak(p, m, v, stage, chunk_bytes) == peak, (p, m, v, stage)


# The MoE decoder in 3D (pp 2 × dp 2 × tp 2 + sp, ZeRO-1): its MoE layers' whole parameters
# make most of the partial gradients summed over tp, and under ZeRO-1 a rank sums only those
# inside its own slices (rank 0: 123,264 of stage 0's 271,104 elements)
MOE_3D = {
    "moe_3d_z1": case(
        "--model.name=moe-tiny",
        "--parallel.pp=2",
        "--parallel.tp=2",
        "--parallel.sp=true",
        "--parallel.zero=1",
        "--train.micro_batch=1",
        SHORT,
    )
}
# rank 0's traffic as explain prices it: (world size, the case's overrides)
EXPLAINED = {
    **{n: (4, WORLD4[n]["overrides"]) for n in ("pp2_1f1b_m4", "pp2_1f1b_m2_z1_tied")},
    **{n: (4, WORLD4[n]["overrides"]) for n in ("pp4_1f1b_m8", "pp4_interleaved_m8")},
    **{n: (4, WORLD4[n]["overrides"]) for n in WORLD4 if "_tp2" in n},
    "3d": (8, CASE_3D["overrides"]),
    "moe_3d_z1": (8, MOE_3D["moe_3d_z1"]["overrides"]),
    **{n: (4, c["overrides"]) for n, c in EXPLAINED4.items()},
}


@pytest.mark.parametrize("name", list(EXPLAINED))
def test_explain_prices_rank_0s_traffic(worlds, name):
    """explain's dp, tp and pp bytes and calls are rank 0's measured ones, pipeline stage 0's:
    its own blocks' tp collectives and the embedding's, none of the head's, the vocabulary-
    parallel loss's or the final norm's (sp: the norms' partial gradients of its blocks only;
    the MoE decoder: its MoE layers' MLPs whole, their partial gradients inside rank 0's ZeRO-1
    slices); one send per micro-batch and chunk but the last chunk's forward and the first
    chunk's backward (p = 4: forward only; interleaved: 3); the tied gradient's sum over the
    two ends (ZeRO-1: its slice). LoRA: its own blocks' adapter gradients; MoE layers counted
    from the indices of the blocks the stage holds (EXPLAINED4)."""
    size, overrides = EXPLAINED[name]
    pred = explain_record(load_config(None, overrides), size, get_hardware("cpu", calibrate=False))
    got = worlds[size][name][0]["records"][-1]
    for dim in ("dp", "tp", "pp"):
        assert pred["comm_bytes"][dim] == got["comm_bytes"][dim], (dim, pred, got)
        assert pred["comm_calls"][dim] == got["comm_calls"][dim], (dim, pred, got)


def test_explain_prices_lora_under_pp_and_tp_memory(worlds):
    """LoRA under pp 2 × tp 2 + sp: explain's memory is the measured (max over ranks) in
    every category, activations included."""
    name = "lora_pp2_1f1b_m4_tp2_sp"
    cfg = load_config(None, EXPLAINED4[name]["overrides"])
    pred = explain_record(cfg, 4, get_hardware("cpu", calibrate=False))["mem_bytes"]
    ran = [r["records"][-1]["mem_bytes"] for r in worlds[4][name]]
    for key, value in pred.items():
        assert value == max(r[key] for r in ran), (key, value, [r[key] for r in ran])
