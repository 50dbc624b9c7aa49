"""`shardwise explain`: every derived value of a config and the planner's per-rank prediction
for exactly that config, without starting training.

The prediction is `shardwise.plan`'s (job/predict.py): model states exact from the engine's
unit layout, activations from the per-layer formula of our blocks (checked byte for byte
against the engine's saved-tensor accounting), ZeRO buffers by replaying the engine's schedule,
traffic as comm.py counts it, and the step time on the detected hardware (a catalog GPU, or
this CPU calibrated on the spot)."""

from __future__ import annotations

from shardwise.config import Config
from shardwise.finetune.lora import is_lora_layer
from shardwise.finetune.quant import quant_layers
from shardwise.job.fake import meta_model
from shardwise.job.predict import predict_config
from shardwise.models.expert_lora import adapted_weights
from shardwise.optim import EIGHT_BIT
from shardwise.parallel.fp8 import fp8_price_note
from shardwise.plan.gpu import ALIGN, misaligned
from shardwise.plan.hardware import Hardware, detect_hardware
from shardwise.plan.layout import BYTES
from shardwise.training.checks import compile_refusal
from shardwise.training.metrics import human_bytes
from shardwise.training.validate import Derived, derive


def ep_note(d: Derived, record: dict) -> str:
    """What explain says about parallel.ep: the expert/dense split of the model states per
    rank and the routing its ep traffic assumes."""
    ex, mem_b = record["expert_mem_bytes"], record["mem_bytes"]
    split = ", ".join(
        f"{k} {human_bytes(ex.get(k, 0))} experts + {human_bytes(mem_b[k] - ex.get(k, 0))} dense"
        for k in ("params", "grads", "master", "optimizer")
        if mem_b.get(k)
    )
    return (
        f"shardwise: parallel.ep={d.ep}: each rank holds 1/{d.ep} of every MoE layer's experts, "
        f"reduced (and ZeRO-sharded) over the {d.dp * d.cp // d.ep} rank(s) holding the same "
        f"ones; per rank {split}. comm_bytes.ep prices balanced, dropless routing; a real "
        "run's depends on its routing (the same formula at its rows, docs/moe.md)."
    )


def explain_record(cfg: Config, world: int, hardware: Hardware | None = None) -> dict:
    """Every derived value of `cfg` on `world` ranks and the planner's prediction for it."""
    d = derive(cfg, world)
    hw = hardware or detect_hardware()
    n, pred = predict_config(cfg, d, hw)
    record = {
        "world": world,
        "pp": d.pp,
        "dp": d.dp,
        "cp": d.cp,
        "ep": d.ep,
        "tp": d.tp,
        "zero": cfg.parallel.zero,
        "grad_compression": _compression(cfg),
        "model": cfg.model.name,
        "arch": d.spec.arch,
        "params": n,
        **parameter_counts(cfg, d.spec),
        "optimizer": cfg.optim.name,
        "optimizer_state_dtype": "int8" if cfg.optim.name in EIGHT_BIT else "fp32",
        "sample_unit": "rows" if d.tokens_per_sample == 1 else "tokens",
        "n_layers": d.spec.n_layers,
        "dim": d.spec.dim,
        "global_batch": cfg.train.global_batch,
        "micro_batch": d.micro_batch,
        "micro_batches_per_step": d.micro_batches,
        "tokens_per_step": d.tokens_per_step,
        "precision": cfg.precision.compute,
        "reduce": cfg.precision.reduce,
        "recompute": cfg.memory.recompute,
        "dataset": cfg.data.dataset,
        "seq_len": cfg.data.seq_len,
        "steps": cfg.train.steps,
        "offload": cfg.memory.offload,
        "pp_schedule": cfg.parallel.pp_schedule,
        "pp_virtual": cfg.parallel.pp_virtual,
        "hardware": hw.name,
        "mem_bytes": pred["mem_bytes"],
        "comm_bytes": {k: float(v) for k, v in pred.get("comm_bytes", {}).items()}
        or {"dp": 0.0, "tp": 0.0, "pp": 0.0},
        "comm_calls": pred.get("comm_calls", {"dp": 0, "tp": 0, "pp": 0}),
    }
    record.update(_predicted_extras(cfg, d, pred))
    if d.ep > 1:  # parallel/expert.py: the experts' share of the model states per rank
        record["expert_mem_bytes"] = pred.get("expert_mem_bytes", {})
    if "activations_unmeasured" in pred:  # the forward read a value: job/fake.py
        record["activations_unmeasured"] = pred["activations_unmeasured"]
    warnings = _warnings(cfg, d, hw, record)
    if any(warnings):
        record["warnings"] = [w for w in warnings if w]
    return record


