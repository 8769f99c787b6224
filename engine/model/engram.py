"""Engram: hashed n-gram memory added to the residual stream before layers 1 and 14.

Numerics follow the release's reference (inference/engram.py and the Engram module of model.py),
restated here in our own code:

Hashing (per Engram layer, per position t):
- token ids go through the compressed vocabulary (engine/tokenizer.py); a dead position (image span)
  is marked DEAD;
- the look-back ids c[t], c[t-1], ..., c[t-N+1] (N = engram_max_ngram_size) are taken in that order;
  once the look-back meets the sequence start or a DEAD position, that slot and all older ones read
  the compressed pad id instead (a dead position at t itself pads every slot);
- with per-layer odd multipliers m[0..N-1], h_1 = c[t] m[0], h_k = h_{k-1} XOR c[t-k+1] m[k-1];
  the n-gram (n = 2..N) of head j lands in row offset[n, j] + h_n mod prime[n, j].
- primes: for each layer, each n, each head in that order, the smallest prime above the previous one
  (starting above engram_vocab_size - 1 for every new n) that no earlier slot took; offsets are the
  running sum of the layer's primes in (n, head) order, so a layer's table has sum(primes) rows.
- multipliers: numpy default_rng(10007 * layer_id).integers(0, B, N, int64) * 2 + 1 with
  B = max(1, (2**63 - 1) // engram_compressed_vocab_size // 2), so c * m never overflows int64.

Mixing (engram_forward): rows [T, R, head_dim] flatten to R*head_dim, wkv maps them to hc keys of `dim`
and one shared value of `dim`. For copy c: dot = sum(x_c * q_weight_c * k_weight_c * key_c)
* rsqrt(mean(x_c^2) + eps) * rsqrt(mean(key_c^2) + eps) / sqrt(dim); gate = sigmoid(sign(dot) *
sqrt(max(|dot|, 1e-6))); x_c += gate * value. Positions outside token_mask get gate 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..capture import capturing

DEAD = -1  # marks a position that takes no part in any n-gram (image span)
GATE_CLAMP = 1e-6  # |dot| floor before the signed square root
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic below 3.3e24


class EngramError(ValueError):
    """Bad Engram configuration or input."""


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every n < 3.3e24 (so for all 64-bit n)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        y = pow(a, d, n)
        if y in (1, n - 1):
            continue
        for _ in range(r - 1):
            y = y * y % n
            if y == n - 1:
                break
        else:
            return False
    return True


def next_unused_prime(after: int, used: set[int]) -> int:
    """Smallest prime > after that is not in `used`."""
    candidate = after + 1
    while candidate in used or not is_prime(candidate):
        candidate += 1
    return candidate


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> tuple[int, ...]:
    """The odd per-look-back multipliers of one Engram layer (release RNG recipe)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in draws)


