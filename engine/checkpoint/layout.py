"""The checkpoint tensor contract: every tensor a config implies, with its safetensors dtype, stored and
logical shape, parameter count and bytes, the diagram box (kind) it belongs to, and its shard.

For the release config this is exactly the release's 96,085 tensors and 510,286,023,000 bytes. Names,
dtypes and shapes follow the released checkpoint (spec section 3); which tensors exist is derived from
the config's lists (KV sources own a compressor and index keys, index sources own indexer queries,
ratio-1 compressors have no gate, Engram layers own a table). Every MoE gate has `bias_vl` (image
positions), as the release does; text-only configs keep it so image spans can still be marked.

`classify(name)` turns a tensor name into its kind/group/layer without a config, so a checkpoint read
from headers lands in exactly the same boxes as the config's contract.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from ..config import ModelConfig

# bytes per stored element of each safetensors dtype we use
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
WEIGHT_BLOCK = 32  # FP8 weights: one E8M0 scale per 32x32 block; FP4 weights: one per 32 inputs
GROUPS = ("attention", "csa2", "moe", "mhc", "norm", "engram", "embedding", "head", "vision", "dspark")


class TensorSpec(NamedTuple):
    """One checkpoint tensor.

    `params` counts logical weights (two per I8 byte for FP4; 0 for a scale tensor). `kind` is the
    diagram box id (e.g. "attn.wq_a", "ffn.experts.w1", "mhc.attn_fn", "engram.embed",
    "dspark.attn.wq_a", "vision.mlp.w1"); `part` is "weight" or "scale"."""

    name: str
    dtype: str                         # safetensors dtype: BF16 F32 F8_E4M3 F8_E8M0 I8
    shape: tuple[int, ...]             # as stored
    logical_shape: tuple[int, ...]     # FP4: the unpacked [out, in]
    params: int
    nbytes: int
    kind: str
    group: str
    part: str                          # weight | scale
    layer: int | None = None           # backbone layer id
    stage: int | None = None           # DSpark stage (mtp.S)
    block: int | None = None           # vision block
    expert: int | None = None          # routed expert id
    fmt: str = ""                      # BF16 F32 FP8 FP4 E8M0: what the bytes mean

    @property
    def instance(self) -> tuple:
        """Tensors with the same instance key form one box instance (a weight and its scale)."""
        return (self.kind, self.layer, self.stage, self.block, self.expert)


# -- naming ----------------------------------------------------------------------------------------

_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)$")
_VISION_BLOCK = re.compile(r"vision\.blocks\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])$")
_SUFFIX = re.compile(r"\.(weight|scale|bias)$")


class NameInfo(NamedTuple):
    kind: str
    group: str
    part: str
    layer: int | None = None
    stage: int | None = None
    block: int | None = None
    expert: int | None = None


def _strip(rest: str) -> tuple[str, str]:
    """'attn.wq_a.scale' -> ('attn.wq_a', 'scale'); biases belong to their linear's box."""
    m = _SUFFIX.search(rest)
    if not m:
        return rest, "weight"
    return rest[: m.start()], "scale" if m.group(1) == "scale" else "weight"


def _block_kind(rest: str) -> tuple[str, str, str, int | None]:
    """A name inside `layers.L.` or `mtp.S.` -> (kind, group, part, expert)."""
    if rest.startswith("hc_"):  # hc_attn_fn / hc_ffn_base / hc_attn_scale (F32 params, not scales)
        return "mhc." + rest[3:], "mhc", "weight", None
    if rest.startswith("ffn.gate.bias"):
        return rest, "moe", "weight", None
    base, part = _strip(rest)
    m = _EXPERT.match(base)
    if m:
        return f"ffn.experts.{m.group(2)}", "moe", part, int(m.group(1))
    if base in ("attn_norm", "ffn_norm"):
        return "norm." + base[:-5], "norm", part, None
    if base.startswith(("attn.compressor.", "attn.indexer.")):
        return base, "csa2", part, None
    if base.startswith("attn."):
        return base, "attention", part, None
    if base.startswith("ffn."):
        return base, "moe", part, None
    if base.startswith("engram."):
        return base, "engram", part, None
    # DSpark-only heads (main_proj, main_norm, norm, markov_head.*, confidence_head.proj)
    return base, "dspark", part, None


