"""The engine's public face: `load(path) -> Engine`, `engine.run(prompt, ...) -> RunResult`.

Used by the CLI and the explorer; neither touches model internals.
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import hashlib
import os
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, ModelConfig, load_config
from . import ced, pipeline
from .ops import DEFAULT_NUMERICS, NUMERICS
from .model import PROBE_KINDS, Model, ProbeRequest
from .roles import decoder_start, role_plan

ENGINE_VERSION = "0.1.0"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO_ROOT / "assets" / "model"


@contextmanager
def one_thread():
    """Run torch on one intra-op thread. The engine's ops are many and small: with two threads on a
    shared 2-core machine, OpenMP barriers made a 2,048-token prefill 15x slower under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class EngineError(ValueError):
    """Bad input to the engine (prompt, layer, checkpoint); the message says what and why."""


def _token_ids(prompt) -> list[int]:
    """Token ids given by a caller: whole numbers only (True or 1.5 is a mistake, not an id)."""
    if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise EngineError(f"the prompt must be text or a list of token ids, got {type(prompt).__name__}")
    ids = prompt.tolist() if isinstance(prompt, (torch.Tensor, np.ndarray)) else list(prompt)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise EngineError(f"token id {i!r} is not a whole number ({type(i).__name__})")
    return [int(i) for i in ids]


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
    # on request (run(detail_layers=...)): engine/selection_probe.py
    runner_ups: torch.Tensor | None = None        # [T, r] best unselected entries, -1 padded
    runner_up_scores: torch.Tensor | None = None  # [T, r] their index scores (-inf padding)
    selection_recall: torch.Tensor | None = None  # [T] attention mass on the picks over all visible entries
    # ties (engine/attention.py tie_marks): which picks a top-k took by chance among equal scores
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
    prefill: str = "full"                # "full" (the reference's) or "ced" (engine/ced.py)
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


def global_kv_bytes(cfg: ModelConfig, n_tokens: int) -> int:
    """Bytes of global KV + index keys for a prompt of n_tokens (the formula, per source layer:
    floor(n/m) entries x (head_dim/2 + head_dim/16 + index_head_dim/2 + index_head_dim/32))."""
    entry = cfg.head_dim // 2 + cfg.head_dim // 16 + cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    return sum((n_tokens // cfg.compress_ratios[L]) * entry for L in cfg.kv_source_layers)


