"""`precision.fp8=tensorwise|rowwise`: the blocks' linear layers train in FP8 through torchao's
float8 training (numerics mode on CPU: torchao's emulate=True, the FP8 casts and scales of a
GPU run with the matmuls in fp32).

References and tolerances:
* FP8 against bf16, one process, 50 steps: the final loss within 2% (measured here: 6.5e-4
  tensorwise, 3.0e-4 rowwise), and the curve differs from bf16's (else nothing converted).
* dp2 with ZeRO-0/1/2/3, and pp2, against one process's FP8 run at the same micro-batch (2
  rows): each micro-batch holds the same rows in every layout, so every FP8 scale (an
  absolute maximum over a micro-batch's tensor or row) is the same and only fp32 summation
  order differs: losses within 1e-5 relative, the bound every parity test uses (measured:
  below 1e-7, the bf16 parameters equal).
* tp2 (and tp2 + sp) against one process's FP8 run: a tp rank scales its own slice of a
  weight, and of the activations and gradients a split layer sees, with that slice's maximum,
  not the whole tensor's (torchao's own tensor parallelism all-reduces the maxima through
  DTensor; ours stays local). The FP8 values then round at other points, by up to one e4m3
  step (2^-3 relative): the loss moves by less than FP8 moves it from bf16 (measured over 10
  steps: 3.2e-4 tensorwise, 1.6e-4 rowwise; FP8 against bf16 under tp2: 4.9e-4), within the
  bound 2e-3, which still catches a broken split (a missing reduction drops half of a
  layer's output, no rounding-sized change); that FP8 is active under tp is checked against
  tp2's own bf16 run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.config import load_config
from shardwise.distributed import device as dev
from shardwise.errors import ConfigError
from shardwise.finetune import build_adapted
from shardwise.job.explain import explain_record
from shardwise.launchers.harness import run_here, run_world
from shardwise.models import build_on_meta
from shardwise.models.families import family_of
from shardwise.parallel import fp8 as fp8_module
from shardwise.parallel.fp8 import apply_fp8, fp8_emulated, is_fp8
from shardwise.plan import gpu
from shardwise.plan.hardware import get_hardware
from shardwise.plan.layout import Job
from shardwise.training.validate import derive
from support.compare import case, max_param_diff, max_rel

pytestmark = pytest.mark.slow

BF16 = ["--precision.compute=bf16", "--train.micro_batch=2"]
RECIPES = ("tensorwise", "rowwise")
SHORT = ["--train.steps=10", "--optim.warmup_steps=2"]
LAYOUTS = {  # two ranks, each compared with the one-process FP8 run of its recipe
    "dp2": [],
    "zero1": ["--parallel.zero=1"],
    "zero2": ["--parallel.zero=2"],
    "zero3": ["--parallel.zero=3"],
    "pp2": ["--parallel.pp=2"],
}
# the recipe changes no layout's code: tensorwise everywhere, rowwise under ZeRO-3 too
SAME = [(n, "tensorwise") for n in LAYOUTS] + [("zero3", "rowwise"), ("zero3", "lora")]
LORA = ["--finetune.lora_rank=16", "--finetune.lora_alpha=32"]  # 16: adapters FP8 could take
SPLIT = {"tp2": ["--parallel.tp=2"], "tp2_sp": ["--parallel.tp=2", "--parallel.sp=true"]}
CPU = dev.DeviceInfo("cpu", "gloo", torch.device("cpu"), "cpu")


def _fp8(recipe: str) -> list[str]:
    return [*BF16, f"--precision.fp8={recipe}"]


def _params(ranks: list[dict]) -> dict:
    out: dict = {}
    for result in ranks:
        assert "error" not in result, result["error"]
        out.update(result["params"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fp8")
    long = {"bf16": run_here(case(*BF16, "--train.steps=50"), str(root / "bf16"))}
    for r in RECIPES:
        long[r] = run_here(case(*_fp8(r), "--train.steps=50"), str(root / r))
    one = {r: run_here(case(*_fp8(r), *SHORT), str(root / f"short_{r}")) for r in RECIPES}
    one["lora"] = run_here(case(*_fp8("tensorwise"), *SHORT, *LORA), str(root / "lora"))
    one["lora_bf16"] = run_here(case(*BF16, *SHORT, *LORA), str(root / "lora_bf16"))
    two = {
        **{(n, r): case(*_fp8(r), *SHORT, *LAYOUTS[n]) for n, r in SAME if r in RECIPES},
        **{(n, r): case(*_fp8(r), *SHORT, *v) for n, v in SPLIT.items() for r in RECIPES},
        ("tp2", "bf16"): case(*BF16, *SHORT, *SPLIT["tp2"]),
        ("zero3", "lora"): case(*_fp8("tensorwise"), *SHORT, *LORA, *LAYOUTS["zero3"]),
    }
    world = run_world(2, list(two.values()))
    return {"long": long, "one": one, "two": dict(zip(two, world, strict=True))}


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_trains_as_bf16_does(runs, recipe: str) -> None:
    bf16, fp8 = runs["long"]["bf16"], runs["long"][recipe]
    assert "error" not in fp8, fp8.get("error")
    assert len(fp8["losses"]) == 50
    assert abs(fp8["losses"][-1] - bf16["losses"][-1]) <= 0.02 * bf16["losses"][-1]
    assert max_rel(fp8["losses"], bf16["losses"]) > 1e-5  # FP8 changed the numbers


def test_lora_on_fp8_base_layers(runs) -> None:
    """LoRA: the frozen base layers multiply in FP8, the adapters in bf16 (rank 16 would
    pass the alignment filter: they are left out by name)."""
    fp8, bf16 = runs["one"]["lora"], runs["one"]["lora_bf16"]
    assert abs(fp8["losses"][-1] - bf16["losses"][-1]) <= 0.02 * bf16["losses"][-1]
    assert max_rel(fp8["losses"], bf16["losses"]) > 1e-6  # FP8 changed the numbers


@pytest.mark.parametrize("layout, recipe", SAME)
def test_fp8_layouts_reproduce_one_process(runs, layout: str, recipe: str) -> None:
    ranks, one = runs["two"][(layout, recipe)], runs["one"][recipe]
    params = _params(ranks)
    assert max_rel(ranks[0]["losses"], one["losses"]) <= 1e-5
    # bf16 parameters: one bf16 step at |w| < 2 where fp32 summation order flips a rounding
    assert max_param_diff(params, one["params"]) <= 2**-7


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", list(SPLIT))
def test_fp8_tensor_parallel_scales_its_slices(runs, layout: str, recipe: str) -> None:
    ranks, one = runs["two"][(layout, recipe)], runs["one"][recipe]
    _params(ranks)  # no rank failed
    assert max_rel(ranks[0]["losses"], one["losses"]) <= 2e-3  # slice scales: module docstring
    bf16 = runs["two"][("tp2", "bf16")][0]["losses"]
    assert max_rel(ranks[0]["losses"], bf16) > 1e-5  # FP8 is active under tp


def _tiny_meta() -> tuple[nn.Module, object]:
    cfg = load_config(None, ["--model.n_layers=2"])
    spec = derive(cfg, 1).spec
    return build_on_meta(spec), family_of(spec)


def test_only_the_blocks_linear_layers_convert() -> None:
    model, family = _tiny_meta()
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert apply_fp8(model, family, "tensorwise", CPU) == 2 * 7  # q k v o, gate up down
    fp8 = {n for n, m in model.named_modules() if is_fp8(m)}
    assert fp8 == {n for n in names if n.startswith("blocks.")}
    assert not is_fp8(model.head) and not is_fp8(model.embed)
    assert {n for n, _ in model.named_parameters()} == {
        n for n, _ in build_on_meta(model.spec).named_parameters()
    }  # same names: init, ZeRO units and checkpoints are unchanged


def test_lora_adapters_stay_in_the_compute_dtype() -> None:
    cfg = load_config(None, ["--model.n_layers=2", *LORA])
    spec = derive(cfg, 1).spec
    model, _ = build_adapted(spec, cfg.finetune)
    assert apply_fp8(model, family_of(spec), "rowwise", CPU) == 2 * 7
    fp8 = [n for n, m in model.named_modules() if is_fp8(m)]
    assert fp8 and all(n.endswith(".base_layer") for n in fp8)


def test_cuda_without_fp8_units_is_refused(monkeypatch) -> None:
    assert fp8_emulated(CPU, "rowwise") is True  # numerics mode
    a100 = dev.DeviceInfo("cuda", "nccl", torch.device("cpu"), "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(dev, "capability", lambda info: (8, 0))
    model, family = _tiny_meta()
    with pytest.raises(ConfigError, match=r"precision.fp8=rowwise.*A100.*8\.0.*Fix: --precision"):
        apply_fp8(model, family, "rowwise", a100)
    assert not any(is_fp8(m) for m in model.modules())
    monkeypatch.setattr(dev, "capability", lambda info: (9, 0))  # an H100: real FP8 matmuls
    assert fp8_emulated(a100, "rowwise") is False


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--precision.compute=fp16"], "precision.compute=fp16: torchao's float8 recipes"),
        (["--precision.compute=fp32"], "precision.compute=fp32: torchao's float8 recipes"),
        (["--finetune.lora_rank=4", "--parallel.tp=2"], "finetune.lora_rank=4 with parallel.tp"),
        (["--finetune.lora_rank=4", "--finetune.base_quant=nf4"], "base_quant=nf4 stores"),
        (["--model.name=moe-tiny"], "is an MoE decoder, whose FP8 training is not tested"),
        (["--model.name=resnet18", "--data.dataset=digits"], "whose FP8 training is not tested"),
    ],
)
def test_untested_combinations_are_refused(extra: list[str], message: str) -> None:
    cfg = load_config(None, ["--precision.fp8=tensorwise", "--precision.compute=bf16", *extra])
    with pytest.raises(ConfigError, match=rf"precision.fp8=tensorwise: .*{message}.*Fix:"):
        derive(cfg, 2)


def test_missing_torchao_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(fp8_module, "torchao_installed", lambda: False)
    cfg = load_config(None, ["--precision.fp8=rowwise", "--precision.compute=bf16"])
    with pytest.raises(ConfigError, match=r"precision.fp8=rowwise: torchao is not .*\[fp8\]"):
        derive(cfg, 1)


# Llama-3-8B widths, 4 layers: GEMMs of 4096 tokens, large enough to be compute-bound
WIDE = [
    *("--model.dim=4096", "--model.n_heads=32", "--model.n_kv_heads=8", "--model.ffn_dim=14336"),
    *("--model.n_layers=4", "--data.seq_len=512", "--train.global_batch=64"),
    *("--train.micro_batch=8", "--precision.compute=bf16", "--precision.reduce=bf16"),
]


def _explain(card: str, fp8: str) -> dict:
    cfg = load_config(None, [*WIDE, "--parallel.zero=1", f"--precision.fp8={fp8}"])
    return explain_record(cfg, 8, get_hardware(card))


def test_the_planner_prices_block_gemms_at_the_fp8_peak() -> None:
    hw = get_hardware("h100-sxm")
    assert hw.peak["fp8"] == pytest.approx(2 * hw.peak["bf16"], rel=0.01)  # 1979 vs 989 TF/s
    spec = derive(load_config(None, WIDE), 1).spec
    job = Job(spec, hw, 8, seq_len=512, fp8="tensorwise")
    dgrad_b, wgrad_b = gpu.backward_gemm_seconds(hw, spec, 1, 4096, 2, hw.peak["bf16"])
    dgrad_f, wgrad_f = gpu.backward_gemm_seconds(hw, spec, 1, 4096, 2, gpu.linear_peak(hw, job))
    assert dgrad_f < 0.6 * dgrad_b and wgrad_f < 0.6 * wgrad_b  # compute-bound: about half
    bf16, fp8 = _explain("h100-sxm", "none"), _explain("h100-sxm", "tensorwise")
    assert fp8["time"]["compute_s"] < bf16["time"]["compute_s"]
    # attention, element-wise kernels and the head are priced as before: under half is saved
    assert fp8["time"]["compute_s"] > 0.5 * bf16["time"]["compute_s"]
    assert fp8["time"]["dp_comm_s"] == bf16["time"]["dp_comm_s"]


def test_the_planner_refuses_fp8_on_a100() -> None:
    with pytest.raises(ConfigError, match=r"precision.fp8=tensorwise: a100-80gb has no FP8.*Fix"):
        _explain("a100-80gb", "tensorwise")


def test_fp8_key_is_in_the_docs() -> None:
    docs = Path(__file__).parents[1] / "docs"
    assert "precision.fp8" in (docs / "config.md").read_text()
    assert "precision.fp8" in (docs / "parallelism.md").read_text()


def test_torchaos_enum_notice_is_dropped_and_nothing_else(caplog):
    """torch logs a deprecation notice about torchao's float8 enums on every import of
    torchao (transformers and peft import it when installed), on every Hugging Face run:
    shardwise drops that one message from torch's pytree logger and lets every other through."""
    import logging

    import shardwise  # noqa: F401 (installs the filter)

    log = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        log.warning("%s is an Enum subclass and is now natively supported by torch.compile", "E")
        log.warning("some other pytree warning")
    assert [r.getMessage() for r in caplog.records] == ["some other pytree warning"]


