"""Pipeline pieces that need no processes: schedules (replayed), the stage split, the
zero-bubble backward split and the pipeline config checks."""

import contextlib
import dataclasses

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.models import build_model, init_weights, preset
from shardwise.models.families import family_of
from shardwise.parallel.backward_split import backward_input, backward_weight
from shardwise.parallel.deferred_grads import deferring
from shardwise.parallel.pipeline_split import balance, layer_costs, plan_chunks, prune_to_stage
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.schedules import Action, Pass, build_plan, simulate
from shardwise.training.memory import ActivationMeter
from shardwise.training.validate import derive

# F : B = 1 : 2 (a backward is two matmuls per forward matmul); I = W = 1 for zero bubble
COST = {Pass.F: 1.0, Pass.B: 2.0, Pass.I: 1.0, Pass.W: 1.0}
LAYOUTS = [(p, m) for p in (2, 4) for m in (p, 2 * p, 3 * p)]


def _replay(name: str, p: int, m: int, v: int = 1):
    # a virtual chunk holds 1/v of a stage's layers, so its passes take 1/v of the time
    return simulate(build_plan(name, p, m, v), v, {k: c / v for k, c in COST.items()})


@pytest.mark.parametrize(("p", "m"), LAYOUTS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_the_formula(name, p, m):
    replay = _replay(name, p, m)
    for bubble in replay.bubble:
        assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize(("p", "m"), LAYOUTS)
def test_interleaved_bubble_is_the_formula(p, m):
    for v in (2, 3):
        for bubble in _replay("interleaved", p, m, v).bubble:
            assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_replay_with_measured_pass_times():
    """Per-pass durations (what benchmarks/pipeline_bubble.py replays) reproduce the per-kind
    replay when they equal the costs, and one slow pass on stage 0 makes the other wait."""
    plan = build_plan("1f1b", 2, 4, 1)
    same = [[COST[a.kind] for a in acts] for acts in plan]
    assert simulate(plan, 1, durations=same).makespan == _replay("1f1b", 2, 4).makespan
    slow = [list(d) for d in same]
    slow[0][1] += 5.0  # stage 0's second forward: stage 1's next forward waits for it
    replay = simulate(plan, 1, durations=slow)
    # 2 of the 5 units hide in stage 0's wait for stage 1's first backward (F=1, B=2: it
    # would have idled from t=2 to 4), 3 lengthen the step: 15 -> 18
    assert _replay("1f1b", 2, 4).makespan == 15.0 and replay.makespan == 18.0
    assert replay.busy[1] == _replay("1f1b", 2, 4).busy[1]  # stage 1 only waited longer


@pytest.mark.parametrize(("p", "m"), LAYOUTS)
def test_zero_bubble_beats_1f1b_without_more_activations(p, m):
    zb, one = _replay("zb", p, m), _replay("1f1b", p, m)
    assert max(zb.bubble) < min(one.bubble)
    # ZB-H1 (Qi et al. 2023): bubble (p-1)(F + I - W) against 1F1B's (p-1)(F + B)
    assert zb.makespan == pytest.approx(m * 3 + (p - 1) * 1)
    assert max(zb.in_flight) == max(one.in_flight) == min(p, m)


@pytest.mark.parametrize(("p", "m"), LAYOUTS)
def test_in_flight_micro_batches(p, m):
    assert _replay("gpipe", p, m).in_flight == [m] * p
    assert _replay("1f1b", p, m).in_flight == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb", "interleaved"])
def test_every_pass_runs_once(name):
    p, m, v = 4, 8, 2 if name == "interleaved" else 1
    for acts in build_plan(name, p, m, v):
        kinds = {Pass.F, Pass.I, Pass.W} if name == "zb" else {Pass.F, Pass.B}
        want = {Action(k, c, i) for k in kinds for c in range(v) for i in range(m)}
        assert len(acts) == len(want) and set(acts) == want


def test_replay_rejects_a_deadlock_and_a_crossed_channel():
    plan = build_plan("1f1b", 2, 2, 1)
    swapped = [list(reversed(plan[0])), plan[1]]  # rank 0 starts with a backward
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(swapped, 1)
    crossed = [plan[0], [plan[1][1], plan[1][0], *plan[1][2:]]]
    crossed[1] = [Action(Pass.F, 0, 1), Action(Pass.B, 0, 1), Action(Pass.F, 0, 0)]
    crossed[1].append(Action(Pass.B, 0, 0))
    with pytest.raises(ValueError, match="receives"):
        simulate(crossed, 1)


# -- stage split ------------------------------------------------------------------------------


def test_balance_is_optimal_and_counts_embedding_and_head():
    assert balance([1.0] * 8, 0.0, 0.0, 2) == [4, 4]
    assert balance([1.0] * 8, 0.0, 4.0, 2) == [6, 2]  # a heavy head: fewer blocks last
    assert balance([1.0] * 8, 2.0, 2.0, 4) == [1, 3, 3, 1]
    first, blocks, last = layer_costs(preset("tiny", n_layers=8), 128)
    assert first > 0 and last > blocks[0] > 0
    assert sum(len(c.blocks) for c in plan_chunks(preset("tiny", n_layers=8), 2, 2, "", 128)) == 8


def test_explicit_split_and_pruning_keep_names():
    spec = preset("tiny", n_layers=6, tie_embeddings=True)
    chunks = plan_chunks(spec, 2, 1, "2,4", 32)
    assert [c.blocks for c in chunks] == [(0, 1), (2, 3, 4, 5)]
    names = set()
    for r in range(2):
        with torch.device("meta"):
            model = build_model(spec)
        mine, _ = prune_to_stage(model, chunks, r, 2)
        assert [c.index for c in mine] == [r]
        names |= {n for n, _ in model.named_parameters()}
    with torch.device("meta"):
        full = {n for n, _ in build_model(dataclasses.replace(spec)).named_parameters()}
    assert names == full | {"head.weight"}  # the tied weight: held by both ends


@pytest.mark.parametrize(
    ("split", "needle"),
    [
        ("3,3", "does not cover the model: it assigns 6 blocks"),
        ("4,4,0", "has 3 entries"),
        ("8,0", "each entry must be >= 1"),
        ("4;4", "not a comma-separated list"),
    ],
)
def test_bad_split_says_why(split, needle):
    with pytest.raises(ConfigError, match=needle):
        plan_chunks(preset("tiny", n_layers=8), 2, 1, split, 32)


# -- zero-bubble backward split ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "gpt2-tiny"])  # RMSNorm, no biases | LayerNorm, biases
@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "graph"])
def test_input_then_weight_pass_equals_one_backward(name, deferred):
    """Both ways of splitting: linear layers and norms run under `deferring()` (the pipeline's
    forward) keep their weight gradients as closures; without it every weight goes through
    the graph (the path for ops deferred_grads does not know)."""
    spec = preset(name, n_layers=2)
    model = build_model(spec)
    init_weights(model, 0)
    weights = [p for p in model.blocks.parameters()] + list(model.norm.parameters())
    weights.append(model.head.weight)
    hits = []
    for w in weights:
        w.register_post_accumulate_grad_hook(lambda p: hits.append(id(p)))
    meter = ActivationMeter(model)

    def run(split: bool):
        x = torch.randn(2, 8, spec.dim, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        mode = deferring() if split and deferred else contextlib.nullcontext()
        with meter.measure(), mode:
            h = x
            for block in model.blocks:
                h = block(h)
            loss = model.output(h).square().mean()
        return x, loss, meter.take_peak()

    x, loss, saved = run(split=False)
    loss.backward()
    want = [w.grad.clone() for w in weights] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    hits.clear()
    x, loss, split_saved = run(split=True)
    assert split_saved == saved  # the deferring ops save what the plain ones save
    pending = backward_input(loss, None, x, weights)
    assert all(w.grad is None for w in weights) and x.grad is not None
    # deferred: no departure node is left for W to restart autograd from
    assert (pending.departures == []) == deferred and (pending.deferred != []) == deferred
    backward_weight(pending)
    got = [w.grad for w in weights] + [x.grad]
    # the same fp32 ops, only a bias's sum may run in another order: relative L2 (an
    # absolute bound would pass anything here, these gradients are ~1e-4)
    for a, b in zip(got, want, strict=True):
        assert (a - b).norm() <= 1e-6 * b.norm()
    assert sorted(hits) == sorted(id(w) for w in weights)  # each reducer hook fires once


# -- config checks ----------------------------------------------------------------------------

SMALL = ["--model.n_layers=4", "--train.global_batch=8"]


@pytest.mark.parametrize(
    ("argv", "world", "needles"),
    [
        (["--parallel.pp=8"], 8, ["parallel.pp(8) * parallel.pp_virtual(1) = 8", "4 blocks"]),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_virtual=2"],
            2,
            ["m = global_batch(8) / (micro_batch(8) * dp(1)) = 1 is fewer than the stages"],
        ),
        (["--parallel.pp=2", "--parallel.pp_split=1,1"], 2, ["does not cover the model"]),
        (["--parallel.pp=2", "--parallel.zero=2"], 2, ["parallel.zero=2 with parallel.pp=2"]),
        (["--parallel.pp=2", "--parallel.pp_virtual=2"], 2, ["interleaved schedule only"]),
        (["--parallel.pp_schedule=zb"], 1, ["no effect with parallel.pp=1"]),
    ],
)
def test_pipeline_config_errors(argv, world, needles):
    with pytest.raises(ConfigError) as err:
        derive(load_config(None, [*SMALL, *argv]), world)
    for needle in needles:
        assert needle in str(err.value)
    assert "Fix:" in str(err.value)


