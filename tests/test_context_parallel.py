"""Context parallelism (parallel.cp): parity with the single-process run, and its traffic key.

fp32, the tiny built-in decoders, 6 steps at seq_len 64: every cp layout must reproduce the
single process's losses and final parameters, because each rank's loss is the sum over its
zig-zag part of the sequence divided by the global token count and gradients are summed over
dp, which holds the cp ranks (docs/design.md, "Layout invariance"). One 4-rank world runs
every multi-rank case (cp 2 runs twice over, as two sample streams), one 1-process world the
references."""

import pytest

from shardwise.launchers.harness import run_named_worlds
from support.compare import assert_reproduces, case

STEPS = 6
SHORT = [f"--train.steps={STEPS}", "--data.seq_len=64", "--optim.warmup_steps=2"]
# evaluation at the last step: the held-out loss is split and summed the same way
EVAL = ["--train.eval_every=0", "--train.eval_batches=1"]
GPT2 = "--model.name=gpt2-tiny"

WORLD1 = {
    "ref": case(*SHORT, *EVAL),
    "gpt2": case(*SHORT, GPT2),
}
WORLD4 = {
    # dp 2 x cp 2: each pair of ranks splits the sequences of one sample stream
    "cp2_ring": case(*SHORT, *EVAL, "--parallel.cp=2"),
    "cp2_ulysses": case(*SHORT, *EVAL, "--parallel.cp=2", "--parallel.cp_mode=ulysses"),
    "cp4_ring": case(*SHORT, *EVAL, "--parallel.cp=4"),
    "cp2_z3": case(*SHORT, *EVAL, "--parallel.cp=2", "--parallel.zero=3"),
    # the chunked head and loss, and a recomputed attention core, work on the local tokens
    "cp2_chunks_selective": case(
        *SHORT, *EVAL, "--parallel.cp=2", "--train.loss_chunks=4", "--memory.recompute=selective"
    ),
    # GPT-2's learned position table read at the global positions
    "gpt2_cp4": case(*SHORT, GPT2, "--parallel.cp=4"),
}
REFERENCE = {
    "cp2_ring": "ref",
    "cp2_ulysses": "ref",
    "cp4_ring": "ref",
    "cp2_z3": "ref",
    "cp2_chunks_selective": "ref",
    "gpt2_cp4": "gpt2",
}


@pytest.fixture(scope="module")
def worlds():
    return run_named_worlds({1: WORLD1, 4: WORLD4})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFERENCE))
def test_parity_with_single_process(worlds, name):
    """Losses within 1e-5 relative and parameters (gathered to full shape) within 1e-5 on
    every rank; the evaluated loss too where the case evaluates. It trained: a wrong split of
    the sequence (positions, causal mask, token count) moves the first loss already."""
    ref = worlds[1][REFERENCE[name]][0]
    assert ref["losses"][-1] < ref["losses"][0] - 0.1
    assert len(ref["losses"]) == STEPS
    assert_reproduces(name, worlds[4][name], ref, grad_norms=False)
    for r in worlds[4][name]:
        if "eval_loss" in ref["records"][-1]:
            got, want = r["records"][-1]["eval_loss"], ref["records"][-1]["eval_loss"]
            assert abs(got - want) <= 1e-5 * abs(want)


@pytest.mark.slow
def test_cp_traffic_is_counted_under_its_own_key(worlds):
    """metrics.jsonl's comm_bytes gains a cp key when cp > 1: the attention's K/V exchange,
    apart from the dp gradient reduction (which spans the cp ranks too)."""
    rec = worlds[4]["cp2_ring"][0]["records"][-1]
    assert rec["comm_bytes"]["cp"] > 0 and rec["comm_calls"]["cp"] > 0
    assert rec["comm_bytes"]["dp"] > 0
    assert "cp" not in worlds[1]["ref"][0]["records"][-1]["comm_bytes"]


# --- what this first step refuses, before any process starts ---------------------------------

TINY = ["--model.name=tiny", "--data.seq_len=32", "--train.global_batch=8"]
PRESET_HF = "--model.name=hf-llama-tiny"