@dataclass(frozen=True)
class EngramLayout:
    """Everything needed to turn compressed ids into table rows, for all Engram layers.

    primes[i][n-2][j]: modulus of n-gram n, head j, in Engram layer i (i indexes layer_ids);
    offsets[i][col], col = (n-2) * n_heads + j: first row of that range; multipliers[i][k]: look-back k.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    num_embeddings: tuple[int, ...]
    compressed_vocab_size: int
    pad_id: int  # compressed id used for missing look-back slots
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @property
    def n_cols(self) -> int:
        """Rows fetched per token per layer: (max_ngram_size - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def rows_needed(self) -> tuple[int, ...]:
        """Table rows each layer's prime ranges span (sum of its primes)."""
        return tuple(sum(p for per_n in layer for p in per_n) for layer in self.primes)

    def index_of(self, layer_id: int) -> int:
        """Position of a model layer id in layer_ids (the `layer_index` of ngram_rows)."""
        if layer_id not in self.layer_ids:
            raise EngramError(f"layer {layer_id} has no Engram (engram_layer_ids = {list(self.layer_ids)})")
        return self.layer_ids.index(layer_id)

    @classmethod
    def from_config(cls, cfg, compressed_pad_id: int | None = None) -> "EngramLayout":
        """Build from any object with the flat inference-config engram_* fields.

        compressed_pad_id: the compressed id of engram_pad_id; defaults to engram_pad_id itself, which
        is right whenever ids 0..pad are distinct specials (the release tokenizer and ours).
        """
        layer_ids = tuple(int(i) for i in cfg.engram_layer_ids)
        if not layer_ids:
            raise EngramError("engram_layer_ids is empty: this model has no Engram")
        num_embeddings = tuple(int(n) for n in cfg.engram_num_embeddings)
        if len(num_embeddings) != len(layer_ids):
            raise EngramError(
                f"engram_num_embeddings has {len(num_embeddings)} entries for {len(layer_ids)} Engram layers"
            )
        max_n, n_heads = int(cfg.engram_max_ngram_size), int(cfg.engram_n_heads)
        vocab, cvocab = int(cfg.engram_vocab_size), int(cfg.engram_compressed_vocab_size)
        if max_n < 2 or n_heads < 1 or vocab < 2 or cvocab < 1:
            raise EngramError(
                f"need engram_max_ngram_size >= 2, engram_n_heads >= 1, engram_vocab_size >= 2 and "
                f"engram_compressed_vocab_size >= 1 (got {max_n}, {n_heads}, {vocab}, {cvocab})"
            )
        pad = int(cfg.engram_pad_id if compressed_pad_id is None else compressed_pad_id)
        if not 0 <= pad < cvocab:
            raise EngramError(f"compressed pad id {pad} is outside the compressed vocab [0, {cvocab})")

        used: set[int] = set()
        primes = []
        for _ in layer_ids:
            per_layer = []
            for _ in range(max_n - 1):
                current, per_n = vocab - 1, []
                for _ in range(n_heads):
                    current = next_unused_prime(current, used)
                    used.add(current)
                    per_n.append(current)
                per_layer.append(tuple(per_n))
            primes.append(tuple(per_layer))

        offsets = []
        for i, layer in enumerate(primes):
            flat = [p for per_n in layer for p in per_n]
            starts = [sum(flat[:k]) for k in range(len(flat))]
            if starts[-1] + flat[-1] > num_embeddings[i]:
                raise EngramError(
                    f"Engram layer {layer_ids[i]} needs {starts[-1] + flat[-1]} table rows but "
                    f"engram_num_embeddings gives {num_embeddings[i]}"
                )
            offsets.append(tuple(starts))

        return cls(
            layer_ids=layer_ids,
            max_ngram_size=max_n,
            n_heads=n_heads,
            head_dim=int(cfg.engram_head_dim),
            num_embeddings=num_embeddings,
            compressed_vocab_size=cvocab,
            pad_id=pad,
            primes=tuple(primes),
            offsets=tuple(offsets),
            multipliers=tuple(hash_multipliers(lid, max_n, cvocab) for lid in layer_ids),
        )


def compress_ids(token_ids: torch.Tensor, lookup: torch.Tensor | list[int]) -> torch.Tensor:
    """Token ids -> compressed ids through the tokenizer's compressed_vocab() lookup."""
    lookup = torch.as_tensor(lookup, dtype=torch.long)
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= lookup.numel()):
        raise EngramError(f"token ids must lie in [0, {lookup.numel()})")
    return lookup[token_ids]


def mark_dead(compressed_ids: torch.Tensor, dead_mask: torch.Tensor | None) -> torch.Tensor:
    """Compressed ids with DEAD (-1) at dead positions: the form `history` takes."""
    ids = torch.as_tensor(compressed_ids, dtype=torch.long)
    if dead_mask is None:
        return ids.clone()
    dead_mask = torch.as_tensor(dead_mask, dtype=torch.bool)
    if dead_mask.shape != ids.shape:
        raise EngramError(f"dead_mask shape {tuple(dead_mask.shape)} != ids shape {tuple(ids.shape)}")
    return torch.where(dead_mask, torch.full_like(ids, DEAD), ids)


_ON_DEVICE: dict = {}  # (primes, offsets, device) -> their tensors there (a copy to a GPU is not capturable)


def _hash_constants(layout: "EngramLayout", layer_index: int, dev: torch.device):
    """A layer's moduli per n-gram size ([n_heads] each) and row offsets as int64 tensors on `dev`; made
    on the CPU per call, kept per device elsewhere (made by the first call, before any graph capture)."""
    primes, offsets = layout.primes[layer_index], layout.offsets[layer_index]
    key = (primes, offsets, dev)
    hit = _ON_DEVICE.get(key) if dev.type != "cpu" else None
    if hit is None:
        hit = ([torch.tensor(p, dtype=torch.long, device=dev) for p in primes],
               torch.tensor(offsets, dtype=torch.long, device=dev))
        if dev.type != "cpu":
            _ON_DEVICE[key] = hit
    return hit


