"""The planner's prediction for one given config (used by `explain` and `train --plan auto`).

Model states come from the ZeRO units of the real model built on fake tensors (so frozen
parameters, tied weights and image models are exact); transformer activations from the
formula in activations.py; image models' activations from one forward on fake tensors under
the engine's own saved-tensor accounting (memory.ActivationMeter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.config import Config
from shardwise.data.callables import resolve
from shardwise.distributed import device as dev
from shardwise.errors import ConfigError
from shardwise.finetune import build_adapted
from shardwise.finetune.lora import EXPERTS
from shardwise.finetune.quant import quant_layers
from shardwise.job.experts import expert_units, in_forward_order, routed_spec
from shardwise.models import count_params
from shardwise.optim import EIGHT_BIT
from shardwise.optim.nvme import chunk_elements
from shardwise.parallel.recompute import apply_recompute
from shardwise.parallel.sync_batchnorm import apply_sync_batchnorm
from shardwise.parallel.zero_units import unit_roots
from shardwise.plan import activations as act
from shardwise.plan import compression, moe, traffic
from shardwise.plan import memory as mem
from shardwise.plan.buffers import zero_transient
from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import FineTune, Job, Layout, as_data_parallel
from shardwise.plan.search import evaluate
from shardwise.plan.shapes import Unit, linear_shapes, split_trainable
from shardwise.training.memory import ActivationMeter, tensor_bytes
from shardwise.training.runtime import cast_for_compute, freeze


def job_from_config(
    cfg: Config, hardware: Hardware, devices: int, spec=None, finetune: FineTune | None = None
) -> Job:
    from shardwise.training.validate import model_spec

    spec = spec or model_spec(cfg)
    return Job(
        spec=spec,
        hardware=hardware,
        devices=devices,
        seq_len=cfg.data.seq_len,
        packed=cfg.data.pack,
        loss_chunks=cfg.train.loss_chunks,
        global_batch=cfg.train.global_batch,
        precision=cfg.precision.compute,
        reduce=cfg.precision.reduce,
        fp8=cfg.precision.fp8,
        finetune=finetune or finetune_of(cfg, spec),
        pp_split=cfg.parallel.pp_split,
        bucket_mb=cfg.parallel.bucket_mb,
        powersgd_rank=cfg.parallel.powersgd_rank,
        compressions=tuple(dict.fromkeys(("none", cfg.parallel.grad_compression))),
        nvme_chunk=chunk_elements(cfg.memory.nvme_buffer_mb),
    )


def finetune_of(cfg: Config, spec) -> FineTune:
    """The planner's fine-tuning inputs from the train config's `finetune.*` keys (one source
    of truth): LoRA's targets as the planner's names of the block linears they match."""
    ft, eight = cfg.finetune, cfg.optim.name in EIGHT_BIT
    if not ft.lora_rank:
        return FineTune(base_quant=ft.base_quant, optim_8bit=eight)
    tags = tuple(linear_shapes(spec)) if spec.is_transformer else ()
    pats = [p.strip() for p in ft.lora_targets.split(",") if p.strip()]
    if pats != ["all-linear"] and tags:
        for pat in pats:
            if pat.rpartition(".")[2] not in tags and pat != EXPERTS:
                raise ConfigError(
                    f"finetune.lora_targets pattern '{pat}' matches no linear layer of the "
                    f"planned model. Fix: some of {', '.join(tags)}, or all-linear."
                )
        tags = tuple(t for t in tags if any(p.rpartition(".")[2] == t for p in pats))
    return FineTune(ft.lora_rank, tags, ft.base_quant, eight, ft.lora_dropout)


def layout_from_config(cfg: Config, derived) -> Layout:
    p = cfg.parallel
    return Layout(
        tp=derived.tp,
        pp=derived.pp,
        dp=derived.dp,
        zero=p.zero,
        sp=p.sp,
        pp_schedule=p.pp_schedule,
        pp_virtual=p.pp_virtual,
        micro_batch=derived.micro_batch,
        recompute=cfg.memory.recompute,
        offload=cfg.memory.offload,
        compression=p.grad_compression,
        cp=derived.cp,
        cp_mode=p.cp_mode,
        ep=derived.ep,
    )


def model_units(model: torch.nn.Module) -> list[Unit]:
    """The engine's ZeRO units of a real (meta or fake) model as planner units (trainable and
    frozen parameters apart, as the engine keeps them)."""
    return split_trainable(
        [
            Unit(name, tuple((p.numel(), p.requires_grad, tuple(p.shape)) for *_, p in entries))
            for name, entries, _ in unit_roots(model)
        ]
    )


def _to_fake(model: torch.nn.Module) -> None:
    """Meta parameters and buffers -> fake tensors of the active FakeTensorMode, assigned in
    place (Module.to_empty would swap them, which fake tensors refuse); a tied weight once.
    A quantised linear holds no codes here: it multiplies by a weight of its shape only."""
    for _, layer in quant_layers(model):
        layer.shape_only = True
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    new = torch.empty(t.shape, dtype=t.dtype)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    done[id(t)] = new
                store[key] = done[id(t)]


@contextlib.contextmanager
def _as_in_training() -> Iterator[None]:
    """transformers reads the position ids' values to tell packed rows from plain ones, and
    on fake tensors, which have none, assumes packing: an explicit mask (and repeated k/v
    heads instead of SDPA's GQA) that the real run does not save. The rows this forward
    feeds are plain (a packed run passes its own mask), so answer as the real run does."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _meta_model(cfg: Config, spec):
    """The model on meta as training builds it: adapters added, the base quantised, frozen."""
    model = build_adapted(spec, cfg.finetune)[0]
    freeze(model, cfg.train.freeze)
    return model


class _PlanTopology:
    def __init__(self, tp: int) -> None:
        self.tp = tp

    def size(self, dim: str) -> int:
        return self.tp if dim == "tp" else 1

    def coord(self, dim: str) -> int:
        return 0


class _PlanComm:
    """A tp group of `tp` ranks for the planner's meta and fake models: the sharder reads its
    size and this rank's place (rank 0); the collectives of a fake forward leave their
    outputs as allocated (fake tensors hold no values, only shapes)."""

    def __init__(self, tp: int) -> None:
        self.topo = _PlanTopology(tp)

    def all_reduce(self, *args, **kwargs) -> None:
        return None

    all_gather = reduce_scatter = all_reduce


def _split_tp(model: torch.nn.Module, cfg: Config, derived):
    """Cut the meta model to tp rank 0's shard of every planned layer, as training does
    (parallel/tensor.apply_tensor_parallel with the model's published plan); returns the
    transformation (its loss: vocabulary-parallel when the head is split), None at tp = 1."""
    if derived.tp == 1:
        return None
    from shardwise.models.tp_plans import plan_for
    from shardwise.parallel.tensor import apply_tensor_parallel

    plan = plan_for(model, derived.spec.arch)
    return apply_tensor_parallel(model, _PlanComm(derived.tp), plan, cfg.parallel.sp)


def _loss(tp, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed loss as training computes it (runtime.Run.loss_sum): the tp shard's own."""
    if tp is not None:
        return tp.loss_sum(logits, targets)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")


def real_model(cfg: Config, spec) -> tuple[list, int, int, bool]:
    """(ZeRO units, module buffer bytes, matmul parameters, whether its head is tied to the
    embedding) of `spec`'s real model (job/real.py): every parameter but lookup tables
    costs matmul FLOPs."""
    model = _meta_model(cfg, spec)
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookups -= {id(head.weight)} if head is not None else set()
    matmul = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return model_units(model), buffers, matmul, _tied_first(model)


def measure_activations(cfg: Config, spec, recompute: str, micro_batch: int) -> int:
    """Saved bytes of one micro-batch of `micro_batch` samples on `spec`'s real model."""
    from shardwise.models.families import family_of
    from shardwise.training.validate import Derived

    derived = Derived(1, 1, 1, 1, micro_batch, 1, cfg.data.seq_len, spec, family_of(spec))
    model = _meta_model(cfg, spec)
    with FakeTensorMode():
        _to_fake(model)
        return _fake_activations(model, cfg, derived, recompute)


def _as_trained(model, cfg: Config, derived, recompute: str) -> None:
    """The forward transformations training applies to the model (runtime.parallelize, same
    order): recomputation, then BatchNorm over every dp replica whenever
    `model.sync_batchnorm` is on (any world size: at dp = 1 its arithmetic is the same), whose
    fp32 statistics save more for backward than torch's fused BatchNorm; then the compute
    dtype. A fake BatchNorm skips its running-statistics update: it reads the global count's
    value (which fake tensors do not have) and, under no_grad, saves nothing for backward."""
    apply_recompute(model, derived.family, recompute)
    if cfg.model.sync_batchnorm and apply_sync_batchnorm(model, _PlanComm(1)):
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.track_running_stats = False
    cast_for_compute(model, dev.dtype_of(cfg.precision.compute))


def _fake_activations(model, cfg: Config, derived, recompute: str | None = None, tp=None) -> int:
    """Bytes saved for backward by one micro-batch's forward and loss, on fake tensors (for
    models without a formula: image models and Hugging Face definitions); `tp`: the shard's
    tensor parallelism (`_split_tp`)."""
    _as_trained(model, cfg, derived, recompute or cfg.memory.recompute)
    meter = ActivationMeter(model)
    b = derived.micro_batch
    if cfg.data.dataset == "digits":  # images: a ResNet, or your module on images
        size = cfg.data.image_size
        shape = (b, derived.spec.in_channels, size, size)
        inputs = torch.zeros(shape, dtype=dev.dtype_of(cfg.precision.compute))
        targets = torch.zeros(b, dtype=torch.long)
    elif ":" in cfg.data.dataset:  # your dataset (data/user.py): b items shaped as its first
        inputs, targets = _user_batch(cfg.data.dataset, b)
    elif derived.family.classifier:  # ids and attention mask packed, one label each
        inputs = torch.ones(b, 2, cfg.data.seq_len, dtype=torch.long)
        targets = torch.zeros(b, dtype=torch.long)
    elif cfg.data.pack:  # ids and record numbers [b, 2, s], targets apart (models/packing.py)
        inputs = torch.zeros(b, 2, cfg.data.seq_len, dtype=torch.long)
        inputs[:, 1] = 1
        targets = torch.zeros(b, cfg.data.seq_len, dtype=torch.long)
    else:  # token ids and targets: views of one (b, s+1) window, as the loader makes them
        window = torch.zeros(b, cfg.data.seq_len + 1, dtype=torch.long)
        inputs, targets = window[:, :-1], window[:, 1:]
    if inputs.is_floating_point():  # images (and your float inputs) enter in compute dtype
        inputs = inputs.to(dev.dtype_of(cfg.precision.compute))
    with meter.measure(), _as_in_training():
        logits = model(inputs)
        if cfg.train.loss != "cross_entropy":  # yours, on whole outputs (as Run.loss_sum)
            resolve(cfg.train.loss, "train.loss")(logits, targets)
        else:
            logits = getattr(logits, "logits", logits)  # a Hugging Face output object
            _loss(tp, logits, targets)
    return meter.take_peak()


def _repeated_kv_bytes(job: Job, layout: Layout) -> float:
    """What transformers' attention through the cp kernels saves beyond its own SDPA: SDPA
    attends to k/v at their KV heads (`enable_gqa` for head dims up to 256, transformers'
    sdpa_attention `use_gqa_in_sdpa`), the kernels keep them repeated to H heads
    (context_hf.py): 2·(H − KV)·b·(s/cp)·head_dim more elements a layer, in the compute
    dtype. A recomputed block keeps only its input. 0 at cp = 1."""
    spec = job.spec
    gqa_sdpa = spec.n_kv_heads < spec.n_heads and spec.head_dim <= 256
    if layout.cp == 1 or layout.recompute != "none" or not gqa_sdpa:
        return 0.0
    local = job.seq_len // layout.cp
    extra = 2 * (spec.n_heads - spec.n_kv_heads) * layout.micro_batch * local * spec.head_dim
    return extra * job.bc * spec.n_layers


def _local(cfg: Config, cp: int) -> Config:
    """`cfg` with the sequence a cp rank holds of each sample (cp = 1: `cfg`)."""
    if cp == 1:
        return cfg
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, seq_len=cfg.data.seq_len // cp)
    )


def _user_batch(source: str, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`b` samples shaped as the first item of your dataset (read for real, outside the fake
    mode the activations are measured in)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from shardwise.data.user import load_user

    with unset_fake_temporarily():
        x, y = load_user(source, "train").get_batch(torch.tensor([0]))
    return torch.zeros(b, *x.shape[1:], dtype=x.dtype), torch.zeros(b, *y.shape[1:], dtype=y.dtype)


def _stage_model(cfg: Config, derived, layout: Layout, stage: int):
    """(the decoder-shaped view of pipeline rank `stage`'s meta model, its ZeRO units), cut as
    training cuts it (parallel/pipeline_split)."""
    from shardwise.parallel.pipeline_split import plan_chunks, prune_to_stage

    model = _meta_model(cfg, derived.spec)
    p, v = layout.pp, layout.pp_virtual
    chunks = plan_chunks(derived.spec, p, v, cfg.parallel.pp_split, cfg.data.seq_len)
    hf = derived.spec if derived.family.from_checkpoint else None  # cut by its own plan
    mine, view = prune_to_stage(model, chunks, stage, p, hf)
    tp = _split_tp(model, cfg, derived)
    return (model, view, mine, tp), model_units(model)


def _tied_first(model: torch.nn.Module) -> bool:
    """Whether another root module uses the first ZeRO unit's parameters (a tied head)."""
    roots = unit_roots(model)
    return bool(roots) and len(roots[0][2]) > 1


def _buffers(us: list, job: Job, layout: Layout, module_buffers: int) -> float:
    """`buffers` of a real model: ZeRO's transient units and gradient buffers (a tied head,
    `job.spec.tie_embeddings`, re-gathers the first unit), compression state, and the
    module's own buffers."""
    wire = compression.zero_wire_copy(layout)
    tied = job.spec.tie_embeddings
    # ZeRO-3 gathers a root's expert unit with its dense one (both hook the block) and
    # prefetches the previous root's last unit; ZeRO-2 only has gradients in flight, unit by
    # unit (parallel/zero.py), so there the expert unit counts as a root of its own
    together = ("[frozen]", "[experts]") if layout.zero == 3 else ("[frozen]",)
    return (
        zero_transient(us, job, layout.dp, layout.zero, wire, tied, together)
        + compression.state_bytes(job, layout, us)
        + module_buffers
    )


def _hf_stage(cfg: Config, derived, job: Job, layout: Layout, stage: int) -> tuple:
    """(`mem_bytes`, dense ZeRO units, expert units) of pipeline rank `stage` of a Hugging
    Face causal LM or our MoE decoder: its units' states (its own layers' experts apart), and
    one micro-batch's saved bytes from a fake forward of its chunk (embedding, layers, norm +
    head + loss as it holds them) times the micro-batches its schedule keeps."""
    (model, view, mine, tp), us = _stage_model(cfg, derived, layout, stage)
    us, experts = expert_units(model, layout.ep) if layout.ep > 1 else (us, [])
    quantised = [m.shape for _, m in quant_layers(model)]
    shards = mem.quantised_shards(layout)
    states = mem.model_states(us, job, layout.dp, layout.zero, layout.offload, quantised, shards)
    if experts:  # this stage's experts, sharded over their own holders (parallel/expert.py)
        edp_job, edp = mem.expert_group(job, layout, layout.ep)
        more = mem.model_states(experts, edp_job, edp.dp, edp.zero, edp.offload, None, shards)
        mem.add_states(states, more)
    b, s = derived.micro_batch, cfg.data.seq_len
    with FakeTensorMode():
        _to_fake(model)
        ordered = in_forward_order(us, experts)
        states["buffers"] = _buffers(ordered, job, layout, tensor_bytes(model.buffers()))
        states["buffers"] += mem.quantised_transient(job, layout, stage, quantised)
        _as_trained(model, cfg, derived, cfg.memory.recompute)
        meter = ActivationMeter(model)
        with meter.measure(), _as_in_training():
            first, last = any(c.first for c in mine), any(c.last for c in mine)
            if first:
                h = view.embed_tokens(torch.zeros(b, s + 1, dtype=torch.long)[:, :-1])
            else:  # the received activations: a leaf that needs its gradient
                h = torch.zeros(b, s, derived.spec.dim, dtype=dev.dtype_of(cfg.precision.compute))
                h.requires_grad_(True)
            edge = meter.current
            for c in mine:
                for i in c.blocks:
                    h = view.blocks[str(i)](h)
            blocks = meter.current - edge
            if last:
                logits = view.output(h)
                _loss(tp, logits, torch.zeros(b, s, dtype=torch.long))
            tail = meter.current - edge - blocks
    m = layout.micro_batches(job)
    held = act.in_flight(layout.pp_schedule, layout.pp, m, layout.pp_virtual, stage)
    one = layout.pp_schedule in ("1f1b", "interleaved")  # the last stage's loss: one at a time
    states["activations"] = (edge + blocks) * held + tail * (1.0 if one else held)
    states["total"] = sum(v for k, v in states.items() if not k.startswith(("host_", "disk_")))
    return states, us, experts


def _expert_traffic(comm: dict, calls: dict, job: Job, layout: Layout, experts: list) -> None:
    """Add the expert units' gradient reduction (and ZeRO gathers) over the (dp / ep)·tp ranks
    holding the same experts to `comm`/`calls`' dp entries, where comm.py counts them."""
    edp_job, edp = mem.expert_group(job, layout, layout.ep)
    held = dataclasses.replace(edp_job, frozen=tuple(experts))
    comm["dp"] += traffic.traffic(held, edp)["dp"]
    calls["dp"] += traffic.collective_calls(held, edp)["dp"]


TIME_KEYS = ("step_time_s", "tokens_per_s", "mfu", "mfu_causal", "hfu", "flop_convention", "time")


def _moe_time(job: Job, layout: Layout, us: list[Unit]) -> dict:
    """The step time of an MoE decoder's layout, as `plan` prices it (plan/moe.py: its blocks
    kernel by kernel, the exposed all-to-all under ep, MFU of the active parameters), from
    the real model's units; the model states and traffic stay the measured ones."""
    rec = evaluate(dataclasses.replace(job, frozen=tuple(us)), layout)
    return {k: rec[k] for k in TIME_KEYS}


def predict_config(cfg: Config, derived, hardware: Hardware) -> tuple[int, dict]:
    """(parameter count, the planner's candidate record for exactly this config)."""
    job = job_from_config(cfg, hardware, derived.world, derived.spec)
    layout = layout_from_config(cfg, derived)
    formula = derived.family.formula  # our blocks: activations by formula
    model = _meta_model(cfg, derived.spec)  # as training builds it
    n = count_params(model)
    quantised = [m.shape for _, m in quant_layers(model)]
    tp = None
    if not formula:  # a real model's units and fake forward: rank 0's tp shard of it
        tp = _split_tp(model, cfg, derived)
    us = model_units(model)
    dense, experts = expert_units(model, layout.ep) if layout.ep > 1 else (us, [])
    if quantised:  # the NF4 base: bitsandbytes' bytes per layer, outside the ZeRO units
        n += sum(a * b for a, b in quantised)
        job = dataclasses.replace(job, quantised_shapes=tuple(quantised))
    with FakeTensorMode():
        _to_fake(model)
        module_buffers = tensor_bytes(model.buffers())
        # the whole model's saved bytes (a pipeline measures each stage below), and which
        # quantised linears backward uses
        if (not formula and layout.pp == 1) or quantised:  # (cp > 1: at the local length)
            activations = _fake_activations(model, _local(cfg, layout.cp), derived, tp=tp)
    if quantised:
        backward = tuple(m.input_needs_grad for _, m in quant_layers(model))
        job = dataclasses.replace(job, quantised_backward=backward)
    if not formula:  # whether a head gathers the embedding's unit again: the real module's
        # sharing, not the config's flag (a BERT classifier's config ties; it has no LM head)
        spec = dataclasses.replace(job.spec, tie_embeddings=_tied_first(model))
        job = dataclasses.replace(job, spec=spec)
    if not formula and layout.pp > 1:  # a Hugging Face causal LM or MoE decoder in stages
        stages = [_hf_stage(cfg, derived, job, layout, r) for r in range(layout.pp)]
        keys = list(stages[0][0])
        states = {k: max(s.get(k, 0) for s, _, _ in stages) for k in keys}
        real = dataclasses.replace(job, frozen=tuple(stages[0][1]))
        comm, calls = traffic.traffic(real, layout), traffic.collective_calls(real, layout)
        if layout.ep > 1:  # stage 0's experts over their holders; the busiest stage's exchange
            _expert_traffic(comm, calls, job, layout, stages[0][2])
            moe_layers = max(len(e) for _, _, e in stages)
            routed = dataclasses.replace(job, spec=routed_spec(job.spec, model))
            comm["ep"], calls["ep"] = traffic.ep_traffic(routed, layout, layers=moe_layers)
        return n, {
            **layout.record(),
            "mem_bytes": {k: int(v) for k, v in states.items()},
            "comm_bytes": comm,
            "comm_calls": calls,
        }
    if not formula:  # states + the fake forward's bytes (unsharded models only)
        # cp > 1: dp x cp replicas at seq_len / cp, as `evaluate` prices our decoders
        whole, asked = job, layout
        job, layout = as_data_parallel(job, layout)
        # a quantised base is split over tp (and dp under ZeRO-3) as the engine splits it
        shards = mem.quantised_shards(layout)
        states = mem.model_states(dense, job, layout.dp, layout.zero, layout.offload, None, shards)
        edp_job, edp = mem.expert_group(job, layout, asked.ep)  # (ep = 1: no expert units)
        more = {}
        if experts:
            more = mem.model_states(experts, edp_job, edp.dp, edp.zero, edp.offload, None, shards)
            mem.add_states(states, more)
        states["buffers"] = _buffers(in_forward_order(dense, experts), job, layout, module_buffers)
        states["buffers"] += mem.quantised_transient(job, layout) if quantised else 0
        # what transformers' attention through the cp kernels saves beyond the fake forward's
        # SDPA (parallel/context_hf.py: the same kernels as our decoders')
        states["activations"] = activations + mem.cp_saved_bytes(whole, asked)
        states["activations"] += _repeated_kv_bytes(whole, asked)
        states["total"] = sum(v for k, v in states.items() if not k.startswith(("host_", "disk_")))
        # data-parallel traffic and calls from the real units (of tp rank 0's shard)
        real = dataclasses.replace(job, frozen=tuple(dense))
        comm, calls = traffic.traffic(real, layout), traffic.collective_calls(real, layout)
        if experts:  # the expert units' reduction over their holders, counted under dp
            _expert_traffic(comm, calls, job, layout, experts)
        if asked.ep > 1:  # the token exchange, at balanced routing (traffic.ep_traffic)
            routed = dataclasses.replace(whole, spec=routed_spec(whole.spec, model))
            comm["ep"], calls["ep"] = traffic.ep_traffic(routed, asked)
        if asked.cp > 1:  # the attention's exchange, from the sequence split itself
            kinds, calls["cp"] = traffic.cp_traffic(whole, asked)
            comm["cp"] = sum(kinds.values())
        out = {
            **asked.record(),
            "mem_bytes": {k: int(v) for k, v in states.items()},
            "comm_bytes": comm,
            "comm_calls": calls,
        }
        if more:  # of which the expert units (parallel.ep), per rank
            out["expert_mem_bytes"] = {k: int(v) for k, v in more.items() if v}
        if moe.is_moe(whole.spec):  # our MoE decoder: its step time (plan/moe.py)
            out.update(_moe_time(whole, asked, us))
        return n, out
    if layout.pp == 1 and layout.tp == 1:  # the real model's units: frozen parameters exact
        job = dataclasses.replace(job, frozen=tuple(us))
    return n, evaluate(job, layout)