def classify(name: str) -> NameInfo:
    """Where a checkpoint tensor belongs, from its name alone."""
    parts = name.split(".")
    # fast path for the ~94k routed-expert tensors: {layers|mtp}.N.ffn.experts.E.wX.{weight|scale}
    if len(parts) == 7 and parts[2] == "ffn" and parts[3] == "experts" and parts[0] in ("layers", "mtp") \
            and parts[1].isdigit() and parts[4].isdigit() and parts[5] in ("w1", "w2", "w3") \
            and parts[6] in ("weight", "scale"):
        if parts[0] == "layers":
            return NameInfo("ffn.experts." + parts[5], "moe", parts[6], layer=int(parts[1]), expert=int(parts[4]))
        return NameInfo("dspark.ffn.experts." + parts[5], "dspark", parts[6], stage=int(parts[1]),
                        expert=int(parts[4]))
    m = _LAYER.match(name)
    if m:
        kind, group, part, expert = _block_kind(m.group(2))
        return NameInfo(kind, group, part, layer=int(m.group(1)), expert=expert)
    m = _MTP.match(name)
    if m:
        kind, _, part, expert = _block_kind(m.group(2))
        return NameInfo("dspark." + kind, "dspark", part, stage=int(m.group(1)), expert=expert)
    m = _VISION_BLOCK.match(name)
    if m:
        base, part = _strip(m.group(2))
        return NameInfo("vision." + base, "vision", part, block=int(m.group(1)))
    base, part = _strip(name)
    if base.startswith("vision."):
        return NameInfo(base.replace(".proj", ""), "vision", part)
    if base.startswith("aligner."):
        return NameInfo("vision." + base, "vision", part)
    if base == "embed":
        return NameInfo("embed", "embedding", part)
    if base in ("image_start", "image_end", "image_newline"):
        return NameInfo("embed." + base, "embedding", part)
    if base == "head":
        return NameInfo("head", "head", part)
    if base == "norm":
        return NameInfo("norm.final", "norm", part)
    return NameInfo(base, "other", part)


_FORMATS = {"BF16": "BF16", "F32": "F32", "F8_E4M3": "FP8", "F8_E8M0": "E8M0", "I8": "FP4"}


def logical_params(dtype: str, shape: tuple[int, ...]) -> int:
    """Logical weights stored in a tensor: FP4 packs two per I8 byte; E8M0 scales count 0."""
    if dtype == "F8_E8M0":
        return 0
    n = math.prod(shape)
    return 2 * n if dtype == "I8" else n


def spec_from_header(name: str, dtype: str, shape: tuple[int, ...] | list[int]) -> TensorSpec:
    """The `TensorSpec` a checkpoint header entry describes (used to tally a real checkpoint)."""
    shape = tuple(map(int, shape))
    info = classify(name)
    numel = math.prod(shape)
    if dtype == "I8" and shape:
        logical, params = shape[:-1] + (2 * shape[-1],), 2 * numel
    else:
        logical, params = shape, (0 if dtype == "F8_E8M0" else numel)
    return TensorSpec(name, dtype, shape, logical, params, numel * DTYPE_BYTES.get(dtype, 1), info.kind,
                      info.group, info.part, info.layer, info.stage, info.block, info.expert,
                      _FORMATS.get(dtype, dtype))


# -- the contract ----------------------------------------------------------------------------------

