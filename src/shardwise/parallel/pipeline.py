"""Pipeline parallelism: one rank's chunks of the model and the passes its schedule runs.

`apply_pipeline` cuts the meta model (pipeline_split), so each rank materialises only its own
chunks, and returns the `Pipeline` that runs a step: the rank's plan (schedules) executed
pass by pass, activations and gradients exchanged point-to-point (pipeline_comm), the
zero-bubble backward split in two (backward_split). Gradient reduction over dp (DP or
ZeRO-1) starts only with the last pass that produces weight gradients, as in the
single-stage loop; then the tied embedding/head gradient is summed over the first and last
stage. The loss is the summed cross-entropy (vocabulary-parallel under tp) over the *global*
token count, so every layout reproduces the single-process losses.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from shardwise.config import Config
from shardwise.distributed import device as dev
from shardwise.distributed.clock import clock
from shardwise.distributed.comm import Comm
from shardwise.models.decoder import Decoder
from shardwise.models.dropout import samples
from shardwise.parallel.backward_split import Pending, backward_input, backward_weight
from shardwise.parallel.context import sequence_part
from shardwise.parallel.deferred_grads import deferring
from shardwise.parallel.pipeline_comm import Channel, tied_group
from shardwise.parallel.pipeline_split import Chunk, plan_chunks, prune_to_stage
from shardwise.parallel.schedules import Action, Pass, build_plan


@dataclass
class _Held:
    """A micro-batch's state on one chunk between its forward and its (last) backward."""

    inputs: torch.Tensor | None  # the leaf whose gradient goes upstream (None: token ids)
    root: object  # the loss, or the GradientEdge of the chunk's output
    nbytes: int  # activation bytes saved by the forward
    embedded: torch.Tensor | None = None  # zero bubble, first chunk: embedding output
    output: torch.Tensor | None = None  # until sent: backward needs only the graph edge
    pending: Pending = field(default_factory=Pending)


