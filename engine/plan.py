"""The serving planner: what a config needs per GPU at a batch, a context and a parallel layout, and
how fast it can be at best. Pure arithmetic over the config, the tally and the role plan (no torch).

Layout (the split engine/serve/parallel.py makes, generalised to separate degrees):
- `tp` GPUs share each attention group: `wq_b`, `attn_sink`, `wo_a`, `wo_b`, the indexer's `wq_b` and
  `weights_proj` by heads, the embedding and the head by vocabulary rows; everything else in a layer
  is replicated, so each GPU of a group holds the group's whole KV (one latent KV head cannot be split
  by heads). `gpus / tp` groups: with `dp_attention` each group serves its own share of the batch,
  without it every group computes the same sequences (the engine's replicated parts).
- `ep` GPUs share the routed experts (contiguous ranges); `gpus / ep` copies of that set.
- Engram tables: on the GPUs (rows spread over all of them), in host memory, or on disk; a token's
  rows depend only on its ids, so their fetch is prefetched and overlaps the layers below.
- DSpark's routed experts split like the backbone's (the engine does not run DSpark in parallel).

Work per GPU and step: matmul FLOPs are 2 x the parameters a token passes (tally rows), attention
over the window plus the selected entries, indexer scores over what it may score; bytes moved are the
weights read once, the KV read and written, the index scores written and read once (materialized, as
the public FP8 logits kernels do), not the activations' own traffic. A layer's roofline time is the
longest of FLOPs / rate, bytes / HBM bandwidth and bytes sent / link bandwidth, resources perfectly
overlapped: every time is a lower bound, every rate an upper bound. Routing is taken as uniform.

GPU models and their datasheet figures (cited there): engine/plan_gpus.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction

from .config import ModelConfig
from .plan_gpus import DISK_Bps, DISK_IOPS, DISK_PAGE, GPU, GPUS  # noqa: F401 (engine.plan.GPUS)
from .roles import FULL, REINDEX, SWA, LayerRole, role_plan
from .tally import Tally, kv_breakdown, tally_from_config, window_bytes_per_layer


class PlanError(ValueError):
    """Inputs that do not describe a deployment; the message names the input and why."""


ENGRAM_PLACES = ("gpu", "host", "disk")
MAX_GPUS, MAX_BATCH = 4096, 1_000_000
ACT_BYTES = 2        # bf16 activations on the wire and in the stream
SCORE_BYTES = 4      # fp32 index scores
TP_BOXES = frozenset({"attn.wq_b", "attn.attn_sink", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
                      "attn.indexer.weights_proj", "embed", "head"})
PARTS = ("attention", "CSA2 extras", "routed experts", "gate + shared expert", "mHC + norms",
         "Engram projection", "Engram tables", "embedding + head", "vision tower", "DSpark")
CACHE_PARTS = ("global KV", "index keys", "sliding windows", "pending compressor state")


@dataclass(frozen=True)
class PlanInputs:
    gpu: str = "h200"
    gpus: int = 8
    ep: int = 8
    tp: int = 1
    dp_attention: bool = False
    batch: int = 1
    context: int = 131072
    engram: str = "gpu"
    chunk: int = 4096          # prefill chunk (tokens of one sequence per step)
    reserve: float = 0.05      # share of HBM kept for the runtime (CUDA context, NCCL, fragmentation)
    dspark: bool = True        # DSpark weights and windows resident
    vision: bool = True        # vision tower resident

    @property
    def groups(self) -> int:
        return self.gpus // self.tp

    def sequences_per_gpu(self, batch: int | None = None) -> int:
        b = self.batch if batch is None else batch
        return -(-b // self.groups) if self.dp_attention else b

    def to_dict(self) -> dict:
        return asdict(self)


def model_max_context(cfg: ModelConfig) -> int:
    """The longest context the model's positions reach: YaRN's original length x its factor (1,048,576
    at release), or the config's own limit when that is longer."""
    return max(cfg.max_seq_len, int(cfg.original_seq_len * cfg.rope_factor))


