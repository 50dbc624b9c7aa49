"""The MoE decoder composed with pipeline parallelism, tensor + sequence parallelism and expert
parallelism beside them, against the single process.

fp32, moe-tiny at 2 blocks (both MoE), balance loss and bias balancing on, dropless and with a
capacity factor (plus a shared expert). Each layout must reproduce the single process's losses
and gradient norms every step within 1e-5 relative, its first step's reduced gradients tensor
by tensor, its parameters after the Adam steps, and the per-layer expert loads and dropped
tokens exactly (every stage reports every layer; every tp rank counts its own tokens once).
One 2-rank and one 4-rank world run every multi-rank case, one process the references; then a
checkpoint of the composed layouts resumes in another one."""

from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.io import read_index
from shardwise.config import Config, load_config
from shardwise.errors import ConfigError
from shardwise.job.explain import explain_record
from shardwise.job.prepare import run_job_here
from shardwise.launchers.harness import run_named_worlds
from shardwise.plan.hardware import get_hardware
from shardwise.training.loop import fit
from shardwise.training.validate import derive
from support.compare import assert_reproduces, case, worst_tensor

pytestmark = pytest.mark.slow

STEPS = 6
HALF = "step-00000003"
MOE = ["--model.name=moe-tiny", f"--train.steps={STEPS}", "--optim.warmup_steps=2"]
BALANCE = ["--train.moe_aux_loss=0.01", "--train.moe_bias_balance=0.01"]
CAPACITY = ["--model.capacity_factor=1.0", "--model.n_shared_experts=1"]
MICRO = ["--train.micro_batch=2"]  # several micro-batches in flight through the pipeline
PP = ["--parallel.pp=2", *MICRO]
GPIPE = [*PP, "--parallel.pp_schedule=gpipe"]
INTERLEAVED = ["--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"]
EP_PP = ["--parallel.ep=2", *PP]
TP = ["--parallel.tp=2", "--parallel.sp=true"]
EP_TP = ["--parallel.ep=2", *TP]
WORLDS = {  # name: (overrides, ranks, the single-process reference)
    "pp2": (PP, 2, "ref"),
    "pp2_gpipe": (GPIPE, 2, "ref"),
    "pp2_capacity": ([*PP, *CAPACITY], 2, "ref_capacity"),
    # block 1 only is MoE: the first stage holds no MoE layer, yet reports it
    "pp2_every2": ([*PP, "--model.moe_every=2"], 2, "ref_every2"),
    # 4 blocks in 4 chunks, two per rank: a rank tallies each chunk's layers apart
    "pp2_interleaved": ([*PP, *INTERLEAVED, "--model.n_layers=4"], 2, "ref_4_blocks"),
    "ep2_pp2": (EP_PP, 4, "ref"),
    "ep2_pp2_z1_capacity": ([*EP_PP, "--parallel.zero=1", *CAPACITY], 4, "ref_capacity"),
    "tp2_sp": (TP, 2, "ref"),
    "tp2_sp_capacity": ([*TP, *CAPACITY, *MICRO], 2, "ref_capacity"),
    # each block's forward, the tp count exchange included, runs again inside its backward
    "tp2_sp_recompute": ([*TP, "--memory.recompute=full"], 2, "ref"),
    "ep2_tp2_sp": (EP_TP, 4, "ref"),
    # ZeRO-1: the expert slices sharded over their edp group, which holds the tp ranks
    "ep2_tp2_sp_z1_capacity": ([*EP_TP, "--parallel.zero=1", *CAPACITY], 4, "ref_capacity"),
    # each stage's MoE layer whole on every tp rank of it, on its sequence shard
    "pp2_tp2_sp": ([*PP, *TP], 4, "ref"),
}
GRADS = {  # one step's reduced gradients at full shape (ZeRO-0: every rank holds its own)
    "grads_pp2": (PP, 2),
    "grads_ep2_pp2": (EP_PP, 4),
    "grads_tp2_sp": (TP, 2),
    "grads_ep2_tp2_sp": (EP_TP, 4),
}
PEER = {"peer": "test_moe_composed:first_grads"}
CPU = get_hardware("cpu", calibrate=False)


def first_grads(cfg: Config) -> dict:
    """One optimizer step; every gradient this rank applies (tp partial sums reduced, tp and
    ep slices gathered to full shape), as the optimizer hands them to the update; inside the job
    layer (`run_job_here`: run dir locked, run closed), as training runs."""
    return run_job_here(cfg, None, _first_grads)