class Pipeline:
    """Runs this rank's plan for each step; also its metrics and tied-weight sync."""

    def __init__(self, model: Decoder, mine: list[Chunk], n_chunks: int, cfg: Config, comm):
        self.model, self.chunks, self.n_chunks = model, mine, n_chunks
        self.comm, self.cfg = comm, cfg
        p = comm.topo.pp
        self.p, self.r, self.v = p, comm.topo.coord("pp"), cfg.parallel.pp_virtual
        self.schedule = cfg.parallel.pp_schedule
        self.sp = cfg.parallel.sp
        self.split = self.schedule == "zb"
        self.dtype = dev.dtype_of(cfg.precision.compute)
        self.tied = model.spec.tie_embeddings
        self.tied_group = tied_group(comm.topo, cfg.parallel.timeout_s) if self.tied else None
        self.stats: dict[str, float] = {}

    # -- one training step --------------------------------------------------------------------
    def train_step(self, run, micro: list, global_count: int, scale: float):
        """Every micro-batch of the step through the plan; returns (this rank's summed loss,
        its peak of saved activation bytes)."""
        plan = build_plan(self.schedule, self.p, len(micro), self.v)[self.r]
        device = run.info.device
        self._batches = _Batches(run.train_data, micro, device, self.comm.topo)
        shape = self._shape(len(micro[0]), self._batches.seq_len())
        channel = Channel(self.comm, plan, self.n_chunks, shape, self.dtype, device)
        held: dict[tuple[int, int], _Held] = {}
        loss_sum = torch.zeros((), device=device)
        weight_passes = [j for j, a in enumerate(plan) if a.kind in (Pass.B, Pass.W)]
        sync_at = weight_passes[-1] if self.v == 1 else None  # one chunk: its last pass
        reducer = run.reducer
        reducer.sync = False
        self._scale = scale  # a middle chunk's balance loss backward is scaled as the loss
        self._in_flight = self._act = self._act_peak = self._in_flight_peak = self._mb = 0
        clk = clock()
        with clk.phase("bubble"):  # align starts (a stage waiting here is idle too)
            self.comm.all_reduce(torch.zeros(1, device=device), "pp", control=True)
        start, busy = time.perf_counter(), 0.0
        self.intervals: list[tuple[float, float]] = []
        for j, a in enumerate(plan):
            channel.flush(j)
            with clk.phase("bubble"):  # blocked on a neighbour stage: idle by the schedule
                received = channel.wait(j)
            if a.kind in (Pass.B, Pass.W):
                # gradient sync (DP/ZeRO) only with the last pass that makes weight gradients
                reducer.sync = j == sync_at
                reducer.start_micro_batch()
            t0 = time.perf_counter()
            with samples(micro[a.mb]), clk.phase("forward" if a.kind is Pass.F else "backward"):
                if a.kind is Pass.F:
                    loss_sum += self._forward(run, a, received, held, global_count)
                else:
                    self._backward(a, received, held, scale, channel)
            t1 = time.perf_counter()
            self.intervals.append((t0 - start, t1 - start))
            busy += t1 - t0
            if a.kind is Pass.F and not self.chunks[a.chunk].last:
                state = held[(a.chunk, a.mb)]
                channel.send_forward(state.output)
                state.output = None
        span = time.perf_counter() - start
        channel.close()
        reducer.sync = True
        reducer.finish()
        self._sync_tied(reducer)
        self.stats = {"busy": busy, "span": span}
        # the loss lives on the last stage: every stage reports its replica's loss (the
        # first stage still runs backward while the last one waits here: the cool-down)
        with clk.phase("bubble"):
            self.comm.all_reduce(loss_sum, "pp", control=True)
        return loss_sum, self._act_peak

    def _forward(self, run, a: Action, received, held: dict, global_count: int):
        chunk = self.chunks[a.chunk]
        # the first chunk takes token ids; the others a received activation, made a leaf so
        # its gradient can be sent back
        inputs = self._batches.inputs(a.mb) if chunk.first else received.requires_grad_(True)
        # zero bubble: linear layers and norms keep their weight gradients for W
        with run.meter.measure(), deferring() if self.split else contextlib.nullcontext():
            h = self.model.embed_tokens(inputs) if chunk.first else inputs
            embedded = None
            if chunk.first and self.split:  # I stops at the embedding output; W does the rest
                embedded, h = h, h.detach().requires_grad_(True)
            chunks = run.cfg.train.loss_chunks if chunk.last else 0
            loss = (self._batches.targets(a.mb), chunks) if chunks > 1 else ()
            out = self._blocks(chunk, h, loss)  # with `loss`: the head's chunked loss sum
            if chunk.last:
                out = out if loss else run.tp.loss_sum(out, self._batches.targets(a.mb))
                out = out / global_count
            if run.experts is not None:  # MoE: this chunk's layers' loads and balance loss
                mods = [self.model.blocks[str(i)] for i in chunk.blocks]
                if chunk.last:
                    out = run.experts.after_forward(out, global_count, mods)
                else:
                    out = run.experts.after_chunk(out, global_count, self._scale, mods)
        nbytes = run.meter.take_peak()
        leaf = h if embedded is not None else (None if chunk.first else inputs)
        # a first chunk whose parameters are all frozen has no graph: nothing to run backward
        root = out if chunk.last or not out.requires_grad else get_gradient_edge(out)
        held[(a.chunk, a.mb)] = _Held(leaf, root, nbytes, embedded, output=out)
        self._grow(nbytes, 1)
        return out.detach() if chunk.last else 0.0

    def _backward(self, a: Action, received, held: dict, scale: float, channel) -> None:
        chunk = self.chunks[a.chunk]
        state = held[(a.chunk, a.mb)]
        root, grad = (state.root * scale, None) if chunk.last else (state.root, received)
        if not isinstance(root, GradientEdge) and not root.requires_grad:
            pass  # frozen first chunk: no gradients to compute
        elif a.kind is Pass.B:
            torch.autograd.backward(root, grad)
        elif a.kind is Pass.I:
            weights = [p for p in self._chunk_params(chunk) if p.requires_grad]
            state.pending = backward_input(root, grad, state.inputs, weights)
        else:  # Pass.W
            backward_weight(state.pending)
            if state.embedded is not None and state.embedded.requires_grad:
                torch.autograd.backward(state.embedded, state.inputs.grad)
        if a.kind is not Pass.W and not chunk.first:
            channel.send_backward(state.inputs.grad)
        if a.kind is not Pass.I:  # the graph and its saved activations are released
            del held[(a.chunk, a.mb)]
            self._grow(-state.nbytes, -1)

    def _blocks(self, chunk: Chunk, h: torch.Tensor, loss: tuple = ()) -> torch.Tensor:
        for i in chunk.blocks:
            h = self.model.blocks[str(i)](h)
        return self.model.output(h, *loss) if chunk.last else h

    def _chunk_params(self, chunk: Chunk) -> list[nn.Parameter]:
        mods = [self.model.blocks[str(i)] for i in chunk.blocks]
        if chunk.last:
            mods += [m for m in (self.model.norm, self.model.head) if m is not None]
        return [p for m in mods for p in m.parameters()]

    def _grow(self, nbytes: int, n: int) -> None:
        self._act += nbytes
        self._in_flight += n
        self._act_peak = max(self._act_peak, self._act)
        self._in_flight_peak = max(self._in_flight_peak, self._in_flight)
        self._mb = max(self._mb, nbytes)

    # -- tied weights and the gradient norm ---------------------------------------------------
    def _tied_param(self) -> nn.Parameter | None:
        if self.tied_group is None:
            return None
        if self.r == 0:
            return self.model.embed.weight
        return self.model.head.weight if self.r == self.p - 1 else None

    def _sync_tied(self, reducer) -> None:
        """Sum the tied embedding/head gradient over the first and last stage (after the dp
        reduction, so only this rank's reduced part travels): both then apply the same
        update to the same initial values and stay identical."""
        param = self._tied_param()
        if param is None:
            return
        for grad in _reduced_views(reducer, param):
            self.comm.all_reduce_in(grad, self.tied_group, 2, "pp")

    def mark_norm_targets(self, targets: list) -> list:
        """The last stage's copy of a tied weight is left out of the gradient norm (the first
        stage counts it), so the norm summed over stages counts every parameter once."""
        param = self._tied_param() if self.r == self.p - 1 else None
        if param is None:
            return targets
        lo = param.data_ptr()
        hi = lo + param.numel() * param.element_size()
        for t in targets:
            if lo <= t.param.data_ptr() < hi:
                t.in_norm = False
        return targets

    def norm_reducer(self, inner):
        """Sum partial squared gradient norms over dp shards (`inner`) and pipeline stages."""

        def reduce(norm_sq: torch.Tensor) -> None:
            if inner is not None:
                inner(norm_sq)
            self.comm.all_reduce(norm_sq, "pp", control=True)

        return reduce

    # -- evaluation and metrics -----------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, run, data, parts: list) -> torch.Tensor:
        """Summed loss of `parts` (one micro-batch each), forwards only, on every stage."""
        plan = [Action(Pass.F, k, i) for i in range(len(parts)) for k in range(self.v)]
        batches = _Batches(data, parts, run.info.device, self.comm.topo)
        shape = self._shape(len(parts[0]), batches.seq_len())
        channel = Channel(self.comm, plan, self.n_chunks, shape, self.dtype, run.info.device)
        total = torch.zeros((), dtype=torch.float64, device=run.info.device)
        for j, a in enumerate(plan):
            channel.flush(j)
            received = channel.wait(j)
            chunk = self.chunks[a.chunk]
            h = self.model.embed_tokens(batches.inputs(a.mb)) if chunk.first else received
            out = self._blocks(chunk, h)
            if chunk.last:
                total += run.tp.loss_sum(out, batches.targets(a.mb)).double()
            else:
                channel.send_forward(out)
        channel.close()
        self.comm.all_reduce(total, "pp", control=True)
        return total

    def _shape(self, micro: int, seq_len: int) -> tuple[int, int, int]:
        """Activations between chunks: [micro-batch, sequence, hidden]; with sequence
        parallelism each tp rank sends its sequence shard."""
        tp = self.comm.topo.size("tp")
        return (micro, seq_len // tp if self.sp else seq_len, self.model.spec.dim)

    def report(self, device) -> dict:
        """Per-stage bubble and activations of the last step (a control all-reduce): bubble =
        1 − busy / makespan, the makespan being the slowest stage's span of the step."""
        keys = ("busy", "span", "act_peak", "in_flight", "act_per_mb")
        mine = [self.stats["busy"], self.stats["span"], self._act_peak]
        mine += [self._in_flight_peak, self._mb]
        table = torch.zeros(len(keys), self.p, dtype=torch.float64, device=device)
        table[:, self.r] = torch.tensor(mine, dtype=torch.float64)
        self.comm.all_reduce_world(table, "max")
        rows = dict(zip(keys, table.tolist(), strict=True))
        makespan = max(rows["span"])
        return {
            "schedule": self.schedule,
            "bubble": [1.0 - b / makespan for b in rows["busy"]],
            "busy_s": rows["busy"],
            "makespan_s": makespan,
            "act_peak": [int(x) for x in rows["act_peak"]],
            "in_flight": [int(x) for x in rows["in_flight"]],
            "act_per_mb": [int(x) for x in rows["act_per_mb"]],
        }


class _Batches:
    """A step's micro-batches, loaded on first use (the first stage needs the inputs, the
    last the targets); with context parallelism this rank's part of each sequence, so the
    stages exchange activations of the local length (`seq_len`)."""

    def __init__(self, data, parts: list, device, topo) -> None:
        self.data, self.parts, self.device, self.topo = data, parts, device, topo
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _get(self, mb: int):
        if mb not in self.cache:
            with clock().phase("data"):
                batch = self.data.get_batch(self.parts[mb])
                moved = (t.to(self.device, non_blocking=True) for t in batch)
                self.cache[mb] = tuple(sequence_part(t, self.topo) for t in moved)
        return self.cache[mb]

    def inputs(self, mb: int) -> torch.Tensor:
        return self._get(mb)[0]

    def targets(self, mb: int) -> torch.Tensor:
        return self._get(mb)[1]

    def seq_len(self) -> int:
        return self.inputs(0).shape[1]


def _reduced_views(reducer, param: nn.Parameter) -> list[torch.Tensor]:
    """Where the dp-reduced gradient of `param` lives on this rank: its bucket view (DP) or
    the part of it inside this rank's ZeRO-1 slice."""
    units = getattr(reducer, "units", None)
    if units is None:
        return [param.main_grad]
    for unit in units:
        for (*_, p), off in zip(unit.entries, unit.offsets, strict=True):
            if p is param:
                lo, hi = max(off, unit.lo), min(off + p.numel(), unit.hi)
                return [unit.grad_full[lo:hi]] if lo < hi else []
    raise ValueError("tied parameter not found in any ZeRO unit")


def apply_pipeline(model: nn.Module, cfg: Config, derived, comm: Comm) -> Pipeline:
    """Cut the meta model to this rank's chunks (in place) and return what runs them."""
    p, v = comm.topo.pp, cfg.parallel.pp_virtual
    chunks = plan_chunks(derived.spec, p, v, cfg.parallel.pp_split, cfg.data.seq_len)
    hf = derived.spec if derived.family.from_checkpoint else None  # cut by its own plan
    mine, stages = prune_to_stage(model, chunks, comm.topo.coord("pp"), p, hf)
    if hf is not None and cfg.parallel.sp:  # a stage's input is s/tp tokens of each sequence
        stages.shard_sequence(comm.topo.size("tp"))
    return Pipeline(stages, mine, len(chunks), cfg, comm)
