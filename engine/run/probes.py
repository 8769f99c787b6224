"""The probe format: what a run asks for (ProbeRequest), what it gives back per layer (LayerResult) and
as a whole (RunResult), in three forms: tensors, JSON (`to_json` / `from_json`: plain numbers, for
files and the explorer) and wire (`to_wire` / `from_wire`: tensors packed as binary blocks, for the
engine service). The forward fills one plain dict per probed layer (engine/model/transformer.py); `layer_result`
turns it into a LayerResult, so a new probe is a field here and one line where the forward computes it.
"""

from __future__ import annotations

import base64
import dataclasses
import gc
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ops import DEFAULT_NUMERICS

ENGINE_VERSION = "0.1.0"
PROBE_KINDS = ("topk", "mhc", "routing", "norms", "timing")
STORED_BEFORE_NUMERICS = "fp32"   # what a run JSON without "numerics" was computed in (the only flow before it)


@dataclass
class ProbeRequest:
    """Which layers a run probes, which kinds, and which layers also get the detail probes."""
    layers: set[int] | None = None      # None: every layer
    kinds: set[str] = field(default_factory=lambda: set(PROBE_KINDS))
    detail: set[int] = field(default_factory=set)  # layers that also get runner-ups and selection recall

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


@dataclass
class LayerResult:
    """Probes of one layer for one run. Tensors are CPU; T = prompt length."""
    layer: int
    role: str
    label: str
    compress_ratio: int
    kv_source: int | None
    index_source: int | None
    window_size: int
    first_position: int = 0                     # row 0's prompt position (a CED prefill's decoder: T - replay)
    topk: torch.Tensor | None = None            # [T, k] global entry indices, -1 padded
    topk_scores: torch.Tensor | None = None     # [T, k] indexer scores of those entries
    candidate_pool: torch.Tensor | None = None  # [T, N] bool (candidate source and Reindex layers)
    n_entries: int = 0                          # global entries after the prompt
    mhc: dict = field(default_factory=dict)     # {"attn"|"ffn": {"pre": [T,hc], "post": [T,hc], "comb": [T,hc,hc]}}
    routing: dict = field(default_factory=dict)  # experts [T,k], weights [T,k], scores [T,E]
    residual_norms: torch.Tensor | None = None  # [T, hc]
    time_s: float = 0.0
    zero_score_picks: torch.Tensor | None = None  # [T] selected entries whose index score is exactly 0
    # on request (run(detail_layers=...)): engine/model/selection_probe.py
    runner_ups: torch.Tensor | None = None        # [T, r] best unselected entries, -1 padded
    runner_up_scores: torch.Tensor | None = None  # [T, r] their index scores (-inf padding)
    selection_recall: torch.Tensor | None = None  # [T] attention mass on the picks over all visible entries
    # ties (engine/model/attention.py tie_marks): which picks a top-k took by chance among equal scores
    topk_kth: torch.Tensor | None = None          # [T] the k-th pick's score (-inf: fewer than k picks)
    topk_tied: torch.Tensor | None = None         # [T, k] bool: picks tied at the k-th score with unpicked entries

    def to_json(self) -> dict:
        with gc_paused():
            return self._json()

    def _json(self) -> dict:
        pool = None
        if self.candidate_pool is not None:  # bool [T, N] -> per query, the entry indices in its pool
            entries = _plain(self.candidate_pool.nonzero()[:, 1])
            ends = _plain(self.candidate_pool.sum(-1).cumsum(0))
            pool = [entries[a:b] for a, b in zip([0] + ends[:-1], ends)]
        return {
            "layer": self.layer, "role": self.role, "label": self.label,
            "compress_ratio": self.compress_ratio, "kv_source": self.kv_source,
            "index_source": self.index_source, "window_size": self.window_size,
            "n_entries": self.n_entries, "first_position": self.first_position,
            "topk": _plain(self.topk), "topk_scores": _finite(self.topk_scores),
            "candidate_pool": pool,
            "mhc": {part: {k: _plain(v) for k, v in d.items()} for part, d in self.mhc.items()},
            "routing": {k: (_plain(v) if torch.is_tensor(v) else v) for k, v in self.routing.items()},
            "residual_norms": _plain(self.residual_norms),
            "time_s": self.time_s,
            **({"zero_score_picks": _plain(self.zero_score_picks)} if self.zero_score_picks is not None else {}),
            **({"runner_ups": _plain(self.runner_ups), "runner_up_scores": _finite(self.runner_up_scores)}
               if self.runner_ups is not None else {}),
            **({"selection_recall": [v if v == v else None for v in _plain(self.selection_recall)]}   # NaN: no entry
               if self.selection_recall is not None else {}),
            **({"topk_kth": [v if np.isfinite(v) else None for v in _plain(self.topk_kth)],
                "topk_tied": _plain(self.topk_tied)} if self.topk_tied is not None else {}),
        }


    def to_wire(self) -> dict:
        """Every field, tensors packed as binary blocks (`pack_tensor`): what the engine service sends for
        a click. At release size a layer is ~100 MB as JSON numbers and a few seconds to write and read;
        packed it is a fraction of both. `from_wire` gives back an equal LayerResult."""
        return {f.name: _packed(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, d: dict) -> LayerResult:
        return cls(**{f.name: _unpacked(d[f.name]) for f in dataclasses.fields(cls) if f.name in d})

    @classmethod
    def from_json(cls, d: dict) -> LayerResult:
        """The LayerResult `to_json` wrote: tensors in the forward's dtypes, None back to -inf (scores)
        or NaN (recall), the candidate pool's entry lists back to a bool [T, n_entries] mask."""
        def tensor(key, dtype, missing=None):
            v = d.get(key)
            if v is None:
                return None
            if missing is not None:
                v = [[missing if x is None else x for x in row] if isinstance(row, list) else (missing if row is None else row)
                     for row in v]
            return torch.tensor(v, dtype=dtype)

        pool = None
        if d.get("candidate_pool") is not None:
            pool = torch.zeros(len(d["candidate_pool"]), d.get("n_entries", 0), dtype=torch.bool)
            for t, row in enumerate(d["candidate_pool"]):
                pool[t, row] = True
        routing_dtypes = {"experts": torch.long}
        return cls(
            layer=d["layer"], role=d["role"], label=d["label"], compress_ratio=d["compress_ratio"],
            kv_source=d["kv_source"], index_source=d["index_source"], window_size=d["window_size"],
            first_position=d.get("first_position", 0), n_entries=d.get("n_entries", 0), time_s=d.get("time_s", 0.0),
            topk=tensor("topk", torch.long), topk_scores=tensor("topk_scores", torch.float32, float("-inf")),
            candidate_pool=pool,
            mhc={part: {k: torch.tensor(v, dtype=torch.float32) for k, v in parts.items()}
                 for part, parts in (d.get("mhc") or {}).items()},
            routing={k: torch.tensor(v, dtype=routing_dtypes.get(k, torch.float32)) if isinstance(v, list) else v
                     for k, v in (d.get("routing") or {}).items()},
            residual_norms=tensor("residual_norms", torch.float32),
            zero_score_picks=tensor("zero_score_picks", torch.long),
            runner_ups=tensor("runner_ups", torch.long),
            runner_up_scores=tensor("runner_up_scores", torch.float32, float("-inf")),
            selection_recall=tensor("selection_recall", torch.float32, float("nan")),
            topk_kth=tensor("topk_kth", torch.float32, float("-inf")),
            topk_tied=tensor("topk_tied", torch.bool))


def pack_tensor(t: torch.Tensor) -> dict:
    """A CPU tensor as JSON: its dtype, shape and raw bytes in base64, stored in the narrowest exact form
    (bool one bit per value; int64 as int32 when every value fits)."""
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bool:
        raw, store = np.packbits(t.contiguous().numpy(), axis=None).tobytes(), "bits"
    else:
        if t.dtype == torch.int64 and (t.numel() == 0 or -2**31 <= int(t.min()) and int(t.max()) < 2**31):
            t = t.to(torch.int32)
        a = _as_numpy(t.contiguous())
        raw, store = a.astype(a.dtype.newbyteorder("<")).tobytes(), a.dtype.newbyteorder("<").str
    return {"tensor": dtype, "store": store, "shape": list(t.shape),
            "b64": base64.b64encode(raw).decode()}


def unpack_tensor(d: dict) -> torch.Tensor:
    """The tensor `pack_tensor` packed, with its own dtype and shape."""
    raw, shape = base64.b64decode(d["b64"]), tuple(d["shape"])
    count = int(np.prod(shape)) if shape else 1
    if d["store"] == "bits":
        a = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=count).astype(bool)
    else:
        a = np.frombuffer(raw, dtype=np.dtype(d["store"]), count=count)
    return torch.from_numpy(a.reshape(shape).copy()).to(getattr(torch, d["tensor"]))