def test_torchaos_optional_kernel_warnings_are_dropped_and_nothing_else(caplog):
    """torchao's wheel warns on every import that two optional kernel libraries failed to load
    (an MX-FP8 build for CPython 3.10, SM90 CUTLASS kernels), which precision.fp8 does not
    use: shardwise drops those two and lets every other torchao warning through (another
    library of its own failing to load included)."""
    import logging

    import shardwise  # noqa: F401 (installs the filter)

    log, site = logging.getLogger("torchao"), "/venv/lib/python3.11/site-packages/torchao"
    with caplog.at_level(logging.WARNING, logger="torchao"):
        log.warning(f"Failed to load {site}/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: nope")
        log.warning(f"Failed to load {site}/_C_cutlass_90a.abi3.so: Could not load")
        log.warning(f"Failed to load {site}/_C.abi3.so: undefined symbol")
        log.warning("some other torchao warning")
    assert [r.getMessage() for r in caplog.records] == [
        f"Failed to load {site}/_C.abi3.so: undefined symbol",
        "some other torchao warning",
    ]


@pytest.mark.parametrize(
    "recipe, compile_, card, expected",
    [
        ("tensorwise", "false", "h200", ["--train.compile=blocks"]),
        ("rowwise", "blocks", "h200", ["rowwise's per-row scales"]),
        ("rowwise", "false", "h100", ["--train.compile=blocks", "rowwise's per-row scales"]),
        ("tensorwise", "blocks", "h200", []),
        ("tensorwise", "false", "cpu", []),
        ("none", "false", "h200", []),
    ],
)
def test_explain_says_what_of_fp8_its_step_time_leaves_out(recipe, compile_, card, expected):
    """The step time prices FP8 GEMMs at the card's FP8 peak but not the casts around them:
    measured on an H200, eager FP8 was 2.4-2.6x slower than bf16 (predicted faster) and
    rowwise 1.24x tensorwise, so `explain` says so on a GPU where it applies (and names the
    fix), and says nothing for compiled tensorwise, bf16, or a CPU (numerics mode)."""
    overrides = ["--precision.compute=bf16", f"--precision.fp8={recipe}"]
    cfg = load_config(None, [*overrides, f"--train.compile={compile_}"])
    notes = [w for w in explain_record(cfg, 1, get_hardware(card)).get("warnings", [])
             if "FP8 GEMMs" in w]  # fmt: skip
    assert len(notes) == (1 if expected else 0), notes
    assert all(part in notes[0] for part in expected)


