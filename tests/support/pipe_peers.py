"""DeepSpeed's pipeline engine (`deepspeed.pipe`, the engine of Megatron-DeepSpeed and so of
BLOOM's runs) measured where the planner prices it: what a stage holds per micro-batch in
flight when full recomputation saves only each block's input (`plan/peers.Deviations.
pp_stage_copies`). DeepSpeed is the optional `bench` extra; tests skip without it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import Config
from support.livepeak import LivePeak
from support.zero_peers import deepspeed_env

# one micro-batch: B sequences of S tokens, H wide (a hidden state is B*S*H fp32 values);
# M micro-batches a batch
B, S, H, VOCAB, M = 2, 32, 256, 64, 4


class Block(nn.Module):
    """A stand-in for a transformer block: one matmul and a residual (its input is what full
    recomputation keeps; its output is a new hidden state)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def deepspeed_pipeline_peer(cfg: Config) -> dict:
    """One 1F1B batch of M micro-batches through a DeepSpeed pipeline of `world` stages
    (embedding, blocks, head; every block checkpointed, as Megatron-DeepSpeed's
    `--checkpoint-activations` checkpoints its transformer layers), after a warm-up batch
    (`cfg` is the harness's and unused). Returns this stage's index, its blocks, and the
    bytes of the tensors made in the batch still alive when its first backward starts
    (every micro-batch it holds in flight, nothing released yet), in hidden states."""
    deepspeed_env()
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe import schedule

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # on the harness's group
    stages = dist.get_world_size()
    blocks = 2 * stages
    torch.manual_seed(0)
    layers = [LayerSpec(nn.Embedding, VOCAB, H)]
    layers += [LayerSpec(Block) for _ in range(blocks)]
    layers += [LayerSpec(nn.Linear, H, VOCAB)]
    loss = lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    module = PipelineModule(
        layers, num_stages=stages, loss_fn=loss, partition_method="uniform",
        activation_checkpoint_interval=1, checkpointable_layers=["Block"],
    )  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": M,
        "train_batch_size": B * M,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    gen = torch.Generator().manual_seed(1)

    def batches():
        while True:
            ids = torch.randint(0, VOCAB, (B, S), generator=gen)
            yield ids, torch.roll(ids, -1, dims=1)

    data = batches()
    engine.train_batch(data)  # the receive buffers and the optimizer's state exist now
    seen: dict[str, int] = {}
    table = dict(type(engine)._INSTRUCTION_MAP)  # the engine dispatches through this table
    backward = table[schedule.BackwardPass]

    def first_backward(self, buffer_id: int) -> None:
        seen.setdefault("live", meter.live)
        backward(self, buffer_id)

    table[schedule.BackwardPass] = first_backward
    engine._INSTRUCTION_MAP = table
    with LivePeak() as meter:
        engine.train_batch(data)
    lo, hi = module.parts[engine.stage_id], module.parts[engine.stage_id + 1]
    held = sum(isinstance(f, Block) for f in module.forward_funcs)
    assert hi - lo == len(module.forward_funcs)
    return {
        "stage": engine.stage_id,
        "stages": stages,
        "blocks": held,
        "micro_batches": M,
        "hidden_states_live": seen["live"] / (B * S * H * 4),
    }
