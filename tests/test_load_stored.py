"""engine.run.api.load on the kernel path (issue 18, item 2): whenever the engine runs the Triton kernel ops
(kernels=True, or None on CUDA), load() serves the checkpoint through engine/ops/stored.py StoredWeights:
the stored formats on the device, FP8/FP4 weights dequantized per call only, no fp32 copies of them;
the CPU included. Without the kernels: the lazy CheckpointWeights on the CPU, DeviceWeights elsewhere.

Two routes on the CPU:
- the shipped small model (assets/model, 40 layers) with the kernel ops calling each kernel's PyTorch
  reference (kernels/dispatch.py `_PAIRS`: what TritonOps runs on the CPU without the interpreter; here
  `interpreter_active` is patched to say so). Its 40 layers under the interpreter take minutes on one
  core (265 s for a 22-token prompt, measured), far over this file's budget;
- a tiny written checkpoint (tests/engine_helpers.py tiny_config, 8 layers, no Engram: it has no
  tokenizer) with the Triton versions under TRITON_INTERPRET=1.

Tolerances against the CPU route (load(kernels=False)) are tests/test_kernel_path.py's for the kernel
route: with fp32 numerics the logits within 2x the change that rounding the reference's linear outputs
to bf16 makes, and the first Full layer (2) picking the same entries for >= 75% of the queries
(test_all_kernels_in_the_forward_stay_within_bf16_noise); with `reference` numerics layer 0 routing the
same experts and layer 2 picking the same entries (test_kernel_ops_wrapping_reference_numerics).
Against the kernel ops over the lazy CheckpointWeights (what load(kernels=True) served on the CPU
before; its float values are DeviceWeights'): bit for bit, with the same kernel calls (the Engram's
wkv is asked for by name on both, `TritonOps.gemm_of`, and runs on its stored bytes).
"""

from __future__ import annotations

from interpreted import interpreted  # first: the interpreter before triton (tests/ is on the path)

import sys
from pathlib import Path

import pytest
import torch

interpreted("_formats", "quant", "topk_search", "topk_split", "topk", "indexer", "sparse_attn", "fp4_tiles", "moe_f8",
            "moe_gemv", "moe", "mhc", "fp8_linear", "dispatch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.checkpoint.weights import CheckpointWeights, DeviceWeights, random_weights  # noqa: E402
from engine.ops import triton as K  # noqa: E402
from engine.ops.stored import StoredWeights  # noqa: E402
from engine.run.api import DEFAULT_CHECKPOINT, Engine, load  # noqa: E402
from engine_helpers import check_same_experts_but_near_ties, random_ids, tiny_config  # noqa: E402

PROMPT = "The quick brown fox jumps over the dog."  # 18 tokens with the shipped tokenizer
PROBES = ("topk", "routing")
ALL_KERNELS = {"fp8_linear", "sparse_attn", "moe_fp4", "mhc", "quantize_fp4", "indexer_scores", "topk_positions",
               "rms_norm", "rope", "mhc_expand", "fp8_roundtrip", "quantize_fp8", "tie_marks", "engram_mix",
               "swiglu", "add", "route_topk"}

needs_model = pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "config.json").exists(), reason="no shipped model")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def bf16_linears(engine: Engine) -> Engine:
    """The CPU route with its linear outputs rounded to bf16 (tests/test_kernel_path.py's noise yardstick)."""
    linear = engine.model.linear
    engine.model.linear = lambda x, base, **kw: linear(x, base, **kw).to(torch.bfloat16).float() if base is not None \
        else linear(x, base)
    engine.model.reset()
    return engine


def run(engine: Engine, prompt):
    return engine.run(prompt, probes=PROBES, logits=True)


def routes(path, prompt, numerics_list) -> dict:
    """Per numerics: load(kernels=True), the kernel ops over the lazy CheckpointWeights, load(kernels=False)
    and (fp32) the CPU route with bf16 linear outputs, each run once over `prompt`."""
    out = {}
    for numerics in numerics_list:
        stored = load(path, kernels=True, threads=1, numerics=numerics)
        lazy = Engine(stored.cfg, CheckpointWeights(stored.model.weights.reader), stored.tokenizer,
                      kernels=True, threads=1, numerics=numerics)
        cpu = load(path, kernels=False, threads=1, numerics=numerics)
        got = {"engine": stored, "stored": run(stored, prompt), "lazy": run(lazy, prompt),
               "lazy_calls": dict(lazy.model.ops.calls), "cpu": run(cpu, prompt)}
        if numerics == "fp32":
            got["bf16"] = run(bf16_linears(load(path, kernels=False, threads=1, numerics=numerics)), prompt)
        out[numerics] = got
    return out