def check_inputs(cfg: ModelConfig, p: PlanInputs) -> None:
    """Raise PlanError naming the first input that cannot describe a deployment of this config."""
    if p.gpu not in GPUS:
        raise PlanError(f"unknown GPU '{p.gpu}': pick one of {', '.join(GPUS)}")
    for name in ("gpus", "ep", "tp", "batch", "chunk"):
        value, top = getattr(p, name), MAX_GPUS if name in ("gpus", "ep", "tp") else MAX_BATCH
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise PlanError(f"{name} must be a whole number from 1 to {top:,}, got {value!r}")
    top = model_max_context(cfg)
    if isinstance(p.context, bool) or not isinstance(p.context, int) or not 1 <= p.context <= top:
        raise PlanError(f"context must be a whole number from 1 to the model's maximum {top:,}, got {p.context!r}")
    if p.engram not in ENGRAM_PLACES:
        raise PlanError(f"engram must be one of {', '.join(ENGRAM_PLACES)}, got {p.engram!r}")
    if not 0 <= p.reserve < 1:
        raise PlanError(f"reserve must be a share of HBM in [0, 1), got {p.reserve!r}")
    for name in ("tp", "ep"):
        if p.gpus % getattr(p, name):
            raise PlanError(f"{name}={getattr(p, name)} does not divide gpus={p.gpus}")
    bad = [f"{n}={getattr(cfg, n)}" for n in ("n_heads", "o_groups", "index_n_heads", "vocab_size")
           if getattr(cfg, n) % p.tp]
    if bad:
        raise PlanError(f"tp={p.tp} cannot split {', '.join(bad)} evenly")
    if cfg.n_routed_experts % p.ep:
        raise PlanError(f"ep={p.ep} cannot split n_routed_experts={cfg.n_routed_experts} evenly")


# -- weights --------------------------------------------------------------------------------------

def part_of(box: str, group: str) -> str:
    """Which bar segment a tally box belongs to."""
    if group == "moe":
        return "routed experts" if box.startswith("ffn.experts.") else "gate + shared expert"
    if group == "engram":
        return "Engram tables" if box == "engram.embed" else "Engram projection"
    return {"attention": "attention", "csa2": "CSA2 extras", "mhc": "mHC + norms", "norm": "mHC + norms",
            "embedding": "embedding + head", "head": "embedding + head", "vision": "vision tower",
            "dspark": "DSpark"}.get(group, group)


def divisor_of(box: str, cfg: ModelConfig, p: PlanInputs) -> int:
    """How many GPUs share one copy of a box's bytes (1: every GPU holds all of it); 0: not on GPUs."""
    if box == "engram.embed":
        return p.gpus if p.engram == "gpu" else 0
    if box.startswith("ffn.experts."):
        return p.ep
    if box.startswith("dspark.ffn.experts.") and cfg.dspark_n_routed_experts % p.ep == 0:
        return p.ep
    return p.tp if box in TP_BOXES else 1


def weights_per_gpu(cfg: ModelConfig, tally: Tally, p: PlanInputs) -> dict[str, int | float]:
    """Bytes of weights (with their scales) on each GPU, by part (every GPU holds the same)."""
    out = {name: Fraction(0) for name in PARTS}
    for r in tally.rows:
        part = part_of(r.box, r.group)
        if (part == "DSpark" and not p.dspark) or (part == "vision tower" and not p.vision):
            continue
        div = divisor_of(r.box, cfg, p)
        if div:
            out[part] += Fraction(r.total_bytes, div)
    return {k: int(v) if v.denominator == 1 else float(v) for k, v in out.items()}


def host_bytes(tally: Tally, p: PlanInputs) -> int:
    """Engram table bytes kept off the GPUs (host memory or disk; one copy per node)."""
    return 0 if p.engram == "gpu" else sum(r.total_bytes for r in tally.rows if r.box == "engram.embed")


# -- caches and activations -----------------------------------------------------------------------

def window_entry_bytes(cfg: ModelConfig) -> int:
    return window_bytes_per_layer(cfg) // cfg.window_size