@pytest.mark.parametrize(
    ("world", "overrides", "needles"),
    [
        (6, ["--parallel.cp=4"], ["pp(1) * dp * cp(4) * tp(1)", "world / (tp * pp) = 6"]),
        (2, ["--parallel.cp=0"], ["parallel.cp=0 must be >= 1"]),
        (1, ["--parallel.cp_mode=ulysses"], ["no effect with parallel.cp=1"]),
        (
            2,
            ["--parallel.cp=2", "--model.name=resnet18", "--data.dataset=digits"],
            ["model.name='resnet18'", "--parallel.cp=1"],
        ),
        # transformers' models compose cp with tp (test_context_parallel_hf.py), not with sp,
        # and the presets are not cut into pipeline stages, cp or not
        (
            4,
            ["--parallel.cp=2", "--parallel.tp=2", "--parallel.sp=true", PRESET_HF],
            ["parallel.sp=true", "Hugging Face models", "--parallel.sp=false"],
        ),
        (
            4,
            ["--parallel.cp=2", "--parallel.pp=2", "--model.name=hf-llama-tiny"],
            ["parallel.pp=2", "a Hugging Face model", "--parallel.pp=1"],
        ),
        (
            8,
            ["--parallel.cp=2", "--parallel.tp=4", "--parallel.sp=true", "--data.seq_len=36"],
            ["data.seq_len / cp = 18 tokens over parallel.tp=4", "multiple of 8", "sp=false"],
        ),
        (
            8,
            ["--parallel.cp=4", "--parallel.tp=2", "--parallel.cp_mode=ulysses"],
            ["model.n_heads=4 / tp(2) = 2 is not divisible by 4", "cp_mode=ring"],
        ),
        (4, ["--parallel.cp=4", "--data.seq_len=36"], ["data.seq_len=36", "2 * cp = 8"]),
        (
            3,
            ["--parallel.cp=3", "--parallel.cp_mode=ulysses", "--data.seq_len=36"],
            ["model.n_heads=4 is not divisible by 3", "only n_heads counts", "cp_mode=ring"],
        ),
        (2, ["--parallel.cp=2", "--model.dropout=0.1"], ["model.dropout=0.1", "set them to 0"]),
        (2, ["--parallel.cp=2", "--model.attn_dropout=0.1"], ["model.attn_dropout=0.1"]),
        (
            2,
            ["--parallel.cp=2", "--train.loss=os.path:join"],
            ["train.loss='os.path:join'", "--train.loss=cross_entropy"],
        ),
    ],
)
def test_refusals_name_the_value_and_the_fix(world, overrides, needles):
    """One ConfigError naming the offending value and the fix for each combination this
    first step does not run (docs/parallelism.md lists them)."""
    from shardwise.config import load_config
    from shardwise.errors import ConfigError
    from shardwise.training.validate import derive

    with pytest.raises(ConfigError) as err:
        derive(load_config(None, [*TINY, *overrides]), world)
    text = str(err.value)
    assert "Fix:" in text
    for needle in needles:
        assert needle in text, text


def test_derived_dp_counts_the_sample_streams():
    """dp × cp ranks share the parameters, dp of them read different samples: the tokens of
    a step and the micro-batches follow dp."""
    from shardwise.config import load_config
    from shardwise.training.validate import derive

    d = derive(load_config(None, [*TINY, "--parallel.cp=2"]), 4)
    assert (d.dp, d.cp, d.micro_batch, d.micro_batches) == (2, 2, 4, 1)
    assert d.tokens_per_step == 8 * 32


def test_the_plan_prices_cp_as_its_data_parallel_equivalent_and_says_what_it_leaves_out():
    """The planner is not silently wrong about a cp job: states are sharded over dp × cp
    (as ZeRO shards them), activations are those of seq_len / cp plus what the cp kernels
    save (tests/test_context_parallel_measured.py: exact), the exchange has its own cp key,
    and the record says what it does not price (the planner's search over cp layouts and
    the step time: tests/test_plan_context.py)."""
    from shardwise.config import load_config
    from shardwise.job.explain import explain_record

    def rec(world, *extra):
        cfg = load_config(None, [*TINY, "--data.seq_len=64", "--parallel.zero=3", *extra])
        return explain_record(cfg, world)

    cp, dp4 = rec(4, "--parallel.cp=2"), rec(4)
    short = rec(4, "--data.seq_len=32", "--train.global_batch=16")  # 4 samples x 32 a rank
    assert (cp["dp"], cp["cp"]) == (2, 2) and cp["tokens_per_step"] == dp4["tokens_per_step"]
    assert cp["mem_bytes"]["params"] == dp4["mem_bytes"]["params"]  # 1/4 each
    # a cp rank holds 4 samples x 32 tokens of a micro-batch, as a dp 4 rank at seq_len 32,
    # and its kernels' fp32 outputs (4 layers x 4 samples x 32 tokens x 128 x 4 bytes) with
    # its ids and targets copied (8 bytes a token each) instead of one window of 33
    extra = 4 * 4 * 32 * 128 * 4 - 8 * 4
    assert cp["mem_bytes"]["activations"] == short["mem_bytes"]["activations"] + extra
    # and less than the same 2 sample streams without cp: 4 samples x 64 tokens a rank
    assert cp["mem_bytes"]["activations"] < rec(2)["mem_bytes"]["activations"]
    assert cp["comm_bytes"]["cp"] > 0 and "cp" not in dp4["comm_bytes"]
    assert any("parallel.cp=2" in w and "Not priced" in w for w in cp["warnings"])
