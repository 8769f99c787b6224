"""Parameters, bytes and cache sizes: the one source of truth for the CLI, the UI and the tests.

A tally is built from a list of `TensorSpec`s, either the config's contract (`tally_from_config`) or a
checkpoint's headers (`tally_from_checkpoint`, no tensor data read), so the two agree by construction
whenever the checkpoint matches the config.

Positions:
- total: every stored weight (scales count 0 parameters, but their bytes count).
- active per generated token: all backbone layers, routed experts at n_activated/n_routed, the shared
  expert, attention with its CSA2 extras, mHC, norms, Engram's projection and gates plus the table rows
  one token reads ((max_ngram-1) * n_heads rows of head_dim per Engram layer), then the final norm and
  the head. The embedding lookup is not counted (a row read, not a matmul); DSpark and vision are not.
- active per prompt token: the encoder layers (below `roles.decoder_start`, by the same rules) plus the
  decoder start's compressor and index-key projection (wk, k_norm), which project the global KV.

`backbone_params` is everything except the Engram tables and DSpark (so it includes the embedding, the
head and the vision tower: the spec's ~552.4 B).
"""

from __future__ import annotations

import gc
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from .config import ModelConfig
from .checkpoint.layout import GROUPS, TensorSpec, tensor_specs
from .roles import decoder_start

SCALE_BYTES_FP4_KV = 1     # global KV: one E4M3 scale per 16 values
KV_SCALE_GROUP = 16
INDEX_SCALE_GROUP = 32     # index keys: one E8M0 per 32
WINDOW_SCALE_GROUP = 32    # sliding window: FP8 with one E8M0 per 32


@dataclass
class TallyRow:
    """One diagram box, aggregated over the layers (and experts) it appears in."""

    name: str                    # e.g. "attn.wq_a"; a box with per-layer shapes gets "[L<layer>]"
    box: str                     # diagram box id (the layout kind)
    group: str                   # attention csa2 moe mhc norm engram embedding head vision dspark
    params: int                  # per instance
    dtype: str                   # storage dtype of the weight (I8 for FP4)
    bytes: int                   # per instance, weight + scales
    shape: list[int]             # logical shape of the weight
    layers: list[int]            # backbone layers it appears in ([] for globals, DSpark, vision)
    instances: int
    total_params: int
    total_bytes: int
    active_decode_params: int | float
    active_prefill_params: int | float
    fmt: str = ""                # BF16 F32 FP8 FP4

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class KVSource:
    """What one KV source layer stores per token in the global cache."""

    layer: int
    ratio: int
    entries_per_token: float     # 1/m
    main_entry_bytes: int        # head_dim FP4 + one E4M3 scale per 16
    index_key_bytes: int         # index_head_dim FP4 + one E8M0 per 32
    bytes_per_token: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Tally:
    source: str                  # "config" or "checkpoint headers: <dir>"
    rows: list[TallyRow]
    total_params: int
    backbone_params: int
    engram_params: int
    dspark_params: int
    vision_params: int
    routed_expert_params: int
    active_decode_params: int | float
    active_prefill_params: int | float
    kv_bytes_per_token: float
    window_bytes_per_layer: int
    tensor_count: int
    checkpoint_bytes: int
    bytes_by_dtype: dict[str, int]
    kv: list[KVSource] = field(default_factory=list)
    dspark_dense_params: int = 0
    dspark_routed_params: int = 0
    params_by_group: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON-able dict (top-level figures, `rows`, `kv`)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("rows", "kv")}
        out["rows"] = [r.to_dict() for r in self.rows]
        out["kv"] = [k.to_dict() for k in self.kv]
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def row(self, name: str) -> TallyRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def layer_params(self, layer: int, group: str | None = None) -> int:
        """Parameters one backbone layer owns (optionally one group of them)."""
        return sum(r.params * r.instances // len(r.layers) for r in self.rows
                   if layer in r.layers and (group is None or r.group == group))


# -- KV cache -------------------------------------------------------------------------------------