def ngram_rows(
    layout: EngramLayout,
    layer_index: int,
    compressed_ids: torch.Tensor,
    dead_mask: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absolute table rows for each position: LongTensor [T, (max_ngram_size - 1) * n_heads].

    layer_index: index into layout.layer_ids (0 for the first Engram layer), not the model layer id.
    compressed_ids: LongTensor [T] in [0, compressed_vocab_size).
    dead_mask: BoolTensor [T], True where the position takes no part in any n-gram.
    history: the positions before these, oldest first, as `mark_dead` returns them; give at least the
    last max_ngram_size - 1 of them (or all, if fewer exist). None means the sequence starts here.
    Column order: n-gram size 2..N outer, head inner.
    """
    if not 0 <= layer_index < len(layout.layer_ids):
        raise EngramError(f"layer_index {layer_index} outside 0..{len(layout.layer_ids) - 1}")
    ids = torch.as_tensor(compressed_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise EngramError(f"compressed_ids must be 1-D [T], got shape {tuple(ids.shape)}")
    # integer work on the ids' device; the range checks read values back, so a graph capture skips them
    checked = not capturing()
    if checked and ids.numel() and (ids.min() < 0 or ids.max() >= layout.compressed_vocab_size):
        raise EngramError(f"compressed ids must lie in [0, {layout.compressed_vocab_size})")
    dev = ids.device
    current = mark_dead(ids, dead_mask)
    lookback = layout.max_ngram_size - 1
    if history is None:
        past = current.new_empty(0)
    else:
        past = torch.as_tensor(history, dtype=torch.long).reshape(-1)[-lookback:] if lookback else current[:0]
        past = past.to(dev)
        if checked and past.numel() and (past.min() < DEAD or past.max() >= layout.compressed_vocab_size):
            raise EngramError(f"history ids must be DEAD (-1) or lie in [0, {layout.compressed_vocab_size})")
    seq = torch.cat([past, current])  # [P + T]
    n_past, n_tok = past.numel(), current.numel()
    positions = torch.arange(n_past, n_past + n_tok, device=dev)  # [T], indices into seq

    multipliers = layout.multipliers[layer_index]
    primes, offsets = _hash_constants(layout, layer_index, dev)
    blocked = torch.zeros(n_tok, dtype=torch.bool, device=dev)
    rolling = None
    columns = []
    for shift in range(layout.max_ngram_size):
        source_pos = positions - shift
        source = seq[source_pos.clamp_min(0)]
        blocked = blocked | (source_pos < 0) | (source == DEAD)
        token = torch.where(blocked, torch.full_like(source, layout.pad_id), source)
        product = token * multipliers[shift]
        rolling = product if rolling is None else torch.bitwise_xor(rolling, product)
        if shift == 0:
            continue
        columns.append(rolling.unsqueeze(-1) % primes[shift - 1])  # [T, n_heads]
    rows = torch.cat(columns, dim=-1) + offsets
    return rows  # [T, n_cols]


def _as_computed(x: torch.Tensor) -> torch.Tensor:
    return x


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


def engram_forward(
    x: torch.Tensor,
    rows_embed: torch.Tensor,
    wkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    token_mask: torch.Tensor | None = None,
    act=_as_computed,
    gemm=_matmul,
    mix=None,
) -> torch.Tensor:
    """The stream after Engram: x + gate * value per copy, same shape and dtype as x.

    x: [T, hc, dim]; rows_embed: [T, n_rows, head_dim] (dequantized table rows, ngram_rows order);
    wkv: [(hc + 1) * dim, n_rows * head_dim] (keys of copies 0..hc-1, then the value), or a function
    that fetches it: then gemm(flat, wkv) gets the function and fetches the value only if it needs it
    (the kernel ops run the stored FP8 bytes instead of a fresh 0.6 GB float copy each step);
    q_weight, k_weight: [hc, dim]; token_mask: optional BoolTensor [T], False = leave untouched.
    Computed in float32 (float64 if x is float64). act (engine/ops): how the wkv GEMM's output is
    stored (bf16 in the reference's numerics); by default as computed. gemm: x @ w^T in the
    numerics' order of sums (by default one matmul). mix: the gated update from the projection
    (`engram_mix`'s arguments and result; by default engram_mix). The model's Engram passes its ops'
    gemm_of (which stores its output as `act` would) and engram_mix.
    """
    if x.dim() != 3:
        raise EngramError(f"x must be [T, hc, dim], got shape {tuple(x.shape)}")
    n_tok, hc, dim = x.shape
    if rows_embed.dim() != 3 or rows_embed.shape[0] != n_tok:
        raise EngramError(f"rows_embed must be [T={n_tok}, n_rows, head_dim], got {tuple(rows_embed.shape)}")
    in_features = rows_embed.shape[1] * rows_embed.shape[2]
    if not callable(wkv) and tuple(wkv.shape) != ((hc + 1) * dim, in_features):
        raise EngramError(f"wkv must be [{(hc + 1) * dim}, {in_features}], got {tuple(wkv.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (hc, dim):
            raise EngramError(f"{name} must be [{hc}, {dim}], got {tuple(w.shape)}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32

    flat = rows_embed.reshape(n_tok, in_features).to(compute)
    kv = act(gemm(flat, wkv if callable(wkv) else wkv.to(compute)))  # [T, (hc + 1) * dim]
    if kv.shape != (n_tok, (hc + 1) * dim):
        raise EngramError(f"wkv gave [{', '.join(map(str, kv.shape))}] from [{n_tok}, {in_features}], "
                          f"not [{n_tok}, {(hc + 1) * dim}]")
    if token_mask is not None:
        token_mask = torch.as_tensor(token_mask, dtype=torch.bool)
        if tuple(token_mask.shape) != (n_tok,):
            raise EngramError(f"token_mask must be [T={n_tok}], got {tuple(token_mask.shape)}")
    return (mix or engram_mix)(x, kv, q_weight, k_weight, eps, token_mask)


def engram_mix(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
               token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The gated update of engram_forward: x [T, hc, dim], kv [T, (hc + 1) * dim] (the wkv projection: hc
    keys, then the value), q_weight / k_weight [hc, dim], token_mask bool [T] or None (False: gate 0)
    -> x + gate * value per copy, in x's dtype; computed in float32 (float64 if x is float64)."""
    n_tok, hc, dim = x.shape
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    kv = kv.to(compute)
    key = kv[:, : hc * dim].reshape(n_tok, hc, dim)
    value = kv[:, hc * dim :]  # [T, dim], shared by every copy
    h = x.to(compute)
    weight = q_weight.to(compute) * k_weight.to(compute)  # [hc, dim]
    # each (token, copy) is normalized over dim on its own, never across copies
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * dim**-0.5  # [T, hc]
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0.0)
    return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)


class Engram:
    """The Engram of one layer, added to the stream before its block: each position's n-gram rows
    (ngram_rows, over the compressed ids of the tokens so far) gate one value into each residual copy
    (engram_forward). `compressed(ids)` maps token ids to compressed ids (the tokenizer's)."""

    def __init__(self, cfg, layer: int, layout: EngramLayout, weights, ops, act_quant: bool, compressed):
        self.cfg, self.layout, self.weights, self.ops = cfg, layout, weights, ops
        self.act_quant, self.compressed = act_quant, compressed
        self.index = cfg.engram_layer_ids.index(layer)
        self.prefix = f"layers.{layer}.engram."

    def lookup(self, ids: torch.Tensor, dead: torch.Tensor, history: tuple[torch.Tensor, torch.Tensor],
               device: torch.device) -> torch.Tensor:
        """The chunk's n-gram rows [T, n_rows, head_dim] on `device`. Hashing is integer work, done where
        the history is: on the CPU as the engine keeps it (only the gathered rows go to the device: a host
        step, done before a CUDA graph replays), or, with the history on the ids' device, there (no read
        back: a decode step captured whole, its table rows gathered on the device where the weight
        source can)."""
        where = history[0].device
        rows = ngram_rows(self.layout, self.index, self.compressed(ids.to(where)), dead.to(where),
                          mark_dead(*history))
        return self.weights.rows(self.prefix + "embed.weight", rows).to(device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, dead: torch.Tensor,
                history: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hc, dim] -> the stream after Engram; ids/dead [T] this chunk's tokens, history the
        compressed ids and dead flags of the tokens before it; table: `lookup`'s rows, when looked up
        already."""
        p, get = self.prefix, self.weights.get
        if table is None:
            table = self.lookup(ids, dead, history, x.device)
        if self.act_quant:
            table = self.ops.fp8_roundtrip(table.flatten(1), 32).view_as(table)
        ops, wkv = self.ops, p + "wkv.weight"
        return engram_forward(x, table, lambda: get(wkv), get(p + "q_weight"), get(p + "k_weight"), self.cfg.norm_eps,
                              token_mask=~dead, gemm=lambda flat, fetch: ops.gemm_of(flat, fetch, wkv),
                              mix=ops.engram_mix)  # (gemm_of stores its output as `act` would)