def _predicted_extras(cfg: Config, d: Derived, pred: dict) -> dict:
    """What the prediction adds where it applies: disk traffic (optim/nvme.py), the step
    time and MFU, and the per-rank state each checkpoint holds."""
    out = {}
    mem_b = pred["mem_bytes"]
    if mem_b.get("disk_optimizer") or mem_b.get("disk_params"):  # optim/nvme.py, per step:
        # the state read and written once, each slice read for every gather
        gathers = 2 * d.micro_batches if cfg.parallel.zero == 3 else 0
        out["disk_bytes_per_step"] = 2 * mem_b.get("disk_optimizer", 0) + gathers * mem_b.get(
            "disk_params", 0
        )
    for key in (
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "mfu_causal",
        "hfu",
        "flop_convention",
        "time",
    ):
        if key in pred:
            out[key] = pred[key]
    # PowerSGD's per-rank state in each checkpoint (checkpoint/state.py): its error memory is
    # at most the fp32 size of the gradients this rank reduces, Q and the stream are small
    if cfg.parallel.grad_compression == "powersgd" and d.dp > 1 and cfg.checkpoint.per_rank_state:
        elements = mem_b.get("grads", 0) / BYTES[cfg.precision.reduce]
        out["checkpoint_per_rank_bytes"] = int(4 * elements)
    return out


def _warnings(cfg: Config, d: Derived, hw: Hardware, record: dict) -> list[str | None]:
    """The notes explain prints beside the numbers (None: a check that found nothing)."""
    warnings = [
        cpu_precision_warning(cfg.precision.compute, hw),
        alignment_warning(d.spec, cfg.precision.compute, hw, d.tp),
    ]
    compiled, refused = cfg.train.compile != "false", compile_refusal(cfg, d.family)
    warnings.append(fp8_price_note(cfg.precision.fp8, compiled, hw.name == "cpu", refused))
    if d.cp > 1:
        warnings.append(
            f"shardwise: parallel.cp={d.cp} ({cfg.parallel.cp_mode}) is priced as dp x cp = "
            f"{d.dp * d.cp} replicas each seeing data.seq_len / cp = {cfg.data.seq_len // d.cp} "
            "tokens per sample (states sharded over all of them, activations at the local "
            "length), plus what its attention saves (in activations), sends (comm_bytes and "
            "comm_calls under cp) and holds in flight (in the fit check); the step time adds "
            "the attention of the local queries over the whole sequence (time.cp_attention_s) "
            "and the exchange (time.cp_comm_s; the ring's hidden behind its blocks' attention, "
            "Ulysses' all-to-alls exposed: time.cp_exposed_s). Not priced: the cp group's "
            "communicator buffers."
        )
    if d.ep > 1:
        warnings.append(ep_note(d, record))
    if "activations_unmeasured" in record:
        warnings.append(
            "shardwise: activations are not predicted (counted as 0 in the totals and the fit "
            f"check): the model's forward reads a tensor's values at "
            f"{record['activations_unmeasured']}, and the planner measures activations on "
            "fake tensors, which hold none. Keep such values on the device to have them priced."
        )
    if cfg.parallel.grad_compression != "none" and d.dp * d.cp == 1:
        warnings.append(
            f"shardwise: parallel.grad_compression={cfg.parallel.grad_compression} has no "
            "effect here: dp=1, no gradient is all-reduced over data-parallel ranks."
        )
    if cfg.optim.name == "paged_adamw8bit" and hw.name == "cpu":
        warnings.append(
            "shardwise: optim.name=paged_adamw8bit pages its state to host memory on a GPU "
            "(CUDA unified memory); on a CPU it has nothing to page to and runs as adamw8bit."
        )
    return warnings


def parameter_counts(cfg: Config, spec) -> dict:
    """What the model trains: its parameters trainable, frozen (LoRA's base, train.freeze) and
    quantised (a low-bit base, no longer parameters), counted on the model as training builds
    it on meta; and its LoRA adapters (rank 0: none)."""
    model = meta_model(cfg, spec)
    params = {id(p): p for p in model.parameters()}.values()  # a tied weight once
    ft = cfg.finetune
    return {
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "frozen_params": sum(p.numel() for p in params if not p.requires_grad),
        "quantised_params": sum(m.shape[0] * m.shape[1] for _, m in quant_layers(model)),
        "base_quant": ft.base_quant,
        "lora": {
            "rank": ft.lora_rank,
            "alpha": ft.lora_alpha if ft.lora_rank else 0.0,
            "targets": ft.lora_targets if ft.lora_rank else "",
            # linear layers peft wrapped, and stacked expert weights with a pair per expert
            "layers": sum(1 for m in model.modules() if is_lora_layer(m))
            + len(adapted_weights(model)),
        },
    }


