"""The configuration: one typed dataclass tree, loaded from TOML and `--section.key=value`.

Every field carries a help string (the README's config reference is generated from them).
Unknown keys are rejected with a did-you-mean; values are parsed by the field's type;
cross-field checks live in `validate()` and print every factor of a failed product.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from shardwise.errors import ConfigError

Precision = Literal["fp32", "bf16", "fp16"]


def opt(default: Any, help: str, check: Any = None) -> Any:
    """A dataclass field with a help string; `check(key, value)` returns the value to keep
    (normalised) or raises a ConfigError."""
    return field(default=default, metadata={"help": help, **({"check": check} if check else {})})


@dataclass
class ModelConfig:
    name: str = opt(
        "tiny",
        "Named model: tiny, 125m, 1b, 7b, 13b, 70b, 175b (decoder), moe-tiny, moe-1b "
        "(mixture of experts), gpt2-tiny, gpt2-125m (GPT-2 style), hf-llama-tiny, hf-gpt2-tiny "
        "(Hugging Face LlamaForCausalLM / GPT2LMHeadModel), resnet18, resnet50 (images), or "
        "your own "
        "nn.Module: module:factory or file.py:factory, or hf: transformers' own class for "
        "the checkpoint in model.init_from (any architecture it builds).",
    )
    task: Literal["causal_lm", "classification"] = opt(
        "causal_lm",
        "What model.name=hf trains: causal_lm (next token) or classification (a sequence "
        "classifier over data.label_field, a new head).",
    )
    n_layers: int = opt(0, "Override the preset's number of transformer blocks (0 = preset).")
    dim: int = opt(0, "Override the hidden size (0 = preset).")
    n_heads: int = opt(0, "Override the number of attention heads (0 = preset).")
    n_kv_heads: int = opt(
        0, "Override the key/value heads for grouped-query attention (0 = preset)."
    )
    head_dim: int = opt(
        0,
        "Channels per attention head (0 = dim / n_heads); q/k/v are n_heads * head_dim wide "
        "whatever dim is, as Qwen3's 32 heads of 128 on a 2048-wide model.",
    )
    ffn_dim: int = opt(0, "Override the MLP hidden size (0 = preset).")
    vocab_size: int = opt(
        0, "Override the vocabulary size; the BPE tokenizer is trained to it (0 = preset)."
    )
    tie_embeddings: Literal["preset", "true", "false"] = opt(
        "preset", "Share input embedding and output head: true, false or preset."
    )
    max_seq_len: int = opt(
        0,
        "Override the longest sequence the model takes (0 = preset): RoPE decoders compute "
        "their angles for any position; GPT-2's learned position table grows to it.",
    )
    dropout: float = opt(
        0.0,
        "Dropout on the embeddings and each residual branch (decoder/gpt2 models); masks "
        "depend on (seed, step, sample, position) only, so every layout drops the same.",
    )
    attn_dropout: float = opt(
        0.0, "Dropout on attention probabilities (decoder/gpt2; computes the softmax explicitly)."
    )
    init_from: str = opt(
        "",
        "Start from Hugging Face weights: a directory with config.json and safetensors of a "
        "Llama/GPT-2 (built-in decoders) or any model (model.name=hf); its sizes replace "
        "the preset's and each rank reads only what it keeps ('' = init from train.seed).",
    )
    sync_batchnorm: bool = opt(
        True,
        "BatchNorm normalises with the statistics of every data-parallel replica's micro-batch "
        "together (one all-reduce per BatchNorm forward), so dp ranks x micro-batch b equals one "
        "process with micro-batch dp*b; false: each replica's own (faster, layout-dependent).",
    )
    n_experts: int = opt(
        0,
        "Routed experts per MoE layer (0 = the preset's: none for dense presets; > 0 turns a "
        "decoder preset's MLPs into MoE layers of that many SwiGLU experts of model.ffn_dim).",
    )
    top_k: int = opt(0, "Experts each token is routed to (token choice; 0 = the preset's, 2).")
    n_shared_experts: int = opt(
        -1, "Always-on shared experts per MoE layer, beside the routed ones (-1 = the preset's)."
    )
    moe_every: int = opt(1, "Every k-th block has an MoE layer, the others a dense MLP (1 = all).")
    router: Literal["softmax", "sigmoid"] = opt(
        "softmax",
        "MoE router scores: softmax (top-k weights are the probabilities) or sigmoid (weights "
        "normalised over the chosen, DeepSeek-V3).",
    )
    capacity_factor: float = opt(
        0.0,
        "Expert capacity per sequence, ceil(factor * seq_len * top_k / n_experts) tokens; "
        "later tokens of the sequence are dropped and counted (0 = dropless).",
    )


@dataclass
class DataConfig:
    dataset: str = opt(
        "stdlib",
        "stdlib (Python's own sources), digits (scikit-learn images), a "
        "path/dir/glob of .txt, .jsonl, .json, .csv, .parquet files, a directory "
        "`shardwise data prepare` wrote, or your own dataset: "
        "module:factory or file.py:factory, factory(split) -> (input, target) items or None.",
    )
    seq_len: int = opt(128, "Tokens per sample (text).")
    text_field: str = opt("text", "Field holding the text in .jsonl/.json/.csv/.parquet files.")
    label_field: str = opt("label", "Field holding the label (model.task=classification).")
    format: Literal["text", "instruction", "chat"] = opt(
        "text",
        "text: documents packed into windows, every token a target; instruction: "
        "Alpaca-style records (prompt/input/response fields); chat: lists of messages "
        "rendered with the tokenizer's chat template. instruction/chat: one record per "
        "sample, loss on the response tokens only.",
    )
    prompt_field: str = opt(
        "instruction", "Field holding the instruction (data.format=instruction)."
    )
    input_field: str = opt(
        "input", "Field holding the optional input (data.format=instruction; '' = none)."
    )
    response_field: str = opt("output", "Field holding the response (data.format=instruction).")
    messages_field: str = opt(
        "messages", "Field holding the [{role, content}, ...] list (data.format=chat)."
    )
    pack: bool = opt(
        False,
        "Pack several instruction/chat records into each data.seq_len row (in order, none "
        "split) instead of one padded record per row; attention stays within each record and "
        "its positions restart, so every record's loss is the one it has alone.",
    )
    tokenizer: str = opt(
        "auto",
        "Tokenizer of text data: auto (the checkpoint's own when model.init_from is set, else "
        "a BPE trained on the data), bpe (always train one), or a folder holding a Hugging "
        "Face tokenizer (as tokenizer.save_pretrained writes it).",
    )
    max_bad_rows: int = opt(
        100,
        "Rows of .jsonl/.json/.csv/.parquet files whose text field is missing or null that are "
        "skipped (and counted) before the data is refused.",
    )
    prefetch: int = opt(
        0,
        "Micro-batches loaded ahead in background threads while the current one computes "
        "(0: each when needed). For a slow source: disk, network, your own get_batch.",
    )
    val_fraction: float = opt(0.02, "Fraction of documents held out for evaluation.")
    image_size: int = opt(32, "Digits are resized from 8x8 to this many pixels per side.")
    cache_dir: str = opt("", "Tokenizer/token cache ('' = $SHARDWISE_CACHE or ~/.cache/shardwise).")
    blend: str = opt(
        "",
        "Weighted blend of text corpora instead of data.dataset (leave that at its default): "
        "'dirA:0.7,dirB:0.3' (in a file also a [data.blend] table of \"dirA\" = 0.7 lines), "
        "prepared directories or raw corpora with one tokenizer; weights are normalised, "
        "sample i's source is a fixed function of i ('' = off).",
    )


@dataclass
class TrainConfig:
    steps: int = opt(200, "Optimizer steps to run.")
    global_batch: int = opt(16, "Samples per optimizer step over all data-parallel ranks.")
    micro_batch: int = opt(
        0,
        "Samples per forward/backward on one rank (0 = global_batch / dp, "
        "i.e. no gradient accumulation).",
    )
    lr: float = opt(3e-3, "Peak learning rate (after warm-up).")
    seed: int = opt(0, "Seed of parameter init, data order and random streams.")
    eval_every: int = opt(50, "Evaluate held-out loss every this many steps (0 = only at the end).")
    eval_batches: int = opt(4, "Global batches per evaluation.")
    freeze: str = opt(
        "",
        "Comma-separated parameter-name patterns (fnmatch) to freeze, e.g. "
        "'embed.*,blocks.0.*': not trained, not reduced, not in the optimizer.",
    )
    loss: str = opt(
        "cross_entropy",
        "cross_entropy, or your own: module:fn or file.py:fn, fn(output, target) -> the "
        "micro-batch's summed loss (divided by the global sample count).",
    )
    compile: Literal["false", "blocks"] = opt(
        "false",
        "blocks: compile each transformer block's forward with torch.compile (TorchInductor) "
        "once for all blocks of a shape; graph breaks are counted and reported after the "
        "first step. false: eager.",
    )
    loss_chunks: int = opt(
        0,
        "Compute the output head and cross-entropy this many chunks of tokens at a time, each "
        "chunk's gradient in the same pass, so the [tokens, vocab] logits are never held for "
        "backward (0 or 1 = off; built-in decoders, parallel.tp=1).",
    )
    max_skipped_steps: int = opt(
        10,
        "Stop with a diagnosis after this many steps in a row skipped for a non-finite loss "
        "or gradient norm (fp16 loss-scale overflows do not count; 0 = never stop).",
    )
    moe_aux_loss: float = opt(
        0.0,
        "Coefficient of the MoE load-balancing loss n_experts * sum_i f_i * P_i per sequence "
        "(Switch Transformers; e.g. 0.01; 0 = off). MoE models only.",
    )
    moe_bias_balance: float = opt(
        0.0,
        "Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing "
        "bias moves by this times sign(mean load - its load) (e.g. 0.001; 0 = off). MoE only.",
    )


@dataclass
class OptimConfig:
    name: Literal["adamw", "adamw8bit", "paged_adamw8bit"] = opt(
        "adamw",
        "adamw: torch's AdamW (fp32 moments); adamw8bit: bitsandbytes' block-wise 8-bit AdamW "
        "(Dettmers et al. 2022: both moments in one byte per element + an fp32 scale per "
        "256-element block); paged_adamw8bit: the same with its state in CUDA unified memory, "
        "paged to the host under GPU memory pressure (QLoRA; on a CPU it is adamw8bit).",
    )
    beta1: float = opt(0.9, "AdamW beta1.")
    beta2: float = opt(
        0.95,
        "AdamW beta2 (0.95 is the usual LLM choice: faster second-moment adaptation than 0.999).",
    )
    eps: float = opt(1e-8, "AdamW epsilon.")
    weight_decay: float = opt(0.1, "Decoupled weight decay (not applied to norms and biases).")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this (0 = off).")
    warmup_steps: int = opt(20, "Linear warm-up steps.")
    schedule: Literal["cosine", "constant"] = opt("cosine", "LR after warm-up: cosine or constant.")
    min_lr_ratio: float = opt(0.1, "Cosine decays to lr * min_lr_ratio.")


@dataclass
class FinetuneConfig:
    lora_rank: int = opt(
        0, "LoRA rank r (Hu et al. 2021, through peft); 0 = off, every parameter trains."
    )
    lora_alpha: float = opt(16.0, "LoRA alpha: the adapter's output is scaled by alpha / r.")
    lora_dropout: float = opt(
        0.0, "Dropout on the adapter's input (layout-free masks, as model.dropout)."
    )
    lora_targets: str = opt(
        "all-linear",
        "Comma-separated module-name patterns that get adapters: a plain name matches the last "
        "part of a path ('wq', 'q_proj'), a pattern with '.' or '*' the whole path "
        "('blocks.*.attn.wq'); all-linear = every linear layer but the output head; "
        "experts = every MoE layer's stacked expert weights (a pair per expert, docs/moe.md).",
    )
    base_quant: Literal["none", "nf4", "int8"] = opt(
        "none",
        "The frozen base linears under LoRA adapters stored in nf4 (QLoRA, Dettmers et al. "
        "2023: 4-bit NormalFloat, double quantisation; in every layout, 1/(dp·tp) of the base "
        "per rank under ZeRO-3 and tensor parallelism); int8: a byte per weight and an fp32 "
        "absmax per row (LLM.int8's weight format, Dettmers et al. 2022).",
    )


@dataclass
class ParallelConfig:
    tp: int = opt(1, "Tensor-parallel degree: layers split over this many ranks (Megatron-LM).")
    pp: int = opt(1, "Pipeline-parallel degree.")
    zero: int = opt(0, "ZeRO stage 0-3 over the data-parallel dimension.")
    sp: bool = opt(
        False, "Sequence parallelism (with tp): norms and residuals split along the sequence."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved", "zb"] = opt(
        "1f1b",
        "Pipeline schedule: gpipe, 1f1b, interleaved (1F1B over pp_virtual chunks per rank) "
        "or zb (zero-bubble ZB-H1).",
    )
    pp_virtual: int = opt(1, "Virtual pipeline chunks per rank (interleaved schedule).")
    pp_split: str = opt(
        "",
        "Transformer blocks per pipeline chunk, first to last, e.g. '3,3,2' (pp * pp_virtual "
        "entries summing to the layer count); '' balances parameters and FLOPs automatically.",
    )
    cp: int = opt(
        1,
        "Context-parallel degree: each sample's sequence split over this many ranks, which "
        "share the parameters with the data-parallel ranks (dp = world / (tp * pp * cp) "
        "sample streams). Built-in decoders (also with tp, pp and data.pack) and "
        "Llama-style transformers models (tp = pp = 1, also with data.pack).",
    )
    cp_mode: Literal["ring", "ulysses"] = opt(
        "ring",
        "Context-parallel attention: ring (K/V blocks passed around the cp ranks, Liu et al. "
        "2023) or ulysses (all-to-all from sequence to heads, Jacobs et al. 2023; "
        "n_heads / tp divisible by cp).",
    )
    ep: int = opt(
        1,
        "Expert-parallel degree: each MoE layer's routed experts split over this many ranks of "
        "the data-parallel line (dividing world / (tp * pp) and model.n_experts), tokens "
        "exchanged by all-to-all; expert gradients reduced over the world / (pp * ep) ranks "
        "holding the same experts (tp ranks included: tp leaves the experts whole). MoE "
        "decoder (with pp, and tp with sp) and Hugging Face MoE checkpoints (with pp for "
        "Mixtral, Qwen2-MoE and OLMoE; tp with sp for Mixtral and Qwen2-MoE).",
    )
    bucket_mb: float = opt(
        25.0, "Gradient bucket size in MB for the overlapped all-reduce (25 MB, like PyTorch DDP)."
    )
    timeout_s: float = opt(
        300.0, "Timeout of every collective; a stuck rank fails the job after it."
    )
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = opt(
        "none",
        "What the data-parallel gradient reduction sends: none (the fp32 buffers), bf16/fp16 "
        "(half the bytes; ZeRO's reduce-scatters too) or powersgd (ZeRO-0: rank-powersgd_rank "
        "low-rank factors with error feedback, Vogels et al. 2019). Buffers stay fp32.",
    )
    powersgd_rank: int = opt(4, "PowerSGD's rank r: r*(m+n) values per compressed m x n matrix.")
    powersgd_warm_start: bool = opt(
        True, "Start each PowerSGD step from the previous step's Q (else a fresh random Q)."
    )


@dataclass
class PrecisionConfig:
    compute: Precision = opt(
        "fp32",
        "Dtype of parameters and activations in forward/backward; "
        "bf16/fp16 keep fp32 master weights.",
    )
    reduce: Precision = opt("fp32", "Dtype of gradient buffers and their communication.")
    loss_scale: float = opt(65536.0, "Initial dynamic loss scale (fp16 only).")
    scale_window: int = opt(1000, "Double the fp16 loss scale after this many finite steps.")
    fp8: Literal["none", "tensorwise", "rowwise"] = opt(
        "none",
        "FP8 matmuls in the transformer blocks' linear layers (torchao float8 training): one "
        "scale per tensor or per row; needs FP8 tensor cores (CUDA 8.9+), emulated on CPU.",
    )


@dataclass
class MemoryConfig:
    recompute: Literal["none", "selective", "full"] = opt(
        "none",
        "Activation recomputation: selective recomputes attention/MLP internals, full "
        "recomputes whole blocks.",
    )
    offload: Literal["none", "optimizer", "optimizer+params", "optimizer+nvme", "params+nvme"] = (
        opt(
            "none",
            "Keep optimizer state (and ZeRO-3 parameter slices) in host memory; optimizer+nvme: "
            "the fp32 masters and AdamW moments on local disk (memory.nvme_dir), streamed "
            "through two host buffers; params+nvme (ZeRO-3): the parameter slices there too.",
        )
    )
    nvme_dir: str = opt(
        "",
        "Where optimizer+nvme keeps each rank's state (a folder of its own, removed at the "
        "end; '' = run.dir). Use a fast local disk.",
    )
    nvme_buffer_mb: float = opt(
        16.0,
        "optimizer+nvme: MB of each of the 3 regions (master, 2 moments) per host buffer; two "
        "buffers stream the state (one chunk steps while the other is written back and refilled).",
    )


@dataclass
class CheckpointConfig:
    every: int = opt(0, "Save a checkpoint every this many steps and after the last one (0 = off).")
    keep: int = opt(3, "Checkpoints to keep (the newest; older ones are deleted after a save).")
    dir: str = opt("", "Where checkpoints go ('' = run.dir/checkpoints).")
    resume: str = opt(
        "auto",
        "auto: continue from the newest valid checkpoint in checkpoint.dir (or start fresh "
        "when there is none); none: start fresh; or the path of one checkpoint directory.",
    )
    # `async` is a Python keyword: the field carries a trailing underscore, the key does not.
    on_signal: bool = opt(
        True,
        "On SIGTERM, SIGINT or SIGUSR1 (preemption, a time limit, Ctrl-C) every rank finishes "
        "its step, the job saves a checkpoint (also with every=0) and exits 128 + the signal "
        "(143, 130, 138); a second signal later than 2 s aborts at once.",
    )
    async_: bool = opt(
        False,
        "Snapshot shards to host memory and write them in a background thread while "
        "training continues.",
    )
    per_rank_state: bool = opt(
        True,
        "Also save state that belongs to each rank, not to the model (PowerSGD's error memory, "
        "warm-start Q and random stream: about the compressed gradients' fp32 size per dp "
        "rank), so a resume in the same layout continues bit for bit; false: the model's state "
        "only, a resume restarts them.",
    )
    format: Literal["shardwise", "dcp"] = opt(
        "shardwise",
        "How each checkpoint step directory is written: shardwise (one safetensors file per "
        "rank) or dcp (torch.distributed.checkpoint files under the same global names and full "
        "shapes). Resume reads either, in any layout; both keep index.json (docs/checkpoints.md).",
    )


TRACKERS = ("tensorboard", "wandb", "mlflow")


def _trackers(key: str, value: str) -> str:
    """A comma list of TRACKERS, normalised ('wandb, mlflow' -> 'wandb,mlflow'; '' = none)."""
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    for name in names:
        if name not in TRACKERS:
            close = difflib.get_close_matches(name, TRACKERS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{key}={value!r} names an unknown tracker '{name}'{hint}. Valid: "
                f"{', '.join(TRACKERS)} (a comma list, '' for none). Fix: e.g. "
                f"--{key}=tensorboard,wandb"
            )
    return ",".join(dict.fromkeys(names))


@dataclass
class LogConfig:
    every: int = opt(10, "Print a log line every this many steps (metrics.jsonl gets every step).")
    tensorboard: bool = opt(
        True, "Write TensorBoard scalars to run.dir/tb; false drops tensorboard from log.backends."
    )
    backends: str = opt(
        "tensorboard",
        "Experiment trackers fed every metrics.jsonl scalar and the config, from rank 0: a comma "
        "list of tensorboard, wandb (offline under run.dir/wandb unless logged in or WANDB_MODE "
        "is set), mlflow (log.mlflow_uri). A missing package or a failing tracker: one warning.",
        check=_trackers,
    )
    project: str = opt("shardwise", "W&B project and MLflow experiment name (run: run.dir's name).")
    mlflow_uri: str = opt(
        "",
        "MLflow tracking URI, e.g. sqlite:///mlflow.db or http://host:5000 ('' = a local file "
        "store in run.dir/mlruns). Needs mlflow in log.backends.",
    )
    progress: Literal["auto", "on", "off"] = opt("auto", "Progress bar (auto: on a terminal).")
    ledger: bool = opt(
        True,
        "Time every step by category (compute, exposed communication, bubble, data, optimizer, "
        "checkpoint) into metrics.jsonl's `ledger` (rank 0's; `shardwise profile` for all ranks).",
    )

    def trackers(self) -> tuple[str, ...]:
        """The trackers this run feeds: log.backends, less tensorboard if log.tensorboard=false."""
        names = [n for n in self.backends.split(",") if n]
        return tuple(n for n in names if n != "tensorboard" or self.tensorboard)

    def check(self) -> None:
        """Cross-key checks: no option left without effect."""
        if self.mlflow_uri and "mlflow" not in self.trackers():
            raise ConfigError(
                f"log.mlflow_uri={self.mlflow_uri!r} is set, but log.backends="
                f"{self.backends!r} has no mlflow, so nothing would log there. Fix: "
                f"--log.backends={','.join([*self.trackers(), 'mlflow'])}, or drop log.mlflow_uri."
            )


@dataclass
class ProfileConfig:
    steps: int = opt(
        0,
        "Measured steps of `shardwise profile` (its --steps; 0: not profiling). The run writes "
        "run.dir/profile/: ledgers of every rank, traces, report and findings.",
    )
    warmup: int = opt(2, "Steps run before the measured ones (allocator, caches, first calls).")
    max_events: int = opt(
        200_000,
        "Bound on each rank's torch.profiler trace: the longest this many events are kept.",
    )
    host_syncs: bool = opt(
        True,
        "Count the measured steps' host syncs (.item(), .tolist(), boolean masks, copies to "
        "the host) by call site into summary.json; false: skip the counter's per-op cost.",
    )


@dataclass
class RunConfig:
    dir: str = opt("runs/default", "Output directory: metrics.jsonl, config.json, tb/.")
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "Compute device (auto: CUDA if present).")
    cpu_affinity: Literal["none", "cores"] = opt(
        "none",
        "cores: pin each local rank's threads to its own share of the cores (a machine the job "
        "has to itself: a woken peer thread then never preempts a busy rank); none: the OS's.",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            s: {key_name(k): v for k, v in fields.items()}
            for s, fields in dataclasses.asdict(self).items()
        }


def key_name(field_name: str) -> str:
    """The config key of a field: a field named after a Python keyword carries a trailing
    underscore (`async_`), its key does not (`checkpoint.async`)."""
    return field_name.removesuffix("_")


def sections() -> dict[str, type]:
    """Section name -> dataclass type, in declaration order."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def field_types(section_type: type) -> dict[str, Any]:
    return typing.get_type_hints(section_type)