def test_a_real_fp8_run_without_compiled_blocks_is_told_the_fix():
    """Training's FP8 line: on FP8 tensor cores without compiled blocks it adds that the
    unfused casts made such a step slower than bf16 and names --train.compile=blocks; compiled,
    or in numerics mode (CPU: no speed to lose), it only says what converted."""
    eager = fp8_module.fp8_summary("tensorwise", 168, emulated=False, compiled=False)
    assert "FP8 tensor cores" in eager and "Fix: --train.compile=blocks" in eager
    assert "Fix" not in fp8_module.fp8_summary("tensorwise", 168, emulated=False, compiled=True)
    assert "Fix" not in fp8_module.fp8_summary("tensorwise", 168, emulated=True, compiled=False)
    # where training would refuse compiled blocks, the line says why instead of the fix
    from shardwise.training.checks import compile_refusal

    cfg = load_config(None, ["--memory.recompute=selective"])
    why = compile_refusal(cfg, derive(cfg, 1).family)
    for line in (
        fp8_module.fp8_summary("tensorwise", 168, emulated=False, compiled=False, refused=why),
        fp8_module.fp8_price_note("tensorwise", compiled=False, on_cpu=False, refused=why),
    ):
        assert "--train.compile=blocks" not in line.split("without train.compile=blocks")[-1]
        assert "refused here: memory.recompute=selective recomputes" in line
        assert "Fix: --memory.recompute=full" in line  # the way such a job can compile