def _first_grads(run) -> dict:
    """`first_grads`'s body on the built run."""
    grads: dict[str, torch.Tensor] = {}
    apply = run.optimizer.update.apply

    def capture(values: list[torch.Tensor]) -> None:
        for t, g in zip(run.optimizer.targets, values, strict=True):
            grads[t.name] = g.detach().float().clone()
        apply(values)

    run.optimizer.update.apply = capture
    records = fit(run)
    grads = run.tp.full_parameters(grads, run.info.device)
    if run.expert_parallel is not None:
        grads = run.expert_parallel.full_parameters(grads, run.info.device)
    return {"losses": [r["loss"] for r in records], "grads": {k: v.cpu() for k, v in grads.items()}}


def _case(*extra: str, **more) -> dict:
    return case(*MOE, *BALANCE, *extra, **more)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("moe_composed")
    worlds: dict[int, dict] = {1: {}, 2: {}, 4: {}}
    for name, (extra, n, _) in WORLDS.items():
        worlds[n][name] = _case(*extra)
    for name, (extra, n) in GRADS.items():
        worlds[n][name] = _case(*extra, "--train.steps=1", **PEER)
    saves = ["--checkpoint.every=3", f"--checkpoint.dir={root / 'ep2_pp2'}"]
    worlds[4]["ep2_pp2"] = _case(*EP_PP, *saves)
    saves = ["--checkpoint.every=3", f"--checkpoint.dir={root / 'ep2_tp2'}"]
    extra = WORLDS["ep2_tp2_sp_z1_capacity"][0]
    worlds[4]["ep2_tp2_sp_z1_capacity"] = _case(*extra, *saves)
    worlds[1] = {
        "ref": _case(),
        "ref_capacity": _case(*CAPACITY),
        "ref_every2": _case("--model.moe_every=2"),
        "ref_4_blocks": _case("--model.n_layers=4"),
        "grads_ref": _case("--train.steps=1", **PEER),
    }
    out = {}
    for world in run_named_worlds(worlds).values():
        out.update(world)
    out["root"] = root

    def resume(saved: str, into: str, *extra: str) -> dict:
        at = [f"--checkpoint.resume={root / saved / HALF}", f"--checkpoint.dir={root / into}"]
        return _case(*at, *extra)

    again = run_named_worlds(
        {
            1: {"ep2_pp2_to_1": resume("ep2_pp2", "to1")},
            2: {"ep2_tp2_to_pp2": resume("ep2_tp2", "to_pp2", *PP, *CAPACITY)},
        }
    )
    for world in again.values():
        out.update(world)
    return out


def _ok(result: dict) -> dict:
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize(
    "name",
    [
        "ep2_pp2",
        "ep2_tp2_sp",
        "ep2_tp2_sp_z1_capacity",
        "tp2_sp",
        "tp2_sp_capacity",
        "tp2_sp_recompute",
        "pp2",
        "pp2_tp2_sp",
    ],
)
def test_explain_prices_the_composed_moe_layouts(runs, name):
    """explain's params, grads, master, optimizer and buffers equal the engine's (max over
    ranks): a stage holds its own layers' experts, a tp rank all of its ep share, sharded over
    (dp / ep)·tp; the total within 5 % (the exchange's saved rows are not priced); rank 0's
    dp, pp and tp bytes and calls exactly (expert gradients reduced over (dp / ep)·tp, under
    dp; MoE layers whole on every tp rank: no MLP exchange, their counts all-gathered, their
    parameters' partial gradients summed over tp: under ZeRO-1 those inside rank 0's slices;
    under pp those of pipeline stage 0, which runs no head, loss or final norm)."""
    extra, ranks, _ = WORLDS[name]
    pred = explain_record(load_config(None, _case(*extra)["overrides"]), ranks, CPU)
    recs = [_ok(r)["records"][-1] for r in runs[name]]
    got = {k: max(r["mem_bytes"][k] for r in recs) for k in pred["mem_bytes"]}
    want = pred["mem_bytes"]
    for key in ("params", "grads", "master", "optimizer", "buffers"):
        assert want[key] == got[key], (key, want, got)
    assert abs(want["total"] - got["total"]) <= 0.05 * got["total"], ("total", want, got)
    for dim in ("dp", "pp", "tp"):
        assert pred["comm_calls"][dim] == recs[0]["comm_calls"][dim], (dim, pred, recs[0])
        assert pred["comm_bytes"][dim] == recs[0]["comm_bytes"][dim], (dim, pred, recs[0])