def _packed(value):
    if torch.is_tensor(value):
        return pack_tensor(value)
    if isinstance(value, dict):
        return {k: _packed(v) for k, v in value.items()}
    return value


def _unpacked(value):
    if isinstance(value, dict):
        if "tensor" in value and "b64" in value:
            return unpack_tensor(value)
        return {k: _unpacked(v) for k, v in value.items()}
    return value


@contextmanager
def gc_paused():
    """No cyclic garbage collection while building large acyclic structures (probe lists): in a
    process that already holds many objects, its passes took ~70% of `to_json`'s time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array; bf16/fp16 (no numpy dtype) as float32, which holds them exactly."""
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def _plain(t: torch.Tensor | None):
    """A CPU tensor as nested Python lists, the same values as `t.tolist()` (numpy's tolist is ~3x faster)."""
    return None if t is None else _as_numpy(t).tolist()


def _finite(t: torch.Tensor | None):
    """-inf scores (padding) become None in JSON."""
    if t is None:
        return None
    values = _plain(t)
    bad = ~np.isfinite(t.float().numpy())
    for row in np.flatnonzero(bad.any(-1)).tolist():  # only the rows that have padding
        values[row] = [None if b else v for v, b in zip(values[row], bad[row].tolist())]
    return values


@dataclass
class RunResult:
    tokens: list[str]
    token_ids: list[int]
    image_mask: list[bool]
    layers: dict[int, LayerResult]
    cache_bytes: dict
    kv_bytes_formula: float
    time_s: float
    generated_ids: list[int] = field(default_factory=list)
    generated_text: str = ""
    prefill: str = "full"                # "full" (the reference's) or "ced" (engine/run/ced.py)
    replay: int | None = None            # ced: prompt tokens the decoder ran on
    prefill_s: float = 0.0               # the prefill's share of time_s
    generated_layers: dict[int, LayerResult] = field(default_factory=dict)  # run(generated_probes=True)
    numerics: str = DEFAULT_NUMERICS         # engine/ops: "reference" (the official bf16 flow) or "fp32"
    logits: torch.Tensor | None = None       # run(logits=True): the prompt's logits [T, vocab] fp32, CPU

    def to_json(self, layers=None) -> dict:
        """JSON-able dict; `layers` limits the per-layer probes to those layers (all by default)."""
        keep = self.layers.keys() if layers is None else [L for L in layers if L in self.layers]
        with gc_paused():
            return self._json(keep)

    def _json(self, keep) -> dict:
        return {
            "engine_version": ENGINE_VERSION,
            "tokens": self.tokens, "token_ids": self.token_ids, "image_mask": self.image_mask,
            "layers": {str(k): self.layers[k].to_json() for k in sorted(keep)},
            "cache_bytes": self.cache_bytes, "kv_bytes_formula": self.kv_bytes_formula,
            "time_s": self.time_s,
            "generated_ids": self.generated_ids, "generated_text": self.generated_text,
            "prefill": self.prefill, "replay": self.replay, "prefill_s": self.prefill_s,
            "numerics": self.numerics,
            **({"generated_layers": {str(k): v.to_json() for k, v in sorted(self.generated_layers.items())}}
               if self.generated_layers else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        """The RunResult `to_json` wrote (without logits, which JSON does not carry). A run stored before
        the JSON had "numerics" (added in 75cedda) was computed in the engine's fp32 flow, the only one
        there was: it reads back as "fp32", not as today's default."""
        layers = lambda part: {int(k): LayerResult.from_json(v) for k, v in (d.get(part) or {}).items()}
        return cls(tokens=d["tokens"], token_ids=d["token_ids"], image_mask=d["image_mask"], layers=layers("layers"),
                   cache_bytes=d["cache_bytes"], kv_bytes_formula=d["kv_bytes_formula"], time_s=d["time_s"],
                   generated_ids=d.get("generated_ids", []), generated_text=d.get("generated_text", ""),
                   prefill=d.get("prefill", "full"), replay=d.get("replay"), prefill_s=d.get("prefill_s", 0.0),
                   generated_layers=layers("generated_layers"), numerics=d.get("numerics", STORED_BEFORE_NUMERICS))


def layer_result(cfg, role, probe: dict, kinds: set[str]) -> LayerResult:
    """One layer's probe dict, as the forward filled it (engine/model/transformer.py), as a LayerResult of the asked kinds."""
    out = LayerResult(layer=role.layer, role=role.role, label=role.label, compress_ratio=role.compress_ratio,
                      kv_source=role.kv_source, index_source=role.index_source,
                      window_size=cfg.window_size, n_entries=probe.get("n_entries", 0))
    if "topk" in kinds and "topk" in probe:
        out.topk, out.topk_scores = probe["topk"], probe["topk_scores"]
        out.candidate_pool = probe.get("candidate_pool")
        if out.topk is not None and out.topk_scores is not None:
            out.zero_score_picks = ((out.topk_scores == 0) & (out.topk >= 0)).sum(-1)
        out.runner_ups, out.runner_up_scores = probe.get("runner_ups"), probe.get("runner_up_scores")
        out.selection_recall = probe.get("selection_recall")
        out.topk_kth, out.topk_tied = probe.get("topk_kth"), probe.get("topk_tied")
    if "mhc" in kinds:
        out.mhc = probe["mhc"]
    if "routing" in kinds:
        out.routing = dict(probe["routing"])
    if "norms" in kinds:
        out.residual_norms = probe["residual_norms"]
    if "timing" in kinds:
        out.time_s = probe["time_s"]
    return out