def test_interleaved_fix_suggests_a_micro_batch_that_works():
    cfg = load_config(
        None,
        [
            *SMALL,
            "--parallel.pp=2",
            "--parallel.pp_schedule=interleaved",
            "--parallel.pp_virtual=2",
            "--train.micro_batch=8",
        ],
    )
    with pytest.raises(ConfigError, match=r"--train\.micro_batch=4"):
        derive(cfg, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved"])
def test_planner_in_flight_is_the_plans_peak(schedule):
    """The planner's micro-batches in flight per stage (plan/activations.py) equal the peak of
    forwards not yet released by their backward (or, zero bubble, weight pass) in the plans the
    engine runs."""
    from shardwise.plan.activations import in_flight

    v = 2 if schedule == "interleaved" else 1
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p):
            for stage, plan in enumerate(build_plan(schedule, p, m, v)):
                held = peak = 0
                for a in plan:
                    held += 1 if a.kind is Pass.F else -(a.kind in (Pass.B, Pass.W))
                    peak = max(peak, held)
                assert in_flight(schedule, p, m, v, stage) == peak / v, (p, m, stage)


def test_recomputed_blocks_run_deferring_as_their_forward_did():
    """Blocks recomputed (memory.recompute=full) during a backward of a forward run under
    `deferring()` save what that forward saved, however often a kept graph is walked: two
    backwards through it give twice one plain backward's gradients."""
    spec = preset("tiny", n_layers=2)
    plain, again = build_model(spec), build_model(spec)
    for m in (plain, again):
        init_weights(m, 0)
    assert apply_recompute(again, family_of(spec), "full") == 2
    x = torch.randn(2, 8, spec.dim, generator=torch.Generator().manual_seed(1))

    def loss(model):
        h = x
        for block in model.blocks:
            h = block(h)
        return model.output(h).square().mean()

    loss(plain).backward()
    with deferring():
        out = loss(again)
    out.backward(retain_graph=True)
    out.backward()
    for (name, a), b in zip(again.named_parameters(), plain.parameters(), strict=True):
        if b.grad is not None:
            assert (a.grad - 2 * b.grad).norm() <= 1e-6 * b.grad.norm(), name