@pytest.mark.parametrize("name", list(WORLDS))
def test_composed_layouts_reproduce_one_process(runs, name):
    """Losses and gradient norms within 1e-5 relative every step on every rank; each rank's
    parameters (a stage's, gathered over tp and ep) within 1e-5 relative L2 of the reference
    tensor; together the ranks hold the whole model; loads and drops per layer equal."""
    extra, _, ref_name = WORLDS[name]
    ref = _ok(runs[ref_name][0])
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it trains
    schedule = [x.split("=")[1] for x in extra if x.startswith("--parallel.pp_schedule=")]
    assert len(ref["losses"]) == STEPS
    ranks = [_ok(r) for r in runs[name]]
    # relative L2 per tensor: element-wise, a parameter entry whose gradients were zero up to
    # fp32 rounding moves by that rounding under Adam (support/compare)
    assert_reproduces(name, ranks, ref, sharded=True, rel_l2=True)
    for rank, r in enumerate(ranks):
        # the layout is the one asked for: the schedule ran, tp exchanged activations
        if "--parallel.pp=2" in extra:
            assert r["records"][-1]["pipeline"]["schedule"] == (schedule or ["1f1b"])[0]
        assert (r["records"][-1]["comm_bytes"].get("tp", 0) > 0) == ("--parallel.tp=2" in extra)
        for got, want in zip(r["records"], ref["records"], strict=True):
            assert got["moe_load_max_mean"] == want["moe_load_max_mean"], (name, rank)
            assert got["moe_dropped"] == want["moe_dropped"], (name, rank)
            assert abs(got["moe_aux_loss"] - want["moe_aux_loss"]) <= 1e-6 * want["moe_aux_loss"]
    if "capacity" in name:  # the capacity rule is exercised
        assert sum(sum(x["moe_dropped"]) for x in ref["records"]) > 0


@pytest.mark.parametrize("name", list(GRADS))
def test_first_step_gradients_equal_one_process(runs, name):
    """Every gradient of the first step (router, experts, shared and dense parameters), at full
    shape, within 1e-5 of the single process's relative in L2; the experts' are not zero."""
    ref = _ok(runs["grads_ref"][0])["grads"]
    seen = set()
    for rank, r in enumerate(map(_ok, runs[name])):
        # relative L2: element-wise, an entry that is zero up to fp32 rounding differs by it
        worst, where = worst_tensor(r["grads"], ref, rel_l2=True)
        assert worst <= 1e-5, f"{name} rank {rank}: gradient {where} differs by {worst:.3g}"
        seen |= set(r["grads"])
    assert seen == set(ref)
    assert ref["blocks.1.mlp.w1"].abs().max() > 0


@pytest.mark.parametrize(
    ("name", "saved", "ref"),
    [("ep2_pp2_to_1", "ep2_pp2", "ref"), ("ep2_tp2_to_pp2", "ep2_tp2", "ref_capacity")],
)
def test_a_checkpoint_resumes_in_another_layout(runs, name, saved, ref):
    """The ep2 x pp2 checkpoint (each stage's tensors, expert slices under their global names)
    resumes on one process, and the ep2 x tp2 (sp, ZeRO-1, capacity) one at pp2: both continue
    the single-process run, the same next-step loss and the rest of the curve within 1e-5, and
    the parameters at the end."""
    layout = read_index(Path(runs["root"]) / saved / HALF)["layout"]
    assert layout["ep"] == 2 and layout["pp"] * layout["tp"] == 2
    full = _ok(runs[ref][0])
    ranks = [_ok(r) for r in runs[name]]
    for resumed in ranks:
        assert [r["step"] for r in resumed["records"]] == list(range(4, STEPS + 1))
    rest = {"losses": full["losses"][3:], "params": full["params"]}
    assert_reproduces(name, ranks, rest, grad_norms=False, sharded=True, rel_l2=True)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ([*PP, "--parallel.pp_schedule=zb"], ["parallel.pp_schedule='zb'", "Fix:"]),
        (["--parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true", "Fix:"]),
        (["--parallel.ep=2", "--parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true", "Fix:"]),
    ],
)
def test_refusals_name_the_value_and_the_fix(overrides, needles):
    """What the MoE decoder does not compose with is refused before any process group."""
    with pytest.raises(ConfigError) as err:
        derive(load_config(None, [*MOE, *overrides]), 4)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
