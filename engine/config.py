"""The model configuration: one `ModelConfig`, read from the flat inference config or from a
checkpoint-root `config.json` (HF names under `text_config`), and checked for consistency."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config that cannot describe a model; the message names the key (and file) at fault."""


@dataclass(frozen=True)
class ModelConfig:
    """Field names are exactly the flat inference-config keys. Defaults are the release's values."""

    # vocabulary and widths
    vocab_size: int = 129280
    dim: int = 5120
    n_layers: int = 40
    n_mtp_layers: int = 3
    # attention: low-rank queries, one shared 512-wide KV latent, grouped low-rank output
    n_heads: int = 64
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64  # the LAST rope_head_dim dims of each head are rotated
    o_groups: int = 8
    o_lora_rank: int = 1024
    norm_eps: float = 1e-20
    # sparse attention: every layer has a sliding window; layers with ratio > 0 add global KV on top
    window_size: int = 128
    compress_ratios: tuple[int, ...] = tuple([0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    # rope (YaRN for the layers with global KV)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # the lightning indexer and layer 20's candidate pool
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # MoE
    moe_inter_dim: int = 2304
    n_routed_experts: int = 384
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # mHC: the residual stream is hc_mult parallel copies
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram: n-gram hash tables added into the stream before a few layers
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 99092
    engram_pad_id: int = 2
    # DSpark draft stages (stored as mtp.*)
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # vision tower (not run by the engine; counted by the tally)
    vision_n_layers: int = 32
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: int | None = None
    vision_rope_theta: float = 10000.0
    image_token_id: int = 129264
    # special ids and storage
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    dtype: str = "fp8"
    expert_dtype: str = "fp4"
    # runtime limit: the longest prompt the engine accepts
    max_seq_len: int = 65536
    # keys we read but do not model, kept so a round trip loses nothing
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate(self)

    # -- derived facts used everywhere --------------------------------------------------------
    @property
    def n_total_layers(self) -> int:
        """Backbone layers plus DSpark stages."""
        return self.n_layers + self.n_mtp_layers

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    def experts_of(self, layer: int) -> tuple[int, int]:
        """(routed, activated) experts of a backbone layer or DSpark stage."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The flat inference config (JSON-able)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        out.update(self.extra)
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name != "extra"}
_TUPLE_FIELDS = {"compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
                 "engram_num_embeddings", "dspark_target_layer_ids"}
_FLOAT_FIELDS = {"norm_eps", "rope_theta", "compress_rope_theta", "rope_factor", "route_scale",
                 "swiglu_limit", "hc_eps", "vision_rope_theta"}
_STR_FIELDS = {"score_func", "dtype", "expert_dtype"}
_OPTIONAL_FIELDS = {"vision_max_wh_ratio"}

# HF `text_config` names -> inference names (only those that differ).
HF_TO_INFERENCE = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "moe_intermediate_size": "moe_inter_dim",
    "n_routed_experts": "n_routed_experts",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "max_position_embeddings": "max_seq_len",
}
VISION_HF_TO_INFERENCE = {
    "hidden_size": "vision_dim",
    "num_hidden_layers": "vision_n_layers",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "rope_theta": "vision_rope_theta",
}
# HF-only keys with no inference counterpart that we accept silently.
_HF_IGNORED = {"norm_topk_prob", "rope_scaling", "model_type", "architectures", "torch_dtype",
               "transformers_version", "quantization_config", "initializer_range", "use_cache",
               "tie_word_embeddings", "attention_bias", "attention_dropout", "hidden_act"}


def _coerce(key: str, value: Any, where: str) -> Any:
    """Type-check one value, naming the key when it is of the wrong type."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where}: key '{key}' must be {expected}, got {type(value).__name__} {value!r}")

    if key in _OPTIONAL_FIELDS and value is None:
        return None
    if key in _TUPLE_FIELDS:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise bad("a list of integers")
        return tuple(value)
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if key in _STR_FIELDS:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad("an integer")
    return value


def config_from_dict(raw: dict, where: str = "config") -> ModelConfig:
    """Build a `ModelConfig` from the flat inference dict or an HF root config with `text_config`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level")
    flat: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if "text_config" in raw:
        text = raw["text_config"]
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: key 'text_config' must be an object")
        quant = raw.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError(f"{where}: key 'quantization_config' must be an object")
        for key, value in text.items():
            name = HF_TO_INFERENCE.get(key, key)
            if name in _FIELDS:
                flat[name] = value
            elif key in _HF_IGNORED:
                continue
            else:
                extra[key] = value
        # the vision tower's settings may sit beside the text config
        for key, value in (raw.get("vision_config") or {}).items():
            name = VISION_HF_TO_INFERENCE.get(key, key if key.startswith("vision_") else f"vision_{key}")
            if name in _FIELDS:
                flat.setdefault(name, value)
        if "image_token_id" in raw:
            flat.setdefault("image_token_id", raw["image_token_id"])
        if quant:
            fmt = str(quant.get("fmt", quant.get("quant_method", "fp8"))).lower()
            flat.setdefault("dtype", "fp8" if "fp8" in fmt or "e4m3" in fmt else fmt)
    else:
        for key, value in raw.items():
            if key in _FIELDS:
                flat[key] = value
            else:
                extra[key] = value
    required = ("vocab_size", "dim", "n_layers", "n_heads", "compress_ratios")
    for key in required:
        if key not in flat:
            raise ConfigError(f"{where}: missing key '{key}'")
    values = {key: _coerce(key, value, where) for key, value in flat.items()}
    try:
        return ModelConfig(**values, extra=extra)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


MAX_CONFIG_BYTES = 16 << 20   # a config is a few KB; anything this large is the wrong file
# Upper bounds on counts the engine loops over (the release: 40 layers, 3 DSpark stages, 384 experts,
# a 1M-token position range); a config far beyond them would hang validation and the tally.
MAX_COUNTS = {"n_layers": 1024, "n_mtp_layers": 64, "n_routed_experts": 65536, "vision_n_layers": 1024,
              "max_seq_len": 1 << 24, "hc_mult": 64, "n_heads": 4096}


def load_config(path: str | Path) -> ModelConfig:
    """Read a config file, or a checkpoint folder's `config.json`."""
    from .safe_io import read_text

    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    text = read_text(path, "config file", MAX_CONFIG_BYTES, ConfigError)  # regular files only, bounded
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    return config_from_dict(raw, where=str(path))


def release_config() -> ModelConfig:
    """The release's config as shipped in assets/configs/v41-flash.json."""
    return load_config(Path(__file__).resolve().parent.parent / "assets" / "configs" / "v41-flash.json")


def validate(cfg: ModelConfig) -> None:
    """Raise `ConfigError` naming the key when the config cannot describe a runnable model."""
    def fail(key: str, reason: str) -> None:
        raise ConfigError(f"key '{key}': {reason}")

    for key, limit in MAX_COUNTS.items():  # first: the checks below loop over these
        if getattr(cfg, key) > limit:
            fail(key, f"{getattr(cfg, key):,} is beyond what this engine handles (at most {limit:,})")

    for key in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "window_size", "moe_inter_dim", "n_routed_experts", "n_activated_experts",
                "hc_mult", "index_n_heads", "index_head_dim"):
        if getattr(cfg, key) <= 0:
            fail(key, f"must be positive, got {getattr(cfg, key)}")
    if cfg.n_mtp_layers < 0:
        fail("n_mtp_layers", "must not be negative")
    if len(cfg.compress_ratios) != cfg.n_layers + cfg.n_mtp_layers:
        fail("compress_ratios", f"has {len(cfg.compress_ratios)} entries, expected n_layers + n_mtp_layers = "
             f"{cfg.n_layers + cfg.n_mtp_layers}")
    for i, ratio in enumerate(cfg.compress_ratios):
        if ratio < 0:
            fail("compress_ratios", f"entry {i} is negative ({ratio})")
    for i in range(cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers):
        if cfg.compress_ratios[i] != 0:
            fail("compress_ratios", f"DSpark stage {i - cfg.n_layers} (entry {i}) must be 0 (window only)")
    if cfg.n_heads % cfg.o_groups:
        fail("n_heads", f"{cfg.n_heads} is not divisible by o_groups={cfg.o_groups}")
    if not 0 < cfg.rope_head_dim <= cfg.head_dim or cfg.rope_head_dim % 2:
        fail("rope_head_dim", f"must be even and within head_dim={cfg.head_dim}, got {cfg.rope_head_dim}")
    if cfg.rope_head_dim > cfg.index_head_dim:
        fail("rope_head_dim", f"larger than index_head_dim={cfg.index_head_dim}")
    if cfg.n_activated_experts > cfg.n_routed_experts:
        fail("n_activated_experts", f"{cfg.n_activated_experts} > n_routed_experts={cfg.n_routed_experts}")
    if cfg.score_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        fail("score_func", f"unknown scoring function {cfg.score_func!r}")
    for key in ("dim", "head_dim", "q_lora_rank", "moe_inter_dim", "index_head_dim"):
        if getattr(cfg, key) % 32:
            fail(key, f"{getattr(cfg, key)} is not a multiple of 32 (the FP8/FP4 scale block)")
    if cfg.head_dim % 16:
        fail("head_dim", "not a multiple of 16 (the FP4 KV scale group)")

    kv, idx = cfg.kv_source_layers, cfg.index_source_layers
    for name, layers in (("kv_source_layers", kv), ("index_source_layers", idx)):
        if list(layers) != sorted(set(layers)):
            fail(name, f"must be strictly increasing, got {list(layers)}")
        for layer in layers:
            if not 0 <= layer < cfg.n_layers:
                fail(name, f"layer {layer} is outside 0..{cfg.n_layers - 1}")
            if cfg.compress_ratios[layer] == 0:
                fail(name, f"layer {layer} has compress ratio 0 (a window-only layer has no global KV)")
    missing = sorted(set(kv) - set(idx))
    if missing:
        fail("index_source_layers", f"is not a superset of kv_source_layers (missing {missing})")
    for layer in range(cfg.n_layers):
        ratio = cfg.compress_ratios[layer]
        if ratio == 0:
            continue
        sources = [s for s in kv if s <= layer and cfg.compress_ratios[s] == ratio]
        if not sources:
            fail("kv_source_layers", f"layer {layer} (ratio {ratio}) has no KV source at or below it with the same ratio")
        index_sources = [s for s in idx if s <= layer and s >= sources[-1]]
        if not index_sources:
            fail("index_source_layers", f"layer {layer} has no index source at or below it")
    cand = cfg.candidate_source_layer
    if cand >= 0:
        if cand not in kv:
            fail("candidate_source_layer", f"layer {cand} is not a KV source")
        if cfg.candidate_block_size <= 0 or cfg.candidate_topk_blocks <= 0:
            fail("candidate_topk_blocks", "candidate pool needs positive block count and block size")

    if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
        fail("engram_num_embeddings", f"has {len(cfg.engram_num_embeddings)} entries for "
             f"{len(cfg.engram_layer_ids)} engram layers")
    for layer in cfg.engram_layer_ids:
        if not 0 <= layer < cfg.n_layers:
            fail("engram_layer_ids", f"layer {layer} is outside 0..{cfg.n_layers - 1}")
    if cfg.engram_layer_ids:
        if cfg.engram_head_dim % 32:
            fail("engram_head_dim", "not a multiple of 32 (the FP8 scale block)")
        if cfg.engram_max_ngram_size < 2:
            fail("engram_max_ngram_size", "must be at least 2")
    for layer in cfg.dspark_target_layer_ids:
        if not 0 <= layer < cfg.n_layers:
            fail("dspark_target_layer_ids", f"layer {layer} is outside 0..{cfg.n_layers - 1}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
        value = getattr(cfg, key)
        if not 0 <= value < cfg.vocab_size:
            fail(key, f"id {value} is outside the vocabulary (size {cfg.vocab_size})")
    if cfg.max_seq_len <= 0:
        fail("max_seq_len", "must be positive")
    if not math.isfinite(cfg.norm_eps) or cfg.norm_eps < 0:
        fail("norm_eps", "must be a finite non-negative number")