class Engine:
    """A loaded model plus its tokenizer; `run` is serialized with a lock (one run at a time)."""

    def __init__(self, cfg: ModelConfig, weights, tokenizer=None, source: str = "", identity: str = "",
                 act_quant: bool = True, parallel=None, device: str | torch.device = "cpu",
                 kernels: bool | None = None, threads: int | None = None, numerics: str | None = None):
        self.cfg, self.tokenizer, self.source, self.identity = cfg, tokenizer, source, identity
        if (numerics or DEFAULT_NUMERICS) not in NUMERICS:
            raise EngineError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
        self.numerics = numerics or DEFAULT_NUMERICS  # engine/ops: the default is the reference's dtype flow
        # CPU threads for a prefill: 2 runs the prompt as two chunks in a wavefront (engine/pipeline.py);
        # every op itself stays on one torch thread (see one_thread)
        self.threads = threads if threads is not None else min(2, os.cpu_count() or 1)
        if self.threads not in (1, 2):
            raise EngineError(f"threads must be 1 or 2, got {self.threads}")
        self.parallel = parallel  # engine/parallel.py when this is one rank of several processes
        self.device = torch.device(device) if parallel is None else parallel.device
        # kernels: None = the Triton kernels on CUDA with checkpoint weights (engine/ops/triton.py)
        self.model = Model(cfg, weights, tokenizer, act_quant=act_quant, parallel=parallel, kernels=kernels,
                           numerics=self.numerics, device=self.device)
        self.plan = role_plan(cfg)
        self.lock = threading.Lock()

    # -- input ----------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EngineError("the prompt is empty")
            if self.tokenizer is None:
                raise EngineError("this checkpoint has no tokenizer.json: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt, add_bos=True)
        else:
            ids = _token_ids(prompt)
            if not ids:
                raise EngineError("the prompt is empty (no token ids)")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        if len(ids) > self.cfg.max_seq_len:
            raise EngineError(f"the prompt has {len(ids)} tokens; this model accepts at most "
                              f"{self.cfg.max_seq_len} (max_seq_len)")
        return ids

    def token_strings(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [str(i) for i in ids]
        return self.tokenizer.token_strings(ids)

    def check_layers(self, layers) -> set[int] | None:
        if layers is None:
            return None
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
            raise EngineError(f"layers must be a list of layer numbers, got {type(layers).__name__}")
        out = set()
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise EngineError(f"layer {layer!r} is not a layer number (a whole number, not {type(layer).__name__})")
            if not 0 <= layer < self.cfg.n_layers:
                raise EngineError(f"layer {layer} does not exist (this model has layers 0..{self.cfg.n_layers - 1})")
            out.add(layer)
        return out

    # -- runs -----------------------------------------------------------------------------------
    def run(self, prompt: str | list[int], layers=None, probes=PROBE_KINDS,
            image_spans: list[tuple[int, int]] = (), generate: int = 0, detail_layers=(),
            prefill: str = "full", replay: int | None = None, generated_probes: bool = False,
            continuation: list[int] | None = None, logits: bool = False) -> RunResult:
        """Prefill the prompt (probes on the asked layers), then greedily generate `generate` tokens.
        detail_layers: layers (among those probed, with the topk probe) that also record the indexer's
        runner-ups and the selection recall (a pass over every visible entry: ask for the clicked one).
        prefill: "full" (every layer over the prompt, as the reference) or "ced" (engine/ced.py: the
        decoder over only the last `replay` prompt tokens, default the window size).
        generated_probes: also probe the asked layers at the generated tokens (`generated_layers`).
        continuation: token ids fed after the prompt instead of the greedy picks (teacher-forced;
        `generated_ids` are still the greedy picks at each step).
        logits: keep the prompt's logits [T, vocab] in the result (parity checks)."""
        want_logits = logits
        ids = self.encode(prompt)
        try:
            replay = ced.check(self.cfg, prefill, replay)
        except ced.PrefillError as err:
            raise EngineError(str(err)) from None
        if continuation is not None:
            continuation = self.encode(list(continuation)) if len(continuation) else []
            if generate not in (0, len(continuation)):
                raise EngineError(f"generate={generate} but the continuation has {len(continuation)} tokens")
            generate = len(continuation)
        if isinstance(generate, bool) or not isinstance(generate, int) or generate < 0:
            raise EngineError(f"generate must be a whole number of tokens >= 0, got {generate!r}")
        if len(ids) + generate > self.cfg.max_seq_len:
            raise EngineError(f"the prompt has {len(ids)} tokens and {generate} more would run past max_seq_len "
                              f"({self.cfg.max_seq_len}); generate at most {self.cfg.max_seq_len - len(ids)}")
        wanted = self.check_layers(layers)
        detail = self.check_layers(() if detail_layers is None else detail_layers) or set()
        if detail and (wanted is not None and not detail <= wanted or "topk" not in probes):
            raise EngineError(f"detail layers {sorted(detail)} need the topk probe on those layers")
        if isinstance(probes, str) or not all(isinstance(k, str) for k in probes):
            raise EngineError(f"probes must be a list of probe kinds from {list(PROBE_KINDS)}")
        unknown = set(probes) - set(PROBE_KINDS)
        if unknown:
            raise EngineError(f"unknown probe kinds {sorted(unknown)}; known: {list(PROBE_KINDS)}")
        mask = torch.zeros(len(ids), dtype=torch.bool, device=self.device)
        for span in image_spans:
            if not (isinstance(span, (tuple, list)) and len(span) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in span)):
                raise EngineError(f"an image span must be a (start, end) pair of whole numbers, got {span!r}")
            start, end = span
            if not 0 <= start < end <= len(ids):
                raise EngineError(f"image span {start}..{end} is outside the prompt (0..{len(ids)})")
            mask[start:end] = True
        request = ProbeRequest(layers=wanted, kinds=set(probes), detail=detail)
        collect: dict = {}
        with self.lock, one_thread(), torch.inference_mode():
            started = time.perf_counter()
            self.model.reset()
            prompt_ids = torch.tensor(ids, device=self.device)
            start_decoder = ced.decoder_from(len(ids), replay)
            if self.threads > 1 and pipeline.usable(self.model, prompt_ids):
                logits = pipeline.prefill(self.model, prompt_ids, mask, request, collect, decoder_from=start_decoder)
            else:
                logits = self.model.forward(prompt_ids, image_mask=mask, probes=request, collect=collect,
                                            decoder_from=start_decoder)
            _sync(self.device)
            prefill_s = time.perf_counter() - started
            prompt_logits = logits.float().cpu() if want_logits else None
            cache = self.model.cache_bytes()
            eos = self.tokenizer.eos_id if self.tokenizer is not None else None
            generated, at_generated = ced.decode(
                self.model, logits, generate, self.device, eos, continuation,
                ProbeRequest(layers=wanted, kinds=set(probes)) if generated_probes else None)
            _sync(self.device)
            elapsed = time.perf_counter() - started
        results = {L: self._layer_result(L, _to_cpu(probe), set(probes)) for L, probe in collect.items()}
        if start_decoder is not None:  # the decoder's probes start at the replay
            for L, lr in results.items():
                lr.first_position = start_decoder if L >= decoder_start(self.cfg) else 0
        at_generated = {L: self._layer_result(L, _to_cpu(probe), set(probes)) for L, probe in at_generated.items()}
        for lr in at_generated.values():
            lr.first_position = len(ids)
        return RunResult(
            tokens=self.token_strings(ids), token_ids=ids, image_mask=mask.cpu().tolist(), layers=results,
            cache_bytes=cache, kv_bytes_formula=global_kv_bytes(self.cfg, len(ids)), time_s=elapsed,
            generated_ids=generated,
            generated_text=self.tokenizer.decode(generated) if self.tokenizer is not None and generated else "",
            prefill=prefill, replay=replay, prefill_s=prefill_s, generated_layers=at_generated,
            numerics=self.numerics, logits=prompt_logits)

    def _layer_result(self, layer: int, probe: dict, kinds: set[str]) -> LayerResult:
        role = self.plan[layer]
        out = LayerResult(layer=layer, role=role.role, label=role.label, compress_ratio=role.compress_ratio,
                          kv_source=role.kv_source, index_source=role.index_source,
                          window_size=self.cfg.window_size, n_entries=probe.get("n_entries", 0))
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


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a time measured after it is the work's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to_cpu(probe):
    """Probe tensors as CPU tensors (a rank's probes live on its GPU)."""
    if torch.is_tensor(probe):
        return probe.cpu()
    if isinstance(probe, dict):
        return {k: _to_cpu(v) for k, v in probe.items()}
    return probe


def checkpoint_identity(path: Path) -> str:
    """A short hash of the config and the shard index (headers), naming this checkpoint."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        f = path / name
        if f.exists():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def load(path: str | Path | None = None, cache_bytes: int = 2 << 30, act_quant: bool = True,
         parallel=None, device: str = "cpu", kernels: bool | None = None, threads: int | None = None,
         numerics: str | None = None) -> Engine:
    """Open a release-layout checkpoint lazily (default: the shipped small model in assets/model).
    parallel (engine/parallel.py): this process is one rank; it reads only its shard of the weights.
    device: where one process computes (weights are dequantized once and kept there);
    kernels: the Triton kernel ops (None: on CUDA; see engine/ops/triton.py);
    threads: CPU threads for a prefill, 1 or 2 (default: 2 where the machine has them);
    numerics (engine/ops): "reference" (default: the official bf16 dtype flow) or "fp32"."""
    from .checkpoint import CheckpointError, CheckpointReader
    from .weights import CheckpointWeights, DeviceWeights

    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise EngineError(f"the checkpoint must be a folder path, got {type(path).__name__}")
    path = Path(path) if path is not None else DEFAULT_CHECKPOINT
    if not path.exists():
        raise EngineError(f"{path}: no such checkpoint folder")
    if not path.is_dir():
        raise EngineError(f"{path}: not a folder (a checkpoint is a folder with config.json and shards)")
    try:
        cfg = load_config(path)
        reader = CheckpointReader(path, cfg)
    except (ConfigError, CheckpointError) as err:
        raise EngineError(str(err)) from None
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from .tokenizer import TokenizerError, load_tokenizer
        try:
            tokenizer = load_tokenizer(path / "tokenizer.json")
        except TokenizerError as err:
            raise EngineError(str(err)) from None
    weights = CheckpointWeights(reader, cache_bytes)
    if parallel is not None:
        from .parallel import ParallelError, ShardedWeights
        try:
            weights = ShardedWeights(weights, parallel, cfg, cache_bytes)
        except ParallelError as err:
            raise EngineError(str(err)) from None
    elif torch.device(device).type != "cpu":
        weights = DeviceWeights(weights, device)
    return Engine(cfg, weights, tokenizer, source=str(path), identity=checkpoint_identity(path),
                  act_quant=act_quant, parallel=parallel, device=device, kernels=kernels, threads=threads,
                  numerics=numerics)


def save_result(result: RunResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json()))