def _millions(n: int) -> str:
    """A parameter count for reading: 7.24B, 1.44M, 18.69K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _trains(r: dict) -> str:
    """The parameters in a plan line: how many, and which of them train."""
    if not (r["frozen_params"] or r["quantised_params"]):
        return f"{_millions(r['params'])} params, all trainable"
    parts = [f"{_millions(r['trainable_params'])} trainable"]
    if r["frozen_params"]:
        parts.append(f"{_millions(r['frozen_params'])} frozen")
    if r["quantised_params"]:
        parts.append(f"{_millions(r['quantised_params'])} quantised {r['base_quant']}")
    return f"{_millions(r['params'])} params: {', '.join(parts)}"


def _lora(r: dict) -> str:
    lora = r["lora"]
    if not lora["rank"]:
        return "off"
    return (
        f"r={lora['rank']} alpha={lora['alpha']:g} on {lora['targets']} ({lora['layers']} layers)"
    )


def _optimizer(r: dict) -> str:
    dtype = r["optimizer_state_dtype"]
    how = " - block-wise: an fp32 scale per 256 values" if dtype == "int8" else ""
    return f"{r['optimizer']} (state {dtype}{how})"


def cpu_precision_warning(precision: str, hw: Hardware) -> str | None:
    """One line when a CPU run computes in a precision the CPU has no matrix units for."""
    from shardwise.distributed.device import cpu_matrix_units

    units = cpu_matrix_units()
    if hw.name != "cpu" or precision == "fp32" or precision in units:
        return None
    flag = {"bf16": "avx512_bf16 / amx_bf16", "fp16": "avx512_fp16 / amx_fp16"}[precision]
    slower = hw.peak["fp32"] / hw.peak[precision]
    better = " (or bf16, which it has)" if "bf16" in units else ""
    return (
        f"warning: this CPU has no {precision} matrix units ({flag}): its {precision} matmuls "
        f"run {slower:.0f}x slower than fp32 ({hw.calibrated}). Fix: "
        f"--precision.compute=fp32{better}"
    )


def alignment_warning(spec, precision: str, hw: Hardware, tp: int = 1) -> str | None:
    """One line when a GPU's 16-bit GEMMs would run misaligned: the planner prices GEMMs by
    size, not alignment, so its step time is optimistic there."""
    bad = misaligned(spec, tp)
    if hw.name == "cpu" or precision == "fp32" or not bad:
        return None
    shown = ", ".join(f"{name} {n}" for name, n in bad.items())
    fix = ""
    if "head dim" in bad and spec.head_dim_override:  # a width of its own: change it alone
        fix = f" Fix: e.g. --model.head_dim={-(-spec.head_dim // ALIGN) * ALIGN}."
    elif "head dim" in bad:
        dim = spec.dim
        heads = [h for h in range(1, dim + 1) if dim % h == 0 and (dim // h) % ALIGN == 0]
        if heads:
            best = min(heads, key=lambda h: (abs(h - spec.n_heads), h))
            fix = f" Fix: e.g. --model.n_heads={best} (head dim {dim // best})."
    return (
        f"warning: {shown}: not a multiple of {ALIGN}, so {precision} GEMMs on {hw.name} run off "
        "the Tensor Cores' alignment. BLOOM's steps with such head dims took x1.30-1.51 those "
        "of aligned ones; the planner prices it only for the unfused attention's GEMMs, where "
        f"a source measured it (Hardware.misaligned_slowdown), not elsewhere.{fix}"
    )


def checkpoint_bytes(r: dict) -> int:
    """A checkpoint's predicted size from an explain record: every rank's model states, each
    stored once (replicated copies, over dp, are written by one rank)."""
    mem, shards = r["mem_bytes"], r["tp"] * r["pp"]
    replicas = r["dp"] * r.get("cp", 1)  # ZeRO shards over every rank sharing the parameters
    zero = r["zero"]
    total = r.get("checkpoint_per_rank_bytes", 0) * r["world"]  # written by every rank
    for key, sharded in (("params", zero >= 3), ("master", zero >= 1), ("optimizer", zero >= 1)):
        for name in (key, f"host_{key}"):
            total += mem.get(name, 0) * shards * (replicas if sharded else 1)
    return int(total)


def print_plan(r: dict) -> None:
    """The short plan `train` prints before it starts."""
    print(
        f"shardwise: {r['model']} ({_trains(r)}) on {r['world']} rank(s): "
        f"pp={r['pp']} dp={r['dp']}{_cp(r)} tp={r['tp']} zero={r['zero']} | global batch "
        f"{r['global_batch']} = {r['micro_batch']} x {r['micro_batches_per_step']} micro x "
        f"{r['dp']} dp | {r['tokens_per_step']:,} {r['sample_unit']}/step | {r['precision']} | "
        f"predicted memory/rank {human_bytes(r['mem_bytes']['total'])}",
        flush=True,
    )
    tuned = f" | LoRA {_lora(r)}" if r["lora"]["rank"] else ""
    print(f"shardwise: optimizer {_optimizer(r)}{tuned}", flush=True)
    for line in r.get("warnings", []):
        print(line, flush=True)


def print_explain(r: dict) -> None:
    rows = [
        ("world size", r["world"]),
        ("mesh", f"pp={r['pp']} x dp={r['dp']}{_cp(r, ' x')} x tp={r['tp']}"),
        ("zero stage", r["zero"]),
        ("model", f"{r['model']} ({r['arch']})"),
        ("parameters", f"{r['params']:,}"),
        (
            "trainable / frozen / quantised",
            f"{r['trainable_params']:,} / {r['frozen_params']:,} / {r['quantised_params']:,}",
        ),
        ("base quantisation", r["base_quant"]),
        ("LoRA", _lora(r)),
        ("optimizer", _optimizer(r)),
        ("layers / hidden size", f"{r['n_layers']} / {r['dim']}" if r["dim"] else "(its own)"),
        ("global batch", r["global_batch"]),
        ("micro batch", r["micro_batch"]),
        ("micro-batches per step (accumulation)", r["micro_batches_per_step"]),
        (f"{r['sample_unit']} per step", f"{r['tokens_per_step']:,}"),
        ("compute / reduce precision", f"{r['precision']} / {r['reduce']}"),
        ("recompute", r["recompute"]),
        ("data", f"{r['dataset']} (seq_len {r['seq_len']})"),
        ("steps", r["steps"]),
        ("offload", r["offload"]),
        ("pipeline schedule / virtual", f"{r['pp_schedule']} / {r['pp_virtual']}"),
        ("dp traffic per step/rank", human_bytes(r["comm_bytes"]["dp"])),
        *(
            [("cp traffic per step/rank", human_bytes(r["comm_bytes"]["cp"]))]
            if "cp" in r["comm_bytes"]
            else []
        ),
        *(
            [("ep traffic per step/rank (balanced)", human_bytes(r["comm_bytes"]["ep"]))]
            if "ep" in r["comm_bytes"]
            else []
        ),
        ("hardware", r["hardware"]),
    ]
    if r.get("grad_compression", "none") != "none":
        rows.insert(-1, ("dp gradient compression", r["grad_compression"]))
    if r.get("disk_bytes_per_step"):
        rows.insert(-1, ("disk traffic per step/rank", human_bytes(r["disk_bytes_per_step"])))
    if "step_time_s" in r:
        rows += [
            ("predicted step time (s)", f"{r['step_time_s']:.4g}"),
            (f"predicted {r['sample_unit']}/s", f"{r['tokens_per_s']:,.0f}"),
            ("predicted mfu", f"{100 * r['mfu']:.1f}%"),
            ("predicted hfu", f"{100 * r['hfu']:.1f}%"),
        ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("memory per rank:")
    for key, value in r["mem_bytes"].items():
        print(f"  {key:<12} {human_bytes(value):>10}  ({value:,} B)")
    if "flop_convention" in r:
        print(f"flops: {r['flop_convention']}")
    for line in r.get("warnings", []):
        print(line)


def _cp(r: dict, sep: str = "") -> str:
    """The context-parallel degree in a mesh line, when the sequence is split."""
    return f"{sep} cp={r['cp']}" if r.get("cp", 1) > 1 else ""


def _compression(cfg: Config) -> str:
    p = cfg.parallel
    if p.grad_compression == "none":
        return "none"
    if p.grad_compression == "powersgd":
        return f"powersgd (rank {p.powersgd_rank}, warm start {p.powersgd_warm_start})"
    return f"{p.grad_compression} wire"
