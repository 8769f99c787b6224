"""The engine's public face: `load(path) -> Engine`, `engine.run(prompt, ...) -> RunResult` (engine/run/probes.py).

Used by the CLI and the explorer; neither touches model internals.
"""

from __future__ import annotations

import hashlib
import os
import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, ModelConfig, load_config
from . import ced, pipeline
from ..ops import DEFAULT_NUMERICS, NUMERICS
from ..model.transformer import Model
from ..roles import decoder_start, role_plan
from .common import DEFAULT_CHECKPOINT, REPO_ROOT, EngineError  # noqa: F401 (API names)
from .probes import ENGINE_VERSION, PROBE_KINDS, LayerResult, ProbeRequest, RunResult, layer_result  # noqa: F401 (API names)


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


def _token_ids(prompt) -> list[int]:
    """Token ids given by a caller: whole numbers only (True or 1.5 is a mistake, not an id)."""
    if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise EngineError(f"the prompt must be text or a list of token ids, got {type(prompt).__name__}")
    ids = prompt.tolist() if isinstance(prompt, (torch.Tensor, np.ndarray)) else list(prompt)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise EngineError(f"token id {i!r} is not a whole number ({type(i).__name__})")
    return [int(i) for i in ids]


def global_kv_bytes(cfg: ModelConfig, n_tokens: int) -> int:
    """Bytes of global KV + index keys for a prompt of n_tokens (the formula, per source layer:
    floor(n/m) entries x (head_dim/2 + head_dim/16 + index_head_dim/2 + index_head_dim/32))."""
    entry = cfg.head_dim // 2 + cfg.head_dim // 16 + cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    return sum((n_tokens // cfg.compress_ratios[L]) * entry for L in cfg.kv_source_layers)


