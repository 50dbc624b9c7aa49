"""DeepSpeed's pipeline engine measured where the planner prices it (`plan/peers.Deviations.
pp_stage_copies`, on for BLOOM's Megatron-DeepSpeed runs in benchmarks/published_rows.py):
with every layer checkpointed, a stage holds per micro-batch in flight each block's input and,
beside them, the hidden state it received (cloned for its first block) and the one it sent.

One spawned world of 3 ranks (a first, a middle and a last stage). DeepSpeed is the optional
`bench` extra; without it the test is skipped."""

import pytest

from shardwise.launchers.harness import run_world
from support.compare import case
from support.zero_peers import DEEPSPEED_INSTALL as INSTALL
from support.zero_peers import deepspeed_available

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not deepspeed_available(), reason=INSTALL)
def test_deepspeed_pipeline_stages_hold_the_received_and_sent_hidden_states():
    """At a stage's first backward under 1F1B (p - stage micro-batches in flight), the
    tensors alive are, per micro-batch: each block's input (what full recomputation keeps:
    the planner's own count), plus the hidden state the stage sent (kept to run backward
    from) and the one it received (not on the first stage, which embeds token ids): 1 more on
    the first stage, 2 on a middle one. (The last stage holds its head's logits and loss
    instead of a sent state: priced with the loss, not checked here.)"""
    (ranks,) = run_world(3, [case(peer=PEER)])
    for r in ranks:
        assert "error" not in r, r.get("error")
    by_stage = {r["stage"]: r for r in ranks}
    for stage, kept in ((0, 1), (1, 2)):
        r = by_stage[stage]
        in_flight = min(r["micro_batches"], r["stages"] - stage)
        expected = in_flight * (r["blocks"] + kept)
        # ids and targets (int64, an eighth of a 256-wide fp32 hidden state each) ride along
        assert expected <= r["hidden_states_live"] < expected + 0.25 * in_flight, (stage, r)


PEER = "support.pipe_peers:deepspeed_pipeline_peer"