def kv_breakdown(cfg: ModelConfig) -> list[KVSource]:
    """One entry per KV source layer (the layers that own global KV and index keys)."""
    main = cfg.head_dim // 2 + cfg.head_dim // KV_SCALE_GROUP * SCALE_BYTES_FP4_KV
    index = cfg.index_head_dim // 2 + cfg.index_head_dim // INDEX_SCALE_GROUP
    out = []
    for layer in cfg.kv_source_layers:
        m = cfg.compress_ratios[layer]
        out.append(KVSource(layer=layer, ratio=m, entries_per_token=1 / m, main_entry_bytes=main,
                            index_key_bytes=index, bytes_per_token=(main + index) / m))
    return out


def kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Global KV (compressed entries + index keys) per token of context: 890.0 at release."""
    return float(sum(Fraction(k.main_entry_bytes + k.index_key_bytes, k.ratio) for k in kv_breakdown(cfg)))


def window_bytes_per_layer(cfg: ModelConfig) -> int:
    """One layer's full sliding window: window_size x (head_dim FP8 + head_dim/32 E8M0 scales)."""
    return cfg.window_size * (cfg.head_dim + cfg.head_dim // WINDOW_SCALE_GROUP)


def cache_breakdown_at(cfg: ModelConfig, context_len: int, include_dspark: bool = False) -> dict[str, int]:
    """Cache bytes with `context_len` tokens: each KV source holds floor(context_len/m) entries (main
    + index key); every backbone layer holds min(context_len, window) window entries. DSpark stages'
    windows are counted only with include_dspark (they are draft-time state, rebuilt per step)."""
    if context_len < 0:
        raise ValueError("context_len must not be negative")
    kv = kv_breakdown(cfg)
    global_kv = sum((context_len // k.ratio) * k.main_entry_bytes for k in kv)
    index_keys = sum((context_len // k.ratio) * k.index_key_bytes for k in kv)
    n_window_layers = cfg.n_layers + (cfg.n_mtp_layers if include_dspark else 0)
    per_entry = cfg.head_dim + cfg.head_dim // WINDOW_SCALE_GROUP
    windows = n_window_layers * min(context_len, cfg.window_size) * per_entry
    return {"context_len": context_len, "global_kv": global_kv, "index_keys": index_keys,
            "windows": windows, "total": global_kv + index_keys + windows}


def cache_bytes_at(cfg: ModelConfig, context_len: int, include_dspark: bool = False) -> int:
    """Total cache bytes at `context_len` tokens (see `cache_breakdown_at`)."""
    return cache_breakdown_at(cfg, context_len, include_dspark)["total"]


# -- rows -----------------------------------------------------------------------------------------

def _as_number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _instance_active(kind: str, layer: int | None, params: int, cfg: ModelConfig, split: int) -> tuple[int, int, bool]:
    """(decode, prefill, is_routed) for one box instance; routed experts are scaled later by
    n_activated/n_routed (kept as integers here so the sums stay exact)."""
    if layer is None:
        # globals: only the final norm and the head run per generated token
        return (params if kind in ("head", "norm.final") else 0), 0, False
    routed = kind.startswith("ffn.experts.")
    if kind == "engram.embed":
        per_token = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    else:
        per_token = params
    if layer < split or (layer == split and (kind.startswith("attn.compressor.")
                                              or kind in ("attn.indexer.wk", "attn.indexer.k_norm"))):
        return per_token, per_token, routed
    return per_token, 0, routed


def tally_from_specs(specs: list[TensorSpec], cfg: ModelConfig, source: str) -> Tally:
    """Aggregate tensors into box rows and the headline figures."""
    split = decoder_start(cfg)
    # 1. instances: a weight and its scale (and a bias) of one (kind, layer, stage, block, expert)
    instances: dict[tuple, dict] = {}
    for s in specs:
        inst = instances.get(s.instance)
        if inst is None:
            inst = instances[s.instance] = {"spec": s, "params": 0, "bytes": 0}
        inst["params"] += s.params
        inst["bytes"] += s.nbytes
        if s.part == "weight" and (inst["spec"].part != "weight" or len(s.shape) > len(inst["spec"].shape)):
            inst["spec"] = s  # describe the box by its weight (not its scale or bias)
    # 2. rows: instances of one kind with one size
    rows: dict[tuple, dict] = {}
    for (kind, layer, stage, block, expert), inst in instances.items():
        w = inst["spec"]
        key = (kind, inst["params"], inst["bytes"], w.logical_shape)
        row = rows.get(key)
        if row is None:
            row = rows[key] = {"w": w, "params": inst["params"], "bytes": inst["bytes"], "layers": set(),
                               "n": 0, "decode": 0, "prefill": 0, "routed": False}
        row["n"] += 1
        if layer is not None:
            row["layers"].add(layer)
        dec, pre, routed = _instance_active(kind, layer, inst["params"], cfg, split)
        row["decode"] += dec
        row["prefill"] += pre
        row["routed"] |= routed
    variants = Counter(key[0] for key in rows)
    out_rows = []
    for (kind, params, nbytes, shape), row in rows.items():
        name = kind
        if variants[kind] > 1:
            name = f"{kind}[L{min(row['layers'])}]" if len(row["layers"]) == 1 else f"{kind}[{'x'.join(map(str, shape))}]"
        w = row["w"]
        share = Fraction(cfg.n_activated_experts, cfg.n_routed_experts) if row["routed"] else Fraction(1)
        out_rows.append(TallyRow(
            name=name, box=kind, group=w.group, params=params, dtype=w.dtype, bytes=nbytes, shape=list(shape),
            layers=sorted(row["layers"]), instances=row["n"], total_params=params * row["n"],
            total_bytes=nbytes * row["n"], active_decode_params=_as_number(row["decode"] * share),
            active_prefill_params=_as_number(row["prefill"] * share), fmt=w.fmt))

    rank = {g: i for i, g in enumerate(GROUPS)}
    out_rows.sort(key=lambda r: (rank.get(r.group, len(rank)), r.name))
    total = sum(s.params for s in specs)
    by_group: Counter = Counter()
    for s in specs:
        by_group[s.group] += s.params
    engram_tables = sum(s.params for s in specs if s.kind == "engram.embed")
    dspark_routed = sum(s.params for s in specs if s.group == "dspark" and s.expert is not None)
    bytes_by_dtype: Counter = Counter()
    for s in specs:
        bytes_by_dtype[s.dtype] += s.nbytes
    return Tally(
        source=source, rows=out_rows, total_params=total,
        backbone_params=total - engram_tables - by_group["dspark"],
        engram_params=engram_tables, dspark_params=by_group["dspark"], vision_params=by_group["vision"],
        routed_expert_params=sum(s.params for s in specs if s.layer is not None and s.expert is not None),
        active_decode_params=_as_number(sum((Fraction(r.active_decode_params) for r in out_rows), Fraction(0))),
        active_prefill_params=_as_number(sum((Fraction(r.active_prefill_params) for r in out_rows), Fraction(0))),
        kv_bytes_per_token=kv_bytes_per_token(cfg), window_bytes_per_layer=window_bytes_per_layer(cfg),
        tensor_count=len(specs), checkpoint_bytes=sum(s.nbytes for s in specs),
        bytes_by_dtype=dict(sorted(bytes_by_dtype.items())), kv=kv_breakdown(cfg),
        dspark_dense_params=by_group["dspark"] - dspark_routed, dspark_routed_params=dspark_routed,
        params_by_group={g: by_group[g] for g in sorted(by_group)})


def tally_from_config(cfg: ModelConfig) -> Tally:
    """The tally of the checkpoint a config implies."""
    return tally_from_specs(tensor_specs(cfg), cfg, "config")


def tally_from_checkpoint(directory: str | Path) -> Tally:
    """The tally of a checkpoint folder from its shard headers and config.json (no tensor data read)."""
    from .checkpoint.inventory import checkpoint_config, read_inventory
    inventory = read_inventory(directory)
    cfg = checkpoint_config(directory)
    enabled = gc.isenabled()
    gc.disable()  # ~100k short-lived records: skip the cyclic collector's rescans
    try:
        return tally_from_specs(inventory.specs(), cfg, f"checkpoint headers: {directory}")
    finally:
        if enabled:
            gc.enable()