class Engine:
    """A loaded model plus its tokenizer; `run` is serialized with a lock (one run at a time)."""

    def __init__(self, cfg: ModelConfig, weights, tokenizer=None, source: str = "", identity: str = "",
                 act_quant: bool = True, parallel=None, device: str | torch.device = "cpu",
                 kernels: bool | None = None, threads: int | None = None, numerics: str | None = None,
                 decode_graphs: bool = True):
        self.cfg, self.tokenizer, self.source, self.identity = cfg, tokenizer, source, identity
        if (numerics or DEFAULT_NUMERICS) not in NUMERICS:
            raise EngineError(f"unknown numerics {numerics!r}; choose one of {', '.join(NUMERICS)}")
        self.numerics = numerics or DEFAULT_NUMERICS  # engine/ops: the default is the reference's dtype flow
        # CPU threads for a prefill: 2 runs the prompt as two chunks in a wavefront (engine/run/pipeline.py);
        # every op itself stays on one torch thread (see one_thread)
        self.threads = threads if threads is not None else min(2, os.cpu_count() or 1)
        if self.threads not in (1, 2):
            raise EngineError(f"threads must be 1 or 2, got {self.threads}")
        if not isinstance(decode_graphs, bool):
            raise EngineError(f"decode_graphs must be True or False, got {decode_graphs!r}")
        self.parallel = parallel  # engine/serve/parallel.py when this is one rank of several processes
        self.device = torch.device(device) if parallel is None else parallel.device
        # kernels: None = the Triton kernels on CUDA with checkpoint weights (engine/ops/triton.py);
        # decode_graphs: a decode step's cache-free block parts replayed as CUDA graphs (one process on a GPU)
        self.model = Model(cfg, weights, tokenizer, act_quant=act_quant, parallel=parallel, kernels=kernels,
                           numerics=self.numerics, device=self.device, decode_graphs=decode_graphs)
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
        prefill: "full" (every layer over the prompt, as the reference) or "ced" (engine/run/ced.py: the
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
            # still on one thread: the results' small ops would otherwise wait on a busy second core
            results = {L: layer_result(self.cfg, self.plan[L], _to_cpu(probe), set(probes))
                       for L, probe in collect.items()}
            at_generated = {L: layer_result(self.cfg, self.plan[L], _to_cpu(probe), set(probes))
                            for L, probe in at_generated.items()}
        if start_decoder is not None:  # the decoder's probes start at the replay
            for L, lr in results.items():
                lr.first_position = start_decoder if L >= decoder_start(self.cfg) else 0
        for lr in at_generated.values():
            lr.first_position = len(ids)
        return RunResult(
            tokens=self.token_strings(ids), token_ids=ids, image_mask=mask.cpu().tolist(), layers=results,
            cache_bytes=cache, kv_bytes_formula=global_kv_bytes(self.cfg, len(ids)), time_s=elapsed,
            generated_ids=generated,
            generated_text=self.tokenizer.decode(generated) if self.tokenizer is not None and generated else "",
            prefill=prefill, replay=replay, prefill_s=prefill_s, generated_layers=at_generated,
            numerics=self.numerics, logits=prompt_logits)

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
         numerics: str | None = None, decode_graphs: bool = True) -> Engine:
    """Open a release-layout checkpoint lazily (default: the shipped small model in assets/model).
    parallel (engine/serve/parallel.py): this process is one rank; it reads only its shard of the weights.
    device: where one process computes. The weight source follows the ops the engine will run:
    - the Triton kernel ops (`kernels`, resolved as the model resolves it: engine/ops/triton.py `decide`):
      engine/ops/stored.py StoredWeights, the stored formats on `device` (E4M3 + scales, packed FP4
      experts, BF16/F32 widened), FP8/FP4 weights dequantized per call only: no fp32 copies; on the
      CPU too (the Triton interpreter, or the kernels' references, run the same path);
    - the CPU ops on another device: DeviceWeights (every weight dequantized once and kept there);
    - the CPU ops on the CPU: the lazy CheckpointWeights (a byte-bounded cache of `cache_bytes`);
    - parallel: ShardedWeights, each rank's shard; in the stored formats when the kernel ops run (the
      same rule, on the rank's device), else dequantized and cached;
    kernels: the Triton kernel ops (None: on CUDA; see engine/ops/triton.py);
    threads: CPU threads for a prefill, 1 or 2 (default: 2 where the machine has them);
    numerics (engine/ops): "reference" (default: the official bf16 dtype flow) or "fp32";
    decode_graphs: on a GPU in one process, a decode step's block parts without caches replayed as CUDA graphs
    (engine/model/graphs.py; the same outputs, fewer launches)."""
    from ..checkpoint.inventory import CheckpointError
    from ..checkpoint.reader import CheckpointReader
    from ..checkpoint.weights import CheckpointWeights, DeviceWeights
    from ..ops.triton import decide  # (imports neither triton nor the kernels)

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
        from ..tokenizer import TokenizerError, load_tokenizer
        try:
            tokenizer = load_tokenizer(path / "tokenizer.json")
        except TokenizerError as err:
            raise EngineError(str(err)) from None
    weights = CheckpointWeights(reader, cache_bytes)
    if parallel is not None:  # one rank of several: its shard (in the stored formats for the kernel ops)
        from ..serve.parallel import ParallelError, ShardedWeights
        try:
            weights = ShardedWeights(weights, parallel, cfg, cache_bytes)
        except ParallelError as err:
            raise EngineError(str(err)) from None
        weights.stored_formats = decide(kernels, weights, parallel.device, parallel)
    elif decide(kernels, weights, device):  # the model's own rule for the kernel ops (for_model asks it too)
        from ..ops.stored import StoredWeights
        weights = StoredWeights(weights, device)
    elif torch.device(device).type != "cpu":
        weights = DeviceWeights(weights, device)
    return Engine(cfg, weights, tokenizer, source=str(path), identity=checkpoint_identity(path),
                  act_quant=act_quant, parallel=parallel, device=device, kernels=kernels, threads=threads,
                  numerics=numerics, decode_graphs=decode_graphs)


def save_result(result: RunResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json()))