class _Builder:
    def __init__(self) -> None:
        self.specs: list[TensorSpec] = []

    def add(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.specs.append(spec_from_header(name, dtype, shape))

    def fp8_linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        self.add(f"{prefix}.weight", "F8_E4M3", (out_dim, in_dim))
        self.add(f"{prefix}.scale", "F8_E8M0", (-(-out_dim // WEIGHT_BLOCK), -(-in_dim // WEIGHT_BLOCK)))

    def fp4_linear(self, prefix: str, out_dim: int, in_dim: int) -> None:
        self.add(f"{prefix}.weight", "I8", (out_dim, in_dim // 2))
        self.add(f"{prefix}.scale", "F8_E8M0", (out_dim, in_dim // WEIGHT_BLOCK))


def _block(b: _Builder, cfg: ModelConfig, prefix: str, *, ratio: int, kv_source: bool, index_source: bool,
           engram_rows: int | None, n_experts: int) -> None:
    """One transformer block (backbone layer or DSpark stage)."""
    dim, inter = cfg.dim, cfg.moe_inter_dim
    attn = f"{prefix}.attn"
    b.add(f"{prefix}.attn_norm.weight", "BF16", (dim,))
    b.add(f"{attn}.attn_sink", "F32", (cfg.n_heads,))
    b.add(f"{attn}.q_norm.weight", "BF16", (cfg.q_lora_rank,))
    b.add(f"{attn}.kv_norm.weight", "BF16", (cfg.head_dim,))
    b.fp8_linear(f"{attn}.wq_a", cfg.q_lora_rank, dim)
    b.fp8_linear(f"{attn}.wq_b", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank)
    b.fp8_linear(f"{attn}.wkv", cfg.head_dim, dim)
    # wo_a: o_groups stacked [o_lora_rank, heads_per_group * head_dim] blocks
    b.fp8_linear(f"{attn}.wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups)
    b.fp8_linear(f"{attn}.wo_b", dim, cfg.o_groups * cfg.o_lora_rank)
    if kv_source:
        b.add(f"{attn}.compressor.wkv.weight", "BF16", (cfg.head_dim, dim))
        if ratio > 1:  # a ratio-1 compressor has nothing to pool, hence no gate
            b.add(f"{attn}.compressor.wgate.weight", "BF16", (cfg.head_dim, dim))
        b.add(f"{attn}.compressor.norm.weight", "BF16", (cfg.head_dim,))
        b.add(f"{attn}.indexer.wk.weight", "BF16", (cfg.index_head_dim, cfg.head_dim))
        b.add(f"{attn}.indexer.k_norm.weight", "BF16", (cfg.index_head_dim,))
    if index_source:
        b.fp8_linear(f"{attn}.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        b.add(f"{attn}.indexer.weights_proj.weight", "BF16", (cfg.index_n_heads, dim))
    if engram_rows is not None:
        eng = f"{prefix}.engram"
        b.add(f"{eng}.embed.weight", "F8_E4M3", (engram_rows, cfg.engram_head_dim))
        b.add(f"{eng}.embed.scale", "F8_E8M0", (engram_rows, cfg.engram_head_dim // WEIGHT_BLOCK))
        lookup = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        b.fp8_linear(f"{eng}.wkv", dim * (cfg.hc_mult + 1), lookup)  # hc_mult keys + one shared value
        b.add(f"{eng}.q_weight", "BF16", (cfg.hc_mult, dim))
        b.add(f"{eng}.k_weight", "BF16", (cfg.hc_mult, dim))
    ffn = f"{prefix}.ffn"
    b.add(f"{prefix}.ffn_norm.weight", "BF16", (dim,))
    b.add(f"{ffn}.gate.weight", "BF16", (n_experts, dim))
    b.add(f"{ffn}.gate.bias", "F32", (n_experts,))
    # image positions route with their own bias; kept without a vision tower too, so image spans can
    # be marked in a text-only model (the small model trains it on marked spans)
    b.add(f"{ffn}.gate.bias_vl", "F32", (n_experts,))
    for e in range(n_experts):
        b.fp4_linear(f"{ffn}.experts.{e}.w1", inter, dim)
        b.fp4_linear(f"{ffn}.experts.{e}.w2", dim, inter)
        b.fp4_linear(f"{ffn}.experts.{e}.w3", inter, dim)
    shared_inter = inter * cfg.n_shared_experts
    if cfg.n_shared_experts:
        b.fp8_linear(f"{ffn}.shared_experts.w1", shared_inter, dim)
        b.fp8_linear(f"{ffn}.shared_experts.w2", dim, shared_inter)
        b.fp8_linear(f"{ffn}.shared_experts.w3", shared_inter, dim)
    mix = (2 + cfg.hc_mult) * cfg.hc_mult  # pre, post, and the hc x hc comb matrix
    for branch in ("attn", "ffn"):
        b.add(f"{prefix}.hc_{branch}_fn", "F32", (mix, cfg.hc_mult * dim))
        b.add(f"{prefix}.hc_{branch}_base", "F32", (mix,))
        b.add(f"{prefix}.hc_{branch}_scale", "F32", (3,))


def _vision(b: _Builder, cfg: ModelConfig) -> None:
    dim, vdim = cfg.dim, cfg.vision_dim
    for name in ("image_start", "image_end", "image_newline"):
        b.add(name, "BF16", (dim,))
    b.add("aligner.w1.weight", "BF16", (dim, vdim * cfg.vision_downsample_ratio ** 2))
    b.add("aligner.w1.bias", "BF16", (dim,))
    b.add("aligner.w2.weight", "BF16", (dim, dim))
    b.add("aligner.w2.bias", "BF16", (dim,))
    b.add("vision.patch_embed.proj.weight", "BF16", (vdim, 3 * cfg.vision_patch_size ** 2))
    b.add("vision.patch_embed.proj.bias", "BF16", (vdim,))
    for i in range(cfg.vision_n_layers):
        p = f"vision.blocks.{i}"
        b.add(f"{p}.norm1.weight", "BF16", (vdim,))
        b.add(f"{p}.attn.wqkv.weight", "BF16", (3 * vdim, vdim))
        b.add(f"{p}.attn.wqkv.bias", "BF16", (3 * vdim,))
        b.add(f"{p}.attn.wo.weight", "BF16", (vdim, vdim))
        b.add(f"{p}.attn.wo.bias", "BF16", (vdim,))
        b.add(f"{p}.norm2.weight", "BF16", (vdim,))
        b.add(f"{p}.mlp.w1.weight", "BF16", (2 * cfg.vision_inter_dim, vdim))  # gate and up, stacked
        b.add(f"{p}.mlp.w2.weight", "BF16", (vdim, cfg.vision_inter_dim))
    b.add("vision.norm.weight", "BF16", (vdim,))


def _dspark_heads(b: _Builder, cfg: ModelConfig) -> None:
    """Stage 0 folds the tapped hidden states into one; the last stage owns the norm and heads."""
    dim, rank = cfg.dim, cfg.dspark_markov_rank
    b.fp8_linear("mtp.0.main_proj", dim, dim * len(cfg.dspark_target_layer_ids))
    b.add("mtp.0.main_norm.weight", "BF16", (dim,))
    last = f"mtp.{cfg.n_mtp_layers - 1}"
    b.add(f"{last}.norm.weight", "BF16", (dim,))
    b.add(f"{last}.markov_head.embed.weight", "BF16", (cfg.vocab_size, rank))
    b.add(f"{last}.markov_head.head.weight", "BF16", (cfg.vocab_size, rank))
    b.add(f"{last}.confidence_head.proj.weight", "BF16", (1, dim + rank))


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint a config implies, in shard order (see `shard_plan`)."""
    return list(_cached_specs(cfg))


@functools.lru_cache(maxsize=8)
def _cached_specs(cfg: ModelConfig) -> tuple[TensorSpec, ...]:
    b = _Builder()
    if cfg.vision_enabled:
        _vision(b, cfg)
    b.add("embed.weight", "BF16", (cfg.vocab_size, cfg.dim))
    kv, idx = set(cfg.kv_source_layers), set(cfg.index_source_layers)
    engram_rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
    for layer in range(cfg.n_layers):
        _block(b, cfg, f"layers.{layer}", ratio=cfg.compress_ratios[layer], kv_source=layer in kv,
               index_source=layer in idx, engram_rows=engram_rows.get(layer), n_experts=cfg.n_routed_experts)
    b.add("head.weight", "BF16", (cfg.vocab_size, cfg.dim))
    b.add("norm.weight", "BF16", (cfg.dim,))
    for stage in range(cfg.n_mtp_layers):
        _block(b, cfg, f"mtp.{stage}", ratio=0, kv_source=False, index_source=False, engram_rows=None,
               n_experts=cfg.experts_of(cfg.n_layers + stage)[0])
    if cfg.n_mtp_layers:
        _dspark_heads(b, cfg)
    return tuple(b.specs)


# -- sharding --------------------------------------------------------------------------------------

@dataclass
class Shard:
    filename: str
    specs: list[TensorSpec] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def shard_name(i: int, n: int) -> str:
    """1-based shard file name, e.g. model-00003-of-00048.safetensors."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _shard_groups(cfg: ModelConfig, specs: list[TensorSpec]) -> tuple[list[list[TensorSpec]], list[list[TensorSpec]]]:
    """(ordinary groups, engram groups) in the release's shard order.

    Release assignment (read off the published shard sizes): 1 = vision tower and aligner; 2 = embed and
    the image delimiters; 3..42 = layers 0..39 (without Engram); 43 = head and final norm; 44..46 = the
    DSpark stages (stage 0 with main_proj, the last with the heads); 47, 48 = all of layers.1.engram.* and
    layers.14.engram.*."""
    vision, embed, head = [], [], []
    layers: list[list[TensorSpec]] = [[] for _ in range(cfg.n_layers)]
    stages: list[list[TensorSpec]] = [[] for _ in range(cfg.n_mtp_layers)]
    engram: dict[int, list[TensorSpec]] = {layer: [] for layer in cfg.engram_layer_ids}
    for s in specs:
        if s.group == "engram":
            engram[s.layer].append(s)
        elif s.layer is not None:
            layers[s.layer].append(s)
        elif s.stage is not None:
            stages[s.stage].append(s)
        elif s.group == "vision":
            vision.append(s)
        elif s.group == "embedding":
            embed.append(s)
        else:
            head.append(s)
    ordinary = [g for g in [vision, embed, *layers, head, *stages] if g]
    return ordinary, [g for g in engram.values() if g]


def shard_plan(cfg: ModelConfig, n_shards: int | None = None,
               specs: list[TensorSpec] | None = None) -> list[Shard]:
    """Assign every tensor to a shard; the Engram layers' tensors are always the last shards.

    n_shards None: one shard per natural group (48 for the release, its real assignment). A smaller
    n_shards merges neighbouring groups (balanced by bytes); a larger one is clipped to the group count."""
    specs = tensor_specs(cfg) if specs is None else specs
    ordinary, engram = _shard_groups(cfg, specs)
    natural = len(ordinary) + len(engram)
    n = natural if n_shards is None else max(1, min(int(n_shards), natural))
    if n < natural:
        if n == 1 or not ordinary:
            ordinary, engram = _merge(ordinary + engram, n), []
        else:
            if len(engram) > n - 1:  # keep Engram last: fold the surplus Engram groups together
                keep = n - 1
                engram = engram[: keep - 1] + [sum(engram[keep - 1:], [])]
            ordinary = _merge(ordinary, n - len(engram))
    groups = ordinary + engram
    return [Shard(shard_name(i + 1, len(groups)), g) for i, g in enumerate(groups)]


def _merge(groups: list[list[TensorSpec]], k: int) -> list[list[TensorSpec]]:
    """Merge consecutive groups into k bins of roughly equal bytes (order kept)."""
    if k >= len(groups):
        return groups
    sizes = [sum(s.nbytes for s in g) for g in groups]
    total = sum(sizes)
    bins: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    done = 0
    for i, (g, size) in enumerate(zip(groups, sizes)):
        current += g
        done += size
        remaining_groups, remaining_bins = len(groups) - i - 1, k - len(bins) - 1
        target = total * (len(bins) + 1) / k
        if remaining_bins > 0 and (done >= target or remaining_groups == remaining_bins):
            bins.append(current)
            current = []
    bins.append(current)
    return bins


def weight_map(plan: list[Shard]) -> dict[str, str]:
    """tensor name -> shard file name (the index's weight_map)."""
    return {s.name: shard.filename for shard in plan for s in shard.specs}
