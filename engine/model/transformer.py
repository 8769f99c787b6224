"""The V4.1-Flash forward: embed -> 4 residual copies -> 40 blocks (Engram, mHC, attention, MoE)
-> collapse -> norm -> head. Weights come from a `WeightSource` (engine/checkpoint/weights.py); probes are a
thin dict per layer, filled only for the layers and kinds asked for.

The DSpark draft stages and the vision tower are counted by the tally but not run here; image
positions can be marked (they route with `bias_vl` and take no part in Engram n-grams).
"""

from __future__ import annotations

import threading
import time

import torch

from ..config import ModelConfig
from ..ops import for_model
from ..roles import decoder_start, role_plan
from .attention import Shared
from .block import Block
from .engram import Engram, EngramLayout
from .graphs import DECODE_ROWS, DecodeGraphs


class Model:
    """A live model over a weight source, with its caches. Not thread-safe: one run at a time."""

    def __init__(self, cfg: ModelConfig, weights, tokenizer=None, act_quant: bool = True, parallel=None,
                 kernels: bool | None = None, numerics: str = "fp32", device="cpu", decode_graphs: bool = True):
        self.cfg, self.weights, self.tokenizer = cfg, weights, tokenizer
        self.parallel = parallel  # engine/serve/parallel.py (several processes); None in one process
        self.act_quant = act_quant
        # engine/ops, chosen once: "reference" (the official bf16 dtype flow; engine.run.api's default) or
        # "fp32" (the default here: training and the float references of the tests run in fp32), on the
        # Triton kernels where `kernels` (None: on CUDA with checkpoint weights) says so
        self.ops = for_model(numerics, kernels, weights, device, parallel, act_quant, cfg.max_seq_len)
        self.numerics = self.ops.name
        self._rounding_memo = threading.local()
        self.plan = role_plan(cfg)[: cfg.n_layers]
        self.quantized_experts = weights.stored_dtype("layers.0.ffn.experts.0.w1.weight") in ("F8_E4M3", "I8") \
            if weights.has("layers.0.ffn.experts.0.w1.weight") else False
        self.engram_layout = EngramLayout.from_config(cfg) if cfg.engram_layer_ids else None
        self.compressed_vocab = None
        self._compressed_on: dict = {}  # its copies on other devices (Engram hashing there)
        # a decode step's cache-free block parts as CUDA graphs (engine/model/graphs.py): one process on a GPU
        self.device = torch.device(device)
        self.decode_graphs = decode_graphs and self.device.type == "cuda" and parallel is None
        self.graphs = None
        self.reset()

    # -- weights --------------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        return self.weights.get(name)

    def linear(self, x: torch.Tensor, base: str | None, narrow: bool = False) -> torch.Tensor:
        """y = x W^T for the weight `base.weight`; activations entering an FP8/FP4 GEMM are
        quantized to E4M3 with an E8M0 scale per 32, as the release's kernels do.
        base None: only that activation rounding (for the routed experts' batched GEMMs). narrow: the
        caller takes a bf16 y of the same values where the ops make one (Fp32Ops.linear)."""
        if base is None:
            return self._rounded(x) if self.act_quant and self.quantized_experts else x.float()
        return self.ops.linear(x, base, self.weights, self.act_quant, self._rounded, narrow=narrow)

    def _rounded(self, x: torch.Tensor) -> torch.Tensor:
        """x as an FP8 GEMM's input sees it. Attention and the MoE feed one activation to two or three GEMMs,
        so the last two inputs are remembered (per thread: engine/run/pipeline.py); the memo holds them, so an
        identical object is the same tensor (the engine never writes into one)."""
        memo = self._rounding_memo.__dict__.setdefault("items", [])
        for seen, rounded in memo:
            if seen is x:
                return rounded
        rounded = self.ops.fp8_roundtrip(x, 32)
        memo.insert(0, (x, rounded))
        del memo[2:]
        return rounded

    def forget_rounding(self) -> None:
        """Drop the remembered FP8 roundings (`_rounded`): a CUDA graph's recording leaves tensors of its own there."""
        self._rounding_memo.__dict__["items"] = []

    # -- state ----------------------------------------------------------------------------------
    def use_ops(self, ops) -> None:
        """Run on other ops from now on (engine/run/parity.py: a capture, or the other path); forgets the caches."""
        self.ops = ops
        self.graphs = None  # recorded on the old ops' kernels (reset starts new ones where they apply)
        self.reset()

    def reset(self) -> None:
        """Forget every cache: the next forward starts at position 0 (recorded graphs stay: they hold no cache)."""
        self.pos = 0
        # (not while ops record a layer's kernel calls for parity: a replay calls no Python)
        if self.decode_graphs and self.graphs is None and getattr(self.ops, "capture_layer", None) is None:
            self.graphs = DecodeGraphs(self.device, forget=self.forget_rounding)
        self.blocks = [Block(self.cfg, role, self.get, self.linear, self.ops, self.parallel,
                             Engram(self.cfg, role.layer, self.engram_layout, self.weights, self.ops, self.act_quant,
                                    self._compressed) if role.engram else None)
                       for role in self.plan]
        self.compressed_history = torch.zeros(0, dtype=torch.long)
        self.dead_history = torch.zeros(0, dtype=torch.bool)

    @property
    def attn(self) -> list:
        """Each layer's attention (its caches)."""
        return [block.attn for block in self.blocks]

    def cache_bytes(self) -> dict:
        """Bytes held by the caches, measured from the cache tensors: global KV + index keys (FP4),
        sliding windows (FP8), and the compressors' pending half-groups (fp32)."""
        glob = sum(a.source.global_nbytes() for a in self.attn if a.source is not None)
        window = sum(a.window.nbytes() for a in self.attn)
        pending = sum(a.source.pending_nbytes() for a in self.attn if a.source is not None)
        return {"global": glob, "window": window, "pending": pending, "total": glob + window + pending}

    # -- forward --------------------------------------------------------------------------------
    def _compressed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.compressed_vocab is None:
            if self.tokenizer is None:
                raise RuntimeError("Engram needs the tokenizer's compressed vocabulary; no tokenizer is loaded")
            lookup, size = self.tokenizer.compressed_vocab()
            if size != self.cfg.engram_compressed_vocab_size:
                raise RuntimeError(f"tokenizer's compressed vocab has {size} ids, config says "
                                   f"engram_compressed_vocab_size={self.cfg.engram_compressed_vocab_size}")
            self.compressed_vocab = torch.tensor(lookup, dtype=torch.long)
        if ids.device != self.compressed_vocab.device:  # hashing on the device (Engram.lookup): a copy there
            table = self._compressed_on.get(ids.device)
            if table is None:
                table = self._compressed_on[ids.device] = self.compressed_vocab.to(ids.device)
            return table[ids]
        return self.compressed_vocab[ids]

    def forward(self, ids: torch.Tensor, image_mask: torch.Tensor | None = None,
                probes: ProbeRequest | None = None, collect: dict | None = None,
                decoder_from: int | None = None) -> torch.Tensor:
        """Run a chunk of token ids [T] at the next positions; returns logits [T, vocab] (fp32).
        `collect` receives per-layer probe dicts for the layers and kinds in `probes`.
        decoder_from (a CED prefill): the decoder runs only from this position on (see run_chunk)."""
        T = ids.shape[0]
        dead = image_mask if image_mask is not None else torch.zeros(T, dtype=torch.bool, device=ids.device)
        logits = self.run_chunk(ids, self.pos, image_mask, (self.compressed_history, self.dead_history),
                                probes, collect, decoder_from=decoder_from)
        self.remember(ids, dead)
        return logits

    def remember(self, ids: torch.Tensor, dead: torch.Tensor) -> None:
        """Advance past a chunk that has run: its positions and (for Engram) its n-gram history."""
        self.compressed_history, self.dead_history = self.history_after(ids, dead)
        self.pos += ids.shape[0]

    def history_after(self, ids: torch.Tensor, dead: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Engram's n-gram history (compressed ids, dead flags) once these tokens follow what ran."""
        if self.engram_layout is None or self.tokenizer is None:
            return self.compressed_history, self.dead_history
        return (torch.cat([self.compressed_history, self._compressed(ids.cpu())]),
                torch.cat([self.dead_history, dead.cpu()]))

    def run_chunk(self, ids: torch.Tensor, start: int, image_mask: torch.Tensor | None,
                  history: tuple[torch.Tensor, torch.Tensor], probes: ProbeRequest | None = None,
                  collect: dict | None = None, gate=None, decoder_from: int | None = None) -> torch.Tensor:
        """Token ids [T] at positions start.., after the tokens in `history` (compressed ids, dead
        flags); reads and extends the layers' caches but not `pos` or the history (`remember`).
        gate (engine/run/pipeline.py): waits before each layer and signals once its attention (the
        only part that reads or writes caches) is done, so chunks that run at once on several
        threads meet every layer's caches in position order.
        decoder_from (a CED prefill, engine/run/ced.py): positions before it run only the encoder and the
        decoder's first layer's compressor (its global KV and index keys); the decoder's blocks run
        from there on, and the logits are those rows' [max(0, T - skipped), vocab]."""
        cfg = self.cfg
        T = ids.shape[0]
        dev = ids.device
        positions = torch.arange(start, start + T, device=dev)
        image_mask = image_mask if image_mask is not None and bool(image_mask.any()) else None
        dead = image_mask if image_mask is not None else torch.zeros(T, dtype=torch.bool, device=dev)
        embed = self.get("embed.weight")
        h = embed[ids].float() if self.parallel is None else self.parallel.embed(embed, ids)  # vocab-split rows
        h = self.ops.act(h)
        x = h.unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # [T, hc, dim]
        pre = torch.zeros(T, cfg.hc_mult, device=dev)
        pre[:, 0] = 1.0  # the first collapse reads copy 0
        shared = Shared()
        skip = 0 if decoder_from is None else min(T, max(0, decoder_from - start))
        split = decoder_start(cfg) if skip else None
        for role in self.plan:
            L = role.layer
            if gate is not None:
                gate.wait(L)
            want = probes is not None and probes.wants(L)
            started = time.perf_counter()
            if L == split:
                x, pre, positions, ids, dead, image_mask, history = self._enter_decoder(
                    L, skip, x, pre, positions, ids, dead, image_mask, history)
            if x.shape[0] == 0:  # a CED chunk wholly before the replay: no decoder rows
                if gate is not None:
                    gate.done(L)
                continue
            probe: dict | None = {} if want else None
            block = self.blocks[L]
            block.attn.detail = want and L in probes.detail
            x, pre = block.forward(x, pre, positions, shared, (ids, dead, history), image_mask, probe,
                                   after_attention=None if gate is None else lambda L=L: gate.done(L),
                                   pieces=self.graphs if T <= DECODE_ROWS and gate is None else None)
            if want:
                probe["time_s"] = time.perf_counter() - started
                probe["residual_norms"] = x.detach().float().norm(dim=-1)  # float32 where the ops store bf16
                collect[L] = probe
        y = self.ops.rms_norm(self.ops.collapse(x, pre), self.get("norm.weight"), cfg.norm_eps)
        logits = y @ self.get("head.weight").float().t()
        return logits if self.parallel is None else self.parallel.gather_last(logits)  # vocab-split head

    def _enter_decoder(self, L, skip, x, pre, positions, ids, dead, image_mask, history):
        """CED prefill at the decoder's first layer L: its compressor publishes global KV and index
        keys for the first `skip` rows from the encoder's output (what the decoder's global branch
        reads), and only the rows after them go on; the decoder's windows fill from those rows."""
        attn_in = self.ops.rms_norm(self.ops.collapse(x[:skip], pre[:skip]),
                                    self.get(f"layers.{L}.attn_norm.weight"), self.cfg.norm_eps)
        self.blocks[L].attn.publish(attn_in, positions[:skip])
        if self.engram_layout is not None and self.tokenizer is not None:  # n-grams of the skipped tokens
            history = (torch.cat([history[0], self._compressed(ids[:skip].cpu())]),
                       torch.cat([history[1], dead[:skip].cpu()]))
        image_mask = None if image_mask is None else image_mask[skip:]
        return x[skip:], pre[skip:], positions[skip:], ids[skip:], dead[skip:], image_mask, history