def all_keys() -> list[str]:
    return [f"{s}.{key_name(f.name)}" for s, t in sections().items() for f in dataclasses.fields(t)]


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(
        f"unknown config key '{key}'.{hint} Run `shardwise train --help-config` for "
        "the list of keys."
    )


def _shown(raw: Any) -> str:
    """`raw` as an error message shows it: a list or table of TOML cut short (a deeply nested
    one would overflow repr), a scalar in full."""
    return reprlib.repr(raw) if isinstance(raw, (list, dict)) else repr(raw)


def _parse(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or say what was expected."""
    if isinstance(raw, (list, dict)):
        kind = "an array" if isinstance(raw, list) else "a table"
        raise ConfigError(
            f"{key}={_shown(raw)} is {kind}, and {key} takes one value. Fix: e.g. "
            f"--{key}={_example(typ)}"
        )
    origin = get_origin(typ)
    if origin is Literal:
        choices = get_args(typ)
        if isinstance(raw, bool) and str(raw).lower() in choices:  # TOML `key = true`
            raw = str(raw).lower()
        if raw not in choices:
            opts = " | ".join(map(str, choices))
            raise ConfigError(f"{key}={raw!r} is not one of {opts}. Fix: --{key}={choices[0]}")
        return raw
    if origin in (types.UnionType, typing.Union):
        typ = next(a for a in get_args(typ) if a is not type(None))
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r} is not a boolean. Fix: --{key}=true or --{key}=false")
    if typ is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ConfigError(f"{key}={raw!r} is not an integer. Fix: e.g. --{key}=8")
        try:
            return int(raw) if not isinstance(raw, str) else int(raw.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}={raw!r} is not an integer. Fix: e.g. --{key}=8") from None
    if typ is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r} is not a number. Fix: e.g. --{key}=0.001")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{key}={raw!r} is not a number. Fix: e.g. --{key}=0.001") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number. Fix: e.g. --{key}=0.001")
        return value
    if typ is str:
        if not isinstance(raw, str):
            raise ConfigError(f"{key}={raw!r} must be a string. Fix: quote it in the TOML file.")
        return raw
    raise TypeError(f"unsupported config type {typ} for {key}")


def _example(typ: Any) -> str:
    """A value of type `typ` for a Fix: line."""
    if get_origin(typ) is Literal:
        return str(get_args(typ)[0])
    return {int: "8", float: "0.001", bool: "true"}.get(typ, "VALUE")


def _set(cfg: Config, key: str, raw: Any) -> None:
    section, _, name = key.partition(".")
    secs = sections()
    if section not in secs or not name:
        raise _unknown(key, all_keys())
    hints = {key_name(f): (f, t) for f, t in field_types(secs[section]).items()}
    if name not in hints:
        raise _unknown(key, all_keys())
    attr, typ = hints[name]
    value = _parse(key, raw, typ)
    check = next(f for f in dataclasses.fields(secs[section]) if f.name == attr).metadata.get(
        "check"
    )
    setattr(getattr(cfg, section), attr, check(key, value) if check else value)


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"config file '{path}' is a directory, not a file. Fix: pass a .toml file."
        )
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist. Fix: pass an existing .toml file.")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"config file '{path}' is not valid TOML: {exc}. Fix the line it names."
        ) from None
    except RecursionError:  # tomllib reads nested arrays and inline tables recursively
        raise ConfigError(
            f"config file '{path}' nests arrays or inline tables too deeply to read. Fix: a "
            "shardwise config is flat: [section] headers, then key = value lines."
        ) from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`--section.key=value` or `--section.key value` pairs, in order."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument '{arg}'. Overrides look like "
                "--section.key=value, e.g. --train.steps=100"
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"'{arg}' has no value. Fix: {arg}=VALUE")
        pairs.append((key, value))
        i += 1
    return pairs


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(own options, `--section.key[=| ]value` overrides), separated first so a
    space-separated override value is never mistaken for the config file."""
    overrides, own, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                overrides.append(argv[i + 1])
                i += 1
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _from_table(key: str, raw: Any) -> Any:
    """A `[data.blend]` table of `"PATH" = WEIGHT` lines as the string form 'PATH:WEIGHT,...';
    any other value (a table for another key included) unchanged, for _parse to judge."""
    if key != "data.blend" or not isinstance(raw, dict):
        return raw
    fix = 'Fix: one `"PATH" = WEIGHT` line per source under [data.blend], e.g. "dirA" = 0.7.'
    if not raw:
        raise ConfigError(f"[data.blend] is an empty table. {fix}")
    for path, weight in raw.items():
        # a comma separates entries of the string form this table becomes
        if "," in path or not path.strip():
            raise ConfigError(f"[data.blend] source {path!r} is empty or holds a comma. {fix}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(
                f"[data.blend] weight {_shown(weight)} of {path!r} is not a number. {fix}"
            )
    return ",".join(f"{path}:{weight!r}" for path, weight in raw.items())


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then command-line overrides (later wins); then what the
    given keys imply for those left out (`_infer`)."""
    cfg, given = Config(), set()
    if path is not None:
        for section, values in load_toml(path).items():
            if not isinstance(values, dict):
                owners = [k for k in all_keys() if k.split(".", 1)[1] == section]
                if owners:
                    sec, name = owners[0].split(".", 1)
                    raise ConfigError(
                        f"'{section}' in '{path}' is outside any section. Fix: put "
                        f"it under [{sec}] (as {sec}.{name})."
                    )
                raise _unknown(section, all_keys())
            for name, raw in values.items():
                _set(cfg, f"{section}.{name}", _from_table(f"{section}.{name}", raw))
                given.add(f"{section}.{name}")
    for key, raw in parse_overrides(overrides or []):
        _set(cfg, key, raw)
        given.add(key)
    _infer(cfg, given)
    cfg.log.check()
    return cfg


def _infer(cfg: Config, given: set[str]) -> None:
    """Fill a key left at its default when the given ones allow a single value: a classifier
    from a checkpoint (model.task=classification, model.init_from) is transformers' own class,
    model.name=hf, the only family that classifies."""
    m = cfg.model
    if m.task == "classification" and m.init_from and "model.name" not in given:
        m.name = "hf"


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with `--section.key=value` overrides applied."""
    out = config_from_dict(cfg.to_dict())
    for key, raw in parse_overrides(overrides):
        _set(out, key, raw)
    return out


def config_from_dict(values: dict[str, dict[str, Any]], source: str | None = None) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. a run's config.json). `source`:
    the file it was read from (a checkpoint's index.json), named in any error with its fix."""
    cfg = Config()
    for section, fields in values.items():
        for name, raw in fields.items():
            key = f"{section}.{name}"
            try:
                _set(cfg, key, raw)
            except ConfigError as exc:
                if source is None:
                    raise
                raise _saved_error(key, source, exc) from None
    return cfg


def _saved_error(key: str, source: str, exc: ConfigError) -> ConfigError:
    """A saved config's bad key: the file holds it, so no command-line flag fixes it."""
    if key not in all_keys():
        return ConfigError(
            f"the config saved in '{source}' has the key '{key}', which this version of "
            "shardwise does not know (the file was written by another version). Fix: use the "
            f"shardwise version that wrote it, or delete '{key.partition('.')[2]}' from the "
            f"'{key.partition('.')[0]}' section of the config in '{source}'."
        )
    why = str(exc).partition(" Fix:")[0]  # its fix is a flag; the value is in the file
    return ConfigError(
        f"the config saved in '{source}' holds a value this version refuses: {why} Fix: "
        f"correct {key} in that file, or use the shardwise version that wrote it."
    )


def reference_markdown() -> str:
    """The config reference table for the README, generated from the help strings."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for section, typ in sections().items():
        for f in dataclasses.fields(typ):
            default = f.default
            shown = (
                f'"{default}"'
                if isinstance(default, str)
                else str(default).lower()
                if isinstance(default, bool)
                else str(default)
            )
            key = f"{section}.{key_name(f.name)}"
            lines.append(f"| `{key}` | `{shown}` | {f.metadata['help']} |")
    return "\n".join(lines)