@pytest.fixture(scope="module")
def shipped():
    """The shipped model's routes, the kernel ops on their PyTorch references (module docstring)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "interpreter_active", lambda: False)
        return routes(None, PROMPT, ("reference", "fp32"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny written checkpoint's routes, the Triton kernels under the interpreter (fp32 numerics)."""
    from engine.checkpoint.writer import write_checkpoint
    from triton_interp import speed_up   # tests/triton_interp.py: the same kernels, less interpreter overhead

    speed_up()
    cfg = tiny_config(engram_layer_ids=(), engram_num_embeddings=())
    path = tmp_path_factory.mktemp("stored") / "ckpt"
    write_checkpoint(cfg, path, tensors=random_weights(cfg, 0), n_shards=1)
    return routes(path, random_ids(cfg, 16, seed=3).tolist(), ("fp32",))["fp32"]


def check_no_float_copies(engine: Engine) -> None:
    """After a forward: floats kept only for BF16/F32-stored weights, FP8/FP4 weights held in their
    stored dtypes, the kernel ops' raw weights the source's own tensors, and the bytes held well under
    the dequantized size (what DeviceWeights keeps: 4 bytes per weight element)."""
    w, ops = engine.model.weights, engine.model.ops
    assert type(w) is StoredWeights and w.device == torch.device("cpu")
    assert ops.kernels and ops.weights is w
    assert w._float and {w.stored_dtype(n) for n in w._float} <= {"BF16", "F32"}
    dtypes = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}
    quantized = {n: t for n, t in w._stored.items() if w.stored_dtype(n) in dtypes}
    assert any(w.stored_dtype(n) == "I8" for n in quantized) and any(w.stored_dtype(n) == "F8_E4M3" for n in quantized)
    for name, t in quantized.items():
        assert t.dtype == dtypes[w.stored_dtype(name)], name
    held = {t.untyped_storage().data_ptr() for t in list(w._stored.values()) + list(w._float.values())}
    raw = [t for group in list(ops._raw.values()) + list(ops._experts.values()) if group for t in group]
    assert raw and all(t.untyped_storage().data_ptr() in held for t in raw)   # no second copy in the ops
    assert ops._experts and all(v is not None for v in ops._experts.values())  # experts held stacked once
    dequantized = sum(t.numel() * (2 if w.stored_dtype(n) == "I8" else 1) * 4 for n, t in w._stored.items()
                      if w.stored_dtype(n) != "F8_E8M0")
    assert w.held_bytes == w.stored_bytes() < 0.4 * dequantized, (w.stored_bytes(), dequantized)
    assert w.loads >= len(w._stored)


def check_same_bits(a, b) -> None:
    assert torch.equal(a.logits, b.logits)
    assert a.layers.keys() == b.layers.keys()
    for L, lr in a.layers.items():
        assert torch.equal(lr.routing["experts"], b.layers[L].routing["experts"]), L
        assert torch.equal(lr.routing["weights"], b.layers[L].routing["weights"]), L
        assert (lr.topk is None) == (b.layers[L].topk is None) and (lr.topk is None or torch.equal(lr.topk, b.layers[L].topk)), L


def check_within_bf16_noise(got: dict) -> None:
    """tests/test_kernel_path.py test_all_kernels_in_the_forward_stay_within_bf16_noise's bounds."""
    kern, cpu, noise = got["stored"], got["cpu"], rel(got["bf16"].logits, got["cpu"].logits)
    assert torch.isfinite(kern.logits).all()
    assert 0 < rel(kern.logits, cpu.logits) <= 2 * noise, (rel(kern.logits, cpu.logits), noise)
    same = (kern.layers[2].topk == cpu.layers[2].topk).all(-1).float().mean().item()
    assert same >= 0.75, same


# -- the shipped model (the kernels' references) -----------------------------------------------------

@needs_model
def test_load_with_kernels_holds_the_stored_formats_only(shipped):
    got = shipped["reference"]
    engine = got["engine"]
    assert len(got["stored"].token_ids) == 18
    assert set(engine.model.ops.calls) == ALL_KERNELS
    check_no_float_copies(engine)
    # the Engram's wkv is asked for by name, so both weight sources run it on its stored bytes
    # (tests/test_release_layer.py checks that `gemm_of` never makes its float value)
    assert dict(engine.model.ops.calls) == got["lazy_calls"]