def cache_per_sequence(cfg: ModelConfig, context: int, dspark: bool = True, exact_pending: bool = False) -> dict:
    """One sequence's caches at `context` tokens. Global KV and index keys by source layer (floor(C/m)
    entries each), every backbone layer's window (and DSpark's with `dspark`), and the compressor's
    pending tokens (kv and score, fp32, of the < m tokens not pooled yet): their worst case m - 1, or
    exactly C mod m with `exact_pending` (what the engine holds after C tokens)."""
    by_source = [{"layer": k.layer, "ratio": k.ratio, "entries": context // k.ratio,
                  "global_kv": context // k.ratio * k.main_entry_bytes,
                  "index_keys": context // k.ratio * k.index_key_bytes} for k in kv_breakdown(cfg)]
    n_windows = cfg.n_layers + (cfg.n_mtp_layers if dspark else 0)
    pending = sum(2 * cfg.head_dim * 4 * ((context % k.ratio) if exact_pending else k.ratio - 1)
                  for k in kv_breakdown(cfg))
    return {"global KV": sum(s["global_kv"] for s in by_source),
            "index keys": sum(s["index_keys"] for s in by_source),
            "sliding windows": n_windows * min(context, cfg.window_size) * window_entry_bytes(cfg),
            "pending compressor state": pending, "by_source": by_source}


def scored_entries(cfg: ModelConfig, role: LayerRole, position: int) -> int:
    """Index keys one query at `position` tokens scores (0 for layers without an indexer)."""
    if role.role not in (FULL, REINDEX):
        return 0
    visible = position // role.compress_ratio
    if role.in_candidate_pool:
        return min(visible, cfg.candidate_topk_blocks * cfg.candidate_block_size)
    return visible


def activation_bytes(cfg: ModelConfig, p: PlanInputs, context: int) -> dict:
    """Peak working set of one prefill chunk on one GPU: the residual stream in and out (hc copies,
    bf16) plus the larger of the attention phase (queries, outputs, the index scores of the chunk
    over its context) and the MoE phase (dispatched tokens, expert hidden states, outputs)."""
    t = min(p.chunk, context)
    plan = role_plan(cfg)[: cfg.n_layers]
    stream = 2 * t * cfg.hc_mult * cfg.dim * ACT_BYTES
    heads = cfg.n_heads // p.tp
    scores = max((scored_entries(cfg, r, context) for r in plan), default=0) * t * SCORE_BYTES
    attention = 2 * t * heads * cfg.head_dim * ACT_BYTES + scores
    pairs = _routed_pairs(cfg, p, t, t)
    moe = pairs * (cfg.dim + 2 * cfg.moe_inter_dim * ACT_BYTES + cfg.dim * ACT_BYTES) \
        + t * cfg.n_shared_experts * 2 * cfg.moe_inter_dim * ACT_BYTES
    return {"tokens": t, "stream": stream, "attention": attention, "index_scores": scores, "moe": moe,
            "total": stream + max(attention, moe)}


def _routed_pairs(cfg: ModelConfig, p: PlanInputs, group_tokens: float, total_tokens: float) -> float:
    """(token, expert) pairs one GPU computes: without DP attention every GPU sees the group's tokens
    and computes its experts' share; with it the step's tokens spread over all GPUs."""
    k = cfg.n_activated_experts
    return total_tokens * k / p.gpus if p.dp_attention else group_tokens * k / p.ep


# -- memory ---------------------------------------------------------------------------------------

@dataclass
class Memory:
    hbm: float
    weights: dict
    caches: dict
    cache_by_source: list
    activations: dict
    reserve: float
    sequences_per_gpu: int
    used: float
    free: float
    fits: bool
    host_bytes: int

    def segments(self) -> list[tuple[str, str, float]]:
        """(kind, name, bytes) for the stacked bar, in drawing order."""
        out = [("weights", k, v) for k, v in self.weights.items() if v]
        out += [("cache", k, v) for k, v in self.caches.items() if v]
        out += [("activations", "activations (one prefill chunk)", self.activations["total"]),
                ("reserve", "runtime reserve", self.reserve)]
        return out


def memory(cfg: ModelConfig, tally: Tally, p: PlanInputs, weights: dict | None = None) -> Memory:
    """Bytes per GPU at the inputs' batch and context."""
    gpu = GPUS[p.gpu]
    weights = weights if weights is not None else weights_per_gpu(cfg, tally, p)
    seqs = p.sequences_per_gpu()
    one = cache_per_sequence(cfg, p.context, p.dspark)
    caches = {k: seqs * one[k] for k in CACHE_PARTS}
    acts = activation_bytes(cfg, p, p.context)
    reserve = p.reserve * gpu.hbm_bytes
    used = sum(weights.values()) + sum(caches.values()) + acts["total"] + reserve
    by_source = [{**s, "global_kv": seqs * s["global_kv"], "index_keys": seqs * s["index_keys"]}
                 for s in one["by_source"]]
    return Memory(hbm=gpu.hbm_bytes, weights=weights, caches=caches, cache_by_source=by_source, activations=acts,
                  reserve=reserve, sequences_per_gpu=seqs, used=used, free=gpu.hbm_bytes - used,
                  fits=used <= gpu.hbm_bytes, host_bytes=host_bytes(tally, p))


def largest_batch(cfg: ModelConfig, tally: Tally, p: PlanInputs, context: int | None = None,
                  weights: dict | None = None) -> int:
    """The largest batch that fits at `context` (the inputs' by default); 0 when not even one does."""
    context = p.context if context is None else context
    gpu = GPUS[p.gpu]
    weights = weights if weights is not None else weights_per_gpu(cfg, tally, p)
    one = cache_per_sequence(cfg, context, p.dspark)
    per_seq = sum(one[k] for k in CACHE_PARTS)
    room = gpu.hbm_bytes * (1 - p.reserve) - sum(weights.values()) - activation_bytes(cfg, p, context)["total"]
    if room < per_seq:
        return 0
    seqs = int(room // per_seq)
    return seqs * p.groups if p.dp_attention else seqs


def largest_context(cfg: ModelConfig, tally: Tally, p: PlanInputs, weights: dict | None = None) -> int:
    """The longest context (up to the model's maximum) at which the inputs' batch fits; 0 if none."""
    weights = weights if weights is not None else weights_per_gpu(cfg, tally, p)

    def fits(c: int) -> bool:
        return largest_batch(cfg, tally, p, c, weights) >= p.batch

    lo, hi = 0, model_max_context(cfg)
    if fits(hi):
        return hi
    while hi - lo > 1:          # fits(lo) or lo == 0; not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# -- work per layer -------------------------------------------------------------------------------

@dataclass
class Work:
    """One layer's (or the head's) work on one GPU for one step."""
    flops: dict = field(default_factory=lambda: {"bf16": 0.0, "fp8": 0.0, "fp4": 0.0})
    hbm_bytes: float = 0.0
    link_bytes: float = 0.0
    comm: dict = field(default_factory=dict)      # collective -> bytes sent
    fetch: float = 0.0                            # Engram rows from host or disk (bytes)

    def send(self, what: str, nbytes: float) -> None:
        if nbytes:
            self.comm[what] = self.comm.get(what, 0.0) + nbytes
            self.link_bytes += nbytes

    def time(self, gpu: GPU) -> tuple[float, str, dict]:
        times = {"compute": sum(f / gpu.rate(k) for k, f in self.flops.items()),
                 "HBM": self.hbm_bytes / gpu.hbm_Bps, "interconnect": self.link_bytes / gpu.link_Bps}
        limit = max(times, key=times.get)
        return times[limit], limit, times


def _precision(box: str, fmt: str) -> str:
    if box == "attn.wo_a":
        return "bf16"           # stored FP8, dequantized and used as BF16 (spec section 3)
    return {"FP8": "fp8", "FP4": "fp4"}.get(fmt, "bf16")


def layer_boxes(tally: Tally) -> dict[int, list[tuple]]:
    """Per backbone layer: (box, precision, params, bytes, is_matmul, instances in the layer)."""
    out: dict[int, list[tuple]] = {}
    for r in tally.rows:
        if not r.layers or r.group in ("dspark", "vision"):
            continue
        per_layer = r.instances // len(r.layers)
        matmul = len(r.shape) == 2 and r.box != "engram.embed"
        for layer in r.layers:
            out.setdefault(layer, []).append((r.box, _precision(r.box, r.fmt), r.params, r.bytes, matmul, per_layer))
    return out


def _allreduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def layer_work(cfg: ModelConfig, role: LayerRole, boxes: list[tuple], p: PlanInputs, *, tokens: int,
               total_tokens: int, sequences: int, position: int, decode: bool) -> Work:
    """One layer on one GPU. `tokens`: the attention group's tokens this step; `total_tokens`: all
    groups' tokens (MoE load with DP attention); `sequences`: the group's sequences; `position`:
    context length at the step (a prefill chunk ends there)."""
    w, t, m, tp = Work(), tokens, role.compress_ratio, p.tp
    heads, ih = cfg.n_heads // tp, cfg.index_n_heads // tp
    mid = position if decode else max(1, position - t // 2)      # a chunk's mean query position
    routed_tokens = t if not p.dp_attention else total_tokens * p.ep / p.gpus   # served by this expert copy
    pairs = _routed_pairs(cfg, p, t, total_tokens)
    n_experts = cfg.n_routed_experts
    touched = (n_experts / p.ep) * (1 - (1 - cfg.n_activated_experts / n_experts) ** routed_tokens)
    for box, prec, params, nbytes, matmul, count in boxes:
        if box == "engram.embed":
            continue
        if box.startswith("ffn.experts."):
            w.flops[prec] += 2 * params * pairs
            w.hbm_bytes += touched * nbytes
            continue
        div = tp if box in TP_BOXES else 1
        w.hbm_bytes += nbytes * count / div
        if matmul:
            per = t / m if box in ("attn.indexer.wk",) else t
            w.flops[prec] += 2 * params * count * per / div
    # attention core: scores and values over the window and the selected global entries (K = V)
    entry = cfg.head_dim // 2 + cfg.head_dim // 16
    key_bytes = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    window = min(cfg.window_size, mid)
    selected = min(cfg.index_topk, mid // m) if m else 0
    w.flops["bf16"] += 4 * t * heads * cfg.head_dim * (window + selected)
    win = window_entry_bytes(cfg)
    if decode:
        w.hbm_bytes += sequences * (window * win + win + selected * entry)
    else:
        unique_selected = min(t * cfg.index_topk, mid // m) if m else 0
        w.hbm_bytes += (t + min(cfg.window_size, position - t)) * win + t * win + unique_selected * entry
    scored = scored_entries(cfg, role, mid)
    if scored:
        w.flops["fp4"] += 2 * t * ih * cfg.index_head_dim * scored
        keys = scored * key_bytes * (sequences if decode else 1)
        w.hbm_bytes += keys + 2 * t * scored * SCORE_BYTES
        w.send("index scores all-reduce", _allreduce(tp, t * scored * SCORE_BYTES))
    if role.role == FULL:
        w.hbm_bytes += t / m * (entry + key_bytes)
    # collectives: attention output over the group; the MoE's routed sum or its all-to-all
    w.send("attention all-reduce", _allreduce(tp, t * cfg.dim * ACT_BYTES))
    if p.dp_attention:
        local = t / tp * cfg.n_activated_experts * (p.ep - 1) / p.ep    # 1 in ep: this GPU's experts
        w.send("MoE dispatch (all-to-all)", local * cfg.dim)                  # FP8 tokens out
        w.send("MoE combine (all-to-all)", local * cfg.dim * ACT_BYTES)
        w.send("MoE all-gather in group", (tp - 1) / tp * t * cfg.dim * ACT_BYTES)
    else:
        w.send("MoE all-reduce", _allreduce(p.ep, t * cfg.dim * ACT_BYTES))
    if role.engram:
        rows = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        row_bytes = cfg.engram_head_dim + cfg.engram_head_dim // 32
        if p.engram == "gpu":
            w.hbm_bytes += t * rows * row_bytes / (tp if p.dp_attention else p.gpus)   # groups' own tokens
            w.send("Engram rows (all-to-all)", t * rows * row_bytes * (p.gpus - 1) / p.gpus)
        else:
            w.fetch += t * rows * (row_bytes if p.engram == "host" else DISK_PAGE)
    return w


def head_work(cfg: ModelConfig, tally: Tally, p: PlanInputs, *, tokens: int, head_tokens: int) -> Work:
    """Embedding lookup, final norm and head (vocabulary split by tp) for one step."""
    w = Work()
    head = tally.row("head")
    w.flops["bf16"] += 2 * head.params * head_tokens / p.tp
    w.hbm_bytes += head.total_bytes / p.tp + tokens * cfg.dim * ACT_BYTES
    w.send("embedding all-reduce", _allreduce(p.tp, tokens * cfg.dim * ACT_BYTES))
    w.send("logits all-gather", (p.tp - 1) / p.tp * head_tokens * cfg.vocab_size * SCORE_BYTES)
    return w


def fetch_time(nbytes: float, p: PlanInputs, gpu: GPU) -> float:
    """Time to bring Engram rows from host memory (PCIe) or disk (page reads: IOPS or bandwidth)."""
    if p.engram == "host":
        return nbytes / gpu.host_Bps
    if p.engram == "disk":
        return max(nbytes / DISK_PAGE / DISK_IOPS, nbytes / DISK_Bps)
    return 0.0


# -- the plan -------------------------------------------------------------------------------------

@dataclass
class RoleRow:
    role: str
    layers: list
    flops: float              # per layer (all precisions)
    hbm_bytes: float          # per layer
    link_bytes: float         # per layer
    time_s: float             # per layer
    limit: str
    times: dict               # per layer: compute / HBM / interconnect

    @property
    def total_s(self) -> float:
        return self.time_s * max(1, len(self.layers))


@dataclass
class Phase:
    """One decode step or one prefill chunk on one GPU."""
    tokens: int               # the attention group's tokens
    position: int
    rows: list                # RoleRow per role group, then the head
    comm: dict                # collective -> bytes sent per GPU
    fetch_s: float            # Engram rows from host/disk (prefetched: overlaps the layers)
    time_s: float
    limit: str


def role_key(r: LayerRole) -> str:
    name = r.label if r.role in (FULL, SWA) else f"{r.label} m={r.compress_ratio}"
    return name + (" (pool)" if r.in_candidate_pool else "") + (" + Engram" if r.engram else "")


def phase(cfg: ModelConfig, tally: Tally, p: PlanInputs, *, decode: bool, position: int,
          boxes: dict | None = None) -> Phase:
    """Per-role roofline of one decode step (the batch at `position`) or one prefill chunk ending there."""
    gpu = GPUS[p.gpu]
    boxes = boxes if boxes is not None else layer_boxes(tally)
    seqs = p.sequences_per_gpu()
    tokens = seqs if decode else min(p.chunk, position)
    total = (p.batch if p.dp_attention else tokens) if decode else tokens
    groups: dict[str, list] = {}
    comm: dict[str, float] = {}
    fetch = 0.0
    for r in role_plan(cfg)[: cfg.n_layers]:
        w = layer_work(cfg, r, boxes.get(r.layer, []), p, tokens=tokens, total_tokens=total,
                       sequences=seqs if decode else 1, position=position, decode=decode)
        groups.setdefault(role_key(r), []).append((r.layer, w))
        fetch += w.fetch
    head = head_work(cfg, tally, p, tokens=tokens, head_tokens=tokens if decode else 1)
    for _, w in [item for items in groups.values() for item in items] + [(None, head)]:
        for k, v in w.comm.items():
            comm[k] = comm.get(k, 0.0) + v
    rows = []
    for name, items in list(groups.items()) + [("embedding + head", [(None, head)])]:
        n = len(items)
        times = [w.time(gpu) for _, w in items]
        per = {k: sum(t[2][k] for t in times) / n for k in ("compute", "HBM", "interconnect")}
        rows.append(RoleRow(role=name, layers=[layer for layer, _ in items if layer is not None],
                            flops=sum(sum(w.flops.values()) for _, w in items) / n,
                            hbm_bytes=sum(w.hbm_bytes for _, w in items) / n,
                            link_bytes=sum(w.link_bytes for _, w in items) / n,
                            time_s=sum(t[0] for t in times) / n, limit=max(per, key=per.get), times=per))
    layers_s = sum(r.total_s for r in rows)
    fetch_s = fetch_time(fetch, p, gpu)
    spent = {k: sum(r.times[k] * r.total_s / r.time_s for r in rows if r.time_s) for k in rows[0].times}
    limit = "Engram fetch" if fetch_s > layers_s else max(spent, key=spent.get)
    return Phase(tokens=tokens, position=position, rows=rows, comm=comm, fetch_s=fetch_s,
                 time_s=max(layers_s, fetch_s), limit=limit)


def ttft(cfg: ModelConfig, tally: Tally, p: PlanInputs, samples: int = 24, boxes: dict | None = None) -> float:
    """Lower bound on the time to the first token of a prompt of `context` tokens, prefilled chunk by
    chunk alone on the deployment; long prompts sum chunks sampled evenly, each standing for its share."""
    boxes = boxes if boxes is not None else layer_boxes(tally)
    n = -(-p.context // p.chunk)
    picks = range(n) if n <= samples else [round(i * (n - 1) / (samples - 1)) for i in range(samples)]
    picks = sorted(set(picks))
    total = 0.0
    for j, c in enumerate(picks):
        lo = c if j == 0 else (picks[j - 1] + c) // 2 + 1
        hi = c if j == len(picks) - 1 else (c + picks[j + 1]) // 2
        end = min(p.context, (c + 1) * p.chunk)
        chunk = replace(p, chunk=end - c * p.chunk)
        total += phase(cfg, tally, chunk, decode=False, position=end, boxes=boxes).time_s * (hi - lo + 1)
    return total


@dataclass
class Plan:
    inputs: PlanInputs
    gpu: GPU
    memory: Memory
    largest_batch: int
    largest_context: int
    decode: Phase
    prefill: Phase
    ttft_s: float
    notes: list

    @property
    def tokens_per_s(self) -> float:
        """Upper bound on generated tokens per second, all sequences together."""
        return self.inputs.batch / self.decode.time_s

    def to_json(self) -> dict:
        m = self.memory
        return {"inputs": self.inputs.to_dict(), "gpu": asdict(self.gpu),
                "memory": {"hbm": m.hbm, "weights": m.weights, "caches": m.caches, "cache_by_source": m.cache_by_source,
                           "activations": m.activations, "reserve": m.reserve, "sequences_per_gpu": m.sequences_per_gpu,
                           "used": m.used, "free": m.free, "fits": m.fits, "host_bytes": m.host_bytes},
                "largest_batch": self.largest_batch, "largest_context": self.largest_context,
                "decode": _phase_json(self.decode), "prefill": _phase_json(self.prefill),
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_sequence": 1 / self.decode.time_s,
                "ttft_s": self.ttft_s, "notes": self.notes}


def _phase_json(ph: Phase) -> dict:
    return {"tokens": ph.tokens, "position": ph.position, "time_s": ph.time_s, "limit": ph.limit,
            "fetch_s": ph.fetch_s, "comm": ph.comm,
            "rows": [{**asdict(r), "total_s": r.total_s} for r in ph.rows]}


def make_plan(cfg: ModelConfig, p: PlanInputs, tally: Tally | None = None) -> Plan:
    """Everything the planner says about one deployment (raises PlanError for impossible inputs)."""
    check_inputs(cfg, p)
    tally = tally if tally is not None else tally_from_config(cfg)
    weights = weights_per_gpu(cfg, tally, p)
    boxes = layer_boxes(tally)
    notes = []
    if p.groups > 1 and not p.dp_attention:
        notes.append(f"Attention is replicated on {p.groups} groups of {p.tp} GPU(s): every GPU holds every "
                     "sequence's KV; DP attention would give each group its own share of the batch.")
    if p.tp > 1:
        notes.append(f"TP={p.tp} splits heads, not the one latent KV head: each GPU of a group holds the group's "
                     "whole KV, and the indexer's partial scores are all-reduced before top-k.")
    if p.dp_attention and p.batch % p.groups:
        notes.append(f"batch {p.batch} does not divide over {p.groups} attention groups: the busiest holds "
                     f"{p.sequences_per_gpu()} sequences.")
    if p.engram != "gpu":
        notes.append(f"Engram tables ({host_bytes(tally, p) / 1e9:,.1f} GB) stay in {p.engram}; their rows are "
                     "prefetched from the token ids while the layers below run.")
    return Plan(inputs=p, gpu=GPUS[p.gpu], memory=memory(cfg, tally, p, weights),
                largest_batch=largest_batch(cfg, tally, p, weights=weights),
                largest_context=largest_context(cfg, tally, p, weights),
                decode=phase(cfg, tally, p, decode=True, position=p.context, boxes=boxes),
                prefill=phase(cfg, tally, p, decode=False, position=p.context, boxes=boxes),
                ttft_s=ttft(cfg, tally, p, boxes=boxes), notes=notes)