@needs_model
def test_stored_weights_change_no_bits(shipped):
    """The weight source changes where the bytes come from, not the numbers (`reference` numerics, load's
    default): logits, routing and top-k are the kernel ops' over the lazy CheckpointWeights bit for bit."""
    got = shipped["reference"]
    check_same_bits(got["stored"], got["lazy"])


@needs_model
def test_kernel_route_against_the_cpu_route(shipped):
    ref = shipped["reference"]
    kern, cpu = ref["stored"], ref["cpu"]
    assert torch.isfinite(kern.logits).all()
    check_same_experts_but_near_ties(kern.layers[0].routing, cpu.layers[0].routing,
                                     ref["engine"].model.weights.get("layers.0.ffn.gate.bias").float())
    assert torch.equal(kern.layers[2].topk, cpu.layers[2].topk)
    check_within_bf16_noise(shipped["fp32"])


@needs_model
def test_generation_and_probes_through_stored_weights(shipped):
    engine = shipped["reference"]["engine"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "interpreter_active", lambda: False)
        result = engine.run(PROMPT, layers=[2, 20], generate=2, generated_probes=True)
    cpu = load(kernels=False, threads=1).run(PROMPT, layers=[2, 20], generate=2, generated_probes=True)
    assert len(result.generated_ids) == len(cpu.generated_ids) == 2
    assert set(result.layers) == set(result.generated_layers) == {2, 20}
    check_no_float_copies(engine)


# -- the Triton kernels under the interpreter --------------------------------------------------------

def test_interpreted_kernels_read_stored_weights(tiny):
    assert K.interpreter_active()
    # fp32 numerics: their own rotation and stream update; this config has no Engram
    assert set(tiny["engine"].model.ops.calls) == ALL_KERNELS - {"rope", "mhc_expand", "engram_mix"}
    check_no_float_copies(tiny["engine"])
    check_same_bits(tiny["stored"], tiny["lazy"])   # (no Engram: no FP8 weight asked for as a float)
    check_within_bf16_noise(tiny)


def test_nan_weights_warn_once_on_the_stored_path(tmp_path):
    """As on the lazy path (tests/test_reliability_engine.py): a weight holding NaN/inf is named once and
    listed in the reader's `nonfinite`, here from the float values StoredWeights makes (kernels' references)."""
    import warnings
    from engine.checkpoint.writer import write_checkpoint

    cfg = tiny_config(engram_layer_ids=(), engram_num_embeddings=())
    weights = random_weights(cfg, 0)
    weights["layers.1.attn_norm.weight"] = torch.full_like(weights["layers.1.attn_norm.weight"], float("nan"))
    write_checkpoint(cfg, tmp_path, tensors=weights, n_shards=1)
    engine = load(tmp_path, kernels=True, threads=1)
    assert type(engine.model.weights) is StoredWeights
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
        mp.setattr(K, "interpreter_active", lambda: False)
        warnings.simplefilter("always")
        engine.run([0] + list(range(20, 30)), layers=[1])
    nan_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning) and "NaN" in str(w.message)]
    assert len(nan_warnings) == 1 and "layers.1.attn_norm.weight" in str(nan_warnings[0].message)
    assert engine.model.weights.reader.nonfinite == ["layers.1.attn_norm.weight"]


# -- which weight source ------------------------------------------------------------------------------

@needs_model
def test_weight_source_follows_the_ops():
    """kernels=False / the CPU default: the lazy CheckpointWeights as before; another device without
    kernels: DeviceWeights; the kernel ops (True anywhere, None on CUDA): StoredWeights. Built only (no
    CUDA here): the weight sources are lazy."""
    assert type(load(kernels=False).model.weights) is CheckpointWeights
    plain = load()
    assert type(plain.model.weights) is CheckpointWeights and not plain.model.ops.kernels
    assert type(load(device="cuda", kernels=False).model.weights) is DeviceWeights
    on_cuda = load(device="cuda")
    assert type(on_cuda.model.weights) is StoredWeights and on_cuda.model.weights.device.type == "cuda"
    assert on_cuda.model.ops.kernels
    # one rule: load's choice is the model's (engine/ops for_model -> engine/ops/triton.py decide)
    from engine.ops import for_model
    weights = plain.model.weights
    for kernels_flag in (None, True, False):
        for device in ("cpu", "cuda", "meta"):
            model_runs = bool(for_model("reference", kernels_flag, weights, device).kernels)
            assert K.decide(kernels_flag, weights, device) is model_runs, (kernels_flag, device)
