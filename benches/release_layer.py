"""One release-size layer of each role on one GPU, against its roofline floor; random weights, no download.

    python benches/release_layer.py [--out DIR] [--roles swa,reuse] [--budget-s 170] [--weights stored|fp32]
    TRITON_INTERPRET=1 python benches/release_layer.py --tiny      # the CPU smoke test (tests/test_release_layer.py)

Roles (engine/roles.role_plan over the release config): SWA-only, SWA + Engram, Full m=2, Reuse,
Full m=1 (the candidate source), Reindex (inside the candidate pool). Each runs as the engine runs
it (engine/model/block.py Block.forward on engine/ops, the Triton kernel ops on CUDA), over weights
generated in the stored formats of engine/checkpoint/layout.py tensor_specs (E4M3 + E8M0 32x32 for
the FP8 linears, packed FP4 + E8M0 per 32 for the routed experts, BF16/F32 the rest; Engram rows
made on demand). A Reuse or Reindex layer first runs its source layers (untimed), as in the model.

Per role: a prefill of --tokens tokens with every probe, then one decode step of --decode tokens
(a chunk of one sequence standing in for that many sequences: the weights are read once either way;
the floor counts each sequence's own caches). Time is synchronized wall time of the layer's
Block.forward, the median over the warm passes (the first compiles; --passes 4: three warm ones).
Floor = max(FLOPs / FP8 rate, bytes / HBM rate) with both rates measured here (torch._scaled_mm E4M3 GEMM,
a large device copy); FLOPs and bytes are those of ideal kernels (`layer_work`). Peak memory is torch's peak
allocation during the layer.

--weights stored (default): engine/ops/stored.py StoredWeights, the stored bytes only; fp32: what
engine.run.api.load's DeviceWeights does today (every weight `get` asks for kept dequantized fp32).
Each role is tried on its own (a failure is a row, the rest still run); the table is rewritten after
every role; --budget-s skips what would not finish in time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

RELEASE_CONFIG = ROOT / "assets" / "configs" / "v41-flash.json"  # the release inference config, shipped
ROLES = ("swa", "swa_engram", "full_m2", "reuse", "full_m1", "reindex")
TITLES = {"swa": "SWA-only", "swa_engram": "SWA + Engram", "full_m2": "Full m=2", "reuse": "Reuse",
          "full_m1": "Full m=1 (candidate pool)", "reindex": "Reindex"}
from benches.release_graph import (GOAL_RATIO, decode_loop, graph_phase, graph_row, later_passes,  # noqa: E402
                                   listed_host_syncs, profiled, stream_inputs, table)


# -- which layers ---------------------------------------------------------------------------------

def pick_layers(cfg) -> dict[str, int]:
    """The first layer of each role in the config's plan (a role the config lacks is left out)."""
    from engine.roles import FULL, REINDEX, REUSE, SWA, role_plan
    plan = role_plan(cfg)[: cfg.n_layers]
    tests = {
        "swa": lambda r: r.role == SWA and not r.engram,
        "swa_engram": lambda r: r.role == SWA and r.engram,
        "full_m2": lambda r: r.role == FULL and r.compress_ratio > 1,
        "reuse": lambda r: r.role == REUSE,
        "full_m1": lambda r: r.role == FULL and r.compress_ratio == 1 and r.candidate_source,
        "reindex": lambda r: r.role == REINDEX and r.in_candidate_pool,
    }
    fallback = {"full_m1": lambda r: r.role == FULL and r.compress_ratio == 1,
                "reindex": lambda r: r.role == REINDEX}
    out = {}
    for key in ROLES:
        hit = next((r.layer for r in plan if tests[key](r)), None)
        if hit is None and key in fallback:
            hit = next((r.layer for r in plan if fallback[key](r)), None)
        if hit is not None:
            out[key] = hit
    return out


def chain(cfg, layer: int) -> list[int]:
    """The layers to run, in order, for `layer` to see what it reads: its KV, top-k and index-key
    sources and the candidate source of its pool, then itself."""
    from engine.roles import role_plan
    role = role_plan(cfg)[layer]
    deps = {s for s in (role.kv_source, role.index_source, role.index_key_source) if s is not None}
    if role.in_candidate_pool:
        deps.add(cfg.candidate_source_layer)
    deps.discard(layer)
    return sorted(deps) + [layer]


# -- the roofline ---------------------------------------------------------------------------------

def layer_work(cfg, role, positions: list[int], sequences: int, touched_experts: int) -> dict:
    """FLOPs and HBM bytes of ideal kernels for one layer over queries at `positions` (a prefill:
    0..T-1 of one sequence; a decode step: `sequences` sequences, each one query at its position).
    Bytes: the layer's stored weights (routed experts: only the `touched_experts` used), the bf16
    stream in and out, the Engram rows, and the caches: a prefill writes its window, entries and index
    keys and reads each once; a decode step reads each sequence's window, picks and index keys.
    -> {"flops", "bytes", and their parts}."""
    from engine.checkpoint.layout import tensor_specs
    T, d, H, hd = len(positions), cfg.dim, cfg.n_heads, cfg.head_dim
    m, W = role.compress_ratio, cfg.window_size
    ih, ihd, hc = cfg.index_n_heads, cfg.index_head_dim, cfg.hc_mult
    flops: dict[str, float] = {}
    flops["linears"] = 2 * T * (d * cfg.q_lora_rank + cfg.q_lora_rank * H * hd + d * hd
                                + H * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d)
    visible = [(p + 1) // m if m else 0 for p in positions]           # global entries each query may see
    has_global = m > 0
    selected = [min(cfg.index_topk, v) if has_global else 0 for v in visible]
    flops["attention"] = 4 * H * hd * sum(min(W, p + 1) + s for p, s in zip(positions, selected))
    new_entries = sum((p + 1) // m - p // m for p in positions) if role.role == "full" else 0
    if role.role == "full":
        flops["compressor"] = 2 * T * d * hd * (2 if m > 1 else 1) + 2 * new_entries * hd * ihd
    if role.role in ("full", "reindex"):
        flops["indexer"] = 2 * T * cfg.q_lora_rank * ih * ihd + 2 * T * d * ih + 2 * ih * ihd * sum(visible)
    mix = (2 + hc) * hc
    flops["mhc"] = 2 * 2 * T * hc * d * mix
    n_experts, k = cfg.experts_of(role.layer)
    flops["moe"] = 2 * T * d * n_experts + 3 * 2 * T * d * cfg.moe_inter_dim * (cfg.n_shared_experts + k)
    lookup = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    if role.engram:
        flops["engram"] = 2 * T * lookup * d * (hc + 1)

    nbytes: dict[str, float] = {}
    weights = expert = 0
    for s in tensor_specs(cfg):
        if s.layer != role.layer or s.stage is not None or s.kind.endswith("engram.embed"):
            continue
        if s.expert is not None:
            if s.expert == 0:
                expert += s.nbytes  # one expert's w1, w2, w3 and scales
        else:
            weights += s.nbytes
    nbytes["weights"] = weights + touched_experts * expert
    nbytes["stream"] = 2 * T * hc * d * 2
    if role.engram:
        nbytes["engram_rows"] = T * lookup * (1 + 1 / 32)
    window_row = hd + hd // 32                       # FP8 + E8M0 per 32
    entry_row = hd // 2 + hd // 16                   # FP4 + E4M3 per 16
    key_row = ihd // 2 + ihd // 32                   # FP4 + E8M0 per 32
    if sequences == 1 and T > 1:  # a prefill: every cache written (or read) once
        n_entries = visible[-1] if has_global else 0
        nbytes["window"] = T * window_row
        if has_global:
            nbytes["global_kv"] = n_entries * entry_row * (2 if role.role == "full" else 1)
        if role.role in ("full", "reindex"):
            nbytes["index_keys"] = n_entries * key_row * (2 if role.role == "full" else 1)
    else:  # a decode step: each sequence reads its own caches
        nbytes["window"] = T * W * window_row
        if has_global:
            nbytes["global_kv"] = sum(selected) * entry_row + new_entries * (entry_row + key_row)
        if role.role in ("full", "reindex"):
            nbytes["index_keys"] = sum(visible) * key_row
    return {"flops": float(sum(flops.values())), "bytes": float(sum(nbytes.values())),
            "flops_parts": flops, "bytes_parts": nbytes}


def floor_of(work: dict, rates: dict) -> tuple[float, str]:
    """(seconds, limit): the roofline floor of `work` at the measured rates."""
    t_flops = work["flops"] / rates["fp8_flops"]
    t_bytes = work["bytes"] / rates["hbm_Bps"]
    return (t_flops, "FP8") if t_flops >= t_bytes else (t_bytes, "HBM")


# -- rates measured in this run -------------------------------------------------------------------

def _timed(fn, device, reps: int) -> float:
    """Median seconds of fn() over reps (after one warm-up call), synchronized."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def measure_rates(device, small: bool) -> dict:
    """FP8 GEMM rate (torch._scaled_mm, E4M3 x E4M3 -> bf16) and copy bandwidth (read + write)."""
    n = 128 if small else 8192  # the CPU's FP8 GEMM is emulated (slow)
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    t = _timed(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device,
               3 if small else 20)
    fp8 = 2 * n ** 3 / t
    del a, b
    size = (16 << 20) if small else (2 << 30)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, 3 if small else 20)
    del src, dst
    return {"fp8_flops": fp8, "hbm_Bps": 2 * size / t, "fp8_gemm_n": n, "copy_bytes": size}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- weights in the stored formats ----------------------------------------------------------------

class ModuloTokenizer:
    """Random ids stand in for text: the Engram's compressed id is the id modulo its size."""

    def __init__(self, cfg):
        self.size, self.vocab, self.eos_id = cfg.engram_compressed_vocab_size, cfg.vocab_size, 1

    def compressed_vocab(self):
        return [i % self.size for i in range(self.vocab)], self.size


class Generated:
    """Stored-format tensors of the layers asked for, made on the device (`add_layer` / `drop_layer`),
    behind an engine/ops/stored.py TensorReader; experts are generated stacked."""

    def __init__(self, cfg, device, seed: int = 0):
        from engine.checkpoint.layout import tensor_specs
        from engine.ops.stored import TensorReader
        self.cfg, self.device, self.seed = cfg, torch.device(device), seed
        self.specs = {s.name: s for s in tensor_specs(cfg) if s.stage is None and s.group != "vision"}
        self.reader = TensorReader({})
        self.layers: set[int] = set()
        self._pools: dict[str, torch.Tensor] = {}

    def add_layer(self, layer: int) -> float:
        """Generate one layer's tensors; returns the seconds it took."""
        from engine import quant
        from engine.checkpoint.weights import init_weight
        if layer in self.layers:
            return 0.0
        started = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1000 + layer)
        prefix = f"layers.{layer}."
        new = {}
        for name, s in self.specs.items():
            if s.layer != layer or s.part != "weight" or s.expert is not None or s.kind.endswith("engram.embed"):
                continue
            with torch.device(self.device):
                value = init_weight(name, tuple(s.logical_shape), gen)
            if s.dtype == "F8_E4M3":
                new[name], new[name[: -len('.weight')] + ".scale"] = quant.quantize_fp8_weight(value, 32)
            elif s.dtype == "BF16":
                new[name] = value.to(torch.bfloat16)
            else:
                new[name] = value.float()
        self.reader.tensors.update(new)
        self.reader.experts[prefix + "ffn."] = self._experts(gen)
        self.reader.__init__(self.reader.tensors, self.reader.experts)  # expert views by name
        self.layers.add(layer)
        _sync(self.device)
        return time.perf_counter() - started

    def _experts(self, gen):
        """Random packed FP4 codes (every code is a valid E2M1 value) with E8M0 scales near 1/(rms * sqrt(fan_in))."""
        cfg = self.cfg
        e, d, inter = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim

        def fp4(rows, fan_in):
            packed = torch.randint(-128, 128, (e, rows, fan_in // 2), dtype=torch.int8, device=self.device,
                                   generator=gen)
            level = 127 - round(math.log2(2.9 * math.sqrt(fan_in)))  # FP4 codes have rms ~2.9
            scale = torch.randint(level - 1, level + 1, (e, rows, fan_in // 32), dtype=torch.uint8,
                                  device=self.device, generator=gen).view(torch.float8_e8m0fnu)
            return packed, scale
        w1, w3, w2 = fp4(inter, d), fp4(inter, d), fp4(d, inter)
        return (*w1, *w3, *w2)

    def drop_layer(self, layer: int) -> None:
        prefix = f"layers.{layer}."
        self.reader.tensors = {n: t for n, t in self.reader.tensors.items() if not n.startswith(prefix)}
        self.reader.experts.pop(prefix + "ffn.", None)
        self._pools = {n: t for n, t in self._pools.items() if not n.startswith(prefix)}
        self.layers.discard(layer)

    POOL_ROWS = 1 << 16

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Engram table rows [*index.shape, head_dim]: row r is pool row r mod POOL_ROWS, a pool of rows
        about N(0, 1), FP8-rounded per 32 as stored, made once per table (the full table, 16M rows, is
        never made): a lookup is one gather on the device, as from a table held there."""
        from engine import quant
        pool = self._pools.get(name)
        if pool is None:
            cols = self.specs[name].logical_shape[-1]
            g = torch.Generator(device=self.device).manual_seed(self.seed + len(name))
            values = torch.randn(self.POOL_ROWS, cols, device=self.device, generator=g)
            pool = self._pools[name] = quant.fp8_roundtrip(values, 32)
        return pool[index.to(self.device) % self.POOL_ROWS]


def weight_source(gen: Generated, mode: str):
    """The engine's weight source over the generated bytes: StoredWeights (mode "stored"), or the
    fp32-kept source of today's GPU load (mode "fp32")."""
    from engine.ops.stored import StoredWeights

    class BenchWeights(StoredWeights):
        # which tensors exist and how they are stored: the whole config's contract
        def has(self, name):
            return name in gen.specs

        def stored_dtype(self, name):
            return gen.specs[name].dtype

        def forget(self, prefix: str) -> None:
            for d in (self._stored, self._float):
                for n in [n for n in d if n.startswith(prefix)]:
                    del d[n]

    class Fp32Kept(BenchWeights):
        """DeviceWeights' behaviour: every float value `get` makes is kept."""
        def get(self, name):
            hit = self._float.get(name)
            if hit is None:
                hit = self._float[name] = super().get(name)
                self._handed.clear()
            return hit

        def stacked_experts(self, prefix, n_experts):
            return None  # today's ops stack the per-expert tensors themselves

    cls = Fp32Kept if mode == "fp32" else BenchWeights
    return cls(reader=gen.reader, device=gen.device, rows=gen.rows)


# -- one role -------------------------------------------------------------------------------------

def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_role(model, cfg, layers: list[int], tokens: int, decode: int, device, detail: bool,
             profiles: dict | None = None, graphs: dict | None = None, syncs: list | None = None, outputs=False) -> dict:
    """One pass: reset the caches, prefill `layers` in order, then one decode chunk; the last layer is
    timed. -> {"prefill_s", "decode_s", "peak_prefill", "peak_decode", "touched_prefill", "touched_decode",
    "prefill_out", "decode_out" (on the host, with outputs)}. profiles: a dict to receive the last layer's profile per phase
    (a pass of its own: the profiler slows what it watches). graphs: {phase: a dict} to receive the last
    layer's phase captured as a CUDA graph (`graph_phase`) instead of run eagerly (a captured prefill fills
    the caches by its replays); with profiles too, one replay is profiled into profiles["<phase> graph"].
    syncs: a dict to receive, per phase, the host syncs of the last layer (CUDA's sync debug mode: file:line
    of each)."""
    from engine.model.attention import Shared
    target = layers[-1]
    model.reset()
    ids, x0, pre0 = stream_inputs(model, cfg, tokens + decode, device, seed=7)
    out = {}
    history = (model.compressed_history, model.dead_history)
    for phase, rows in (("prefill", slice(0, tokens)), ("decode", slice(tokens, tokens + decode))):
        shared = Shared()
        positions = torch.arange(rows.start, rows.stop, device=device)
        chunk_ids = ids[rows]
        dead = torch.zeros(chunk_ids.shape[0], dtype=torch.bool, device=device)
        for L in layers:
            block = model.blocks[L]
            probe = {} if L == target else None
            block.attn.detail = detail and L == target and phase == "prefill"
            x, pre = x0[rows].clone(), pre0[rows].clone()
            _sync(device)
            if L == target:
                _peak_reset(device)
            started = time.perf_counter()
            step = (chunk_ids, dead, history)
            if L == target and graphs is not None and phase in graphs:
                graphs[phase].update(graph_phase(block, x, pre, positions, shared, step, device, phase, probe,
                                                 profiles))
                continue
            with profiled(profiles if L == target else None, phase, device), \
                    listed_host_syncs(syncs.setdefault(phase, []) if syncs is not None and L == target else None,
                                      device):
                y, _ = block.forward(x, pre, positions, shared, step, None, probe)
                _sync(device)
            if L == target:
                out[f"{phase}_s"] = time.perf_counter() - started
                out[f"peak_{phase}"] = _peak(device)
                experts = probe.get("routing", {}).get("experts")
                out[f"touched_{phase}"] = int(torch.unique(experts).numel()) if experts is not None else None
                if outputs:  # on the host: a 4K prefill's 0.34 GB kept on the GPU raised later peaks (run 25a)
                    out[f"{phase}_out"] = y.cpu()
        history = model.history_after(chunk_ids, dead)
    return out


def bench_role(key, layer, model, gen, weights, cfg, args, rates, device, deadline) -> list[dict]:
    """Both phases of one role -> two table rows (or one error row)."""
    from engine.roles import role_plan
    role = role_plan(cfg)[layer]
    layers = chain(cfg, layer)
    gen_s = sum(gen.add_layer(L) for L in layers)
    passes, times = [], []
    for attempt in range(args.passes):
        started = time.perf_counter()
        got = run_role(model, cfg, layers, args.tokens, args.decode, device, args.detail, outputs=args.graph)
        eager_out = {phase: got.pop(f"{phase}_out", None) for phase in ("prefill", "decode")}  # the last pass's
        took = time.perf_counter() - started
        times.append(took)
        passes.append(got)
        if attempt == 0:
            # a warm pass takes well under a second (0.05 s measured); the first one compiles (~80 s)
            if attempt + 1 < args.passes and time.perf_counter() + min(took, 10.0) > deadline:
                break  # no time for a warm pass: report the first (compiles included)
    got = passes[-1]
    warm = len(passes) > 1
    extra = later_passes(lambda **kw: run_role(model, cfg, layers, args.tokens, args.decode, device, args.detail, **kw),
                         model.ops, args, times[-1] if warm else None, deadline, device,
                         loop=lambda: decode_loop(model, cfg, layers, args.tokens, args.decode_loop, device))
    syncs, profiles, graphs, ab, loop = (extra[k] for k in ("syncs", "profiles", "graphs", "ab", "loop"))
    rows = []
    for phase in ("prefill", "decode"):
        if phase == "prefill":
            positions, sequences = list(range(args.tokens)), 1
        else:
            positions, sequences = [args.tokens] * args.decode, args.decode
        touched = got.get(f"touched_{phase}") or min(cfg.n_routed_experts, len(positions) * cfg.n_activated_experts)
        work = layer_work(cfg, role, positions, sequences, touched)
        floor_s, limit = floor_of(work, rates)
        # the median over the warm passes (one warm pass's figure moved by up to 2 ms between runs 24b and 24d)
        t = statistics.median(p[f"{phase}_s"] for p in (passes[1:] if warm else passes))
        rows.append({"role": key, "title": TITLES[key], "layer": layer, "phase": phase,
                     "queries": len(positions), "time_s": t, "flops": work["flops"], "bytes": work["bytes"],
                     "flops_parts": work["flops_parts"], "bytes_parts": work["bytes_parts"],
                     "floor_s": floor_s, "limit": limit, "ratio": t / floor_s,
                     "goal_met": t / floor_s <= GOAL_RATIO, "touched_experts": touched,
                     "peak_bytes": got.get(f"peak_{phase}"), "warm": warm, "chain": layers,
                     "generate_s": gen_s, "pass_s": [round(x, 3) for x in times],
                     "phase_s": [round(p[f"{phase}_s"], 5) for p in passes], "status": "ok"})
        if phase in profiles:
            rows[-1]["profile"] = profiles[phase]
        if f"{phase} graph" in profiles:
            rows[-1]["graph_profile"] = profiles[f"{phase} graph"]
        rows[-1]["host_syncs"] = syncs.get(phase, [])
        rows[-1].update(graph_row(graphs.get(phase, {}), eager_out[phase], floor_s))
        if phase == "decode":
            rows[-1].update(loop)
        elif ab:
            rows[-1]["ab"] = ab
    return rows


# -- the report -----------------------------------------------------------------------------------

def profile_text(report: dict) -> str:
    """The profiled rows' tables, one section per role and phase (--profile)."""
    parts = []
    for row in (r for r in report["rows"] if r["status"] == "ok"):
        for key, what, took in (("profile", row["phase"], row["time_s"]),
                                ("graph_profile", f"{row['phase']} graph replay", row.get("graph_s"))):
            prof = row.get(key)
            if prof:
                parts.append(f"## {row['title']}, layer {row['layer']}, {what} {row['queries']}: "
                             f"{took * 1e3:.2f} ms unprofiled; profiled: kernels {prof['kernel_s'] * 1e3:.2f} ms "
                             f"in {prof['launches']} launches, GPU busy {prof['busy_s'] * 1e3:.2f} ms of "
                             f"{prof['span_s'] * 1e3:.2f} ms\n\n{prof['text']}\n")
    return "\n".join(parts)


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "release-layer.md").write_text(table(report))
    text = profile_text(report)
    if text:
        (out / "release-layer-profile.txt").write_text(f"# Release-size layers profiled, {report['device']}\n\n{text}")
    rows = [{**r, **{key: {k: v for k, v in r[key].items() if k != "text"}
                       for key in ("profile", "graph_profile") if r.get(key)}}
            for r in report["rows"]]  # the tables live in the .txt
    (out / "release-layer.json").write_text(json.dumps({**report, "rows": rows}, indent=1, default=str))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(RELEASE_CONFIG), help="inference config (default: the release's)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny config (CPU smoke test)")
    p.add_argument("--tokens", type=int, default=None, help="prefill length (default 4096; --tiny 24)")
    p.add_argument("--decode", type=int, default=None, help="decode step width (default 64; --tiny 4)")
    p.add_argument("--roles", default=",".join(ROLES), help=f"comma-separated subset of {','.join(ROLES)}")
    p.add_argument("--budget-s", type=float, default=170.0, help="stop starting roles past this wall time")
    p.add_argument("--weights", choices=("stored", "fp32"), default="stored")
    p.add_argument("--numerics", default="reference", choices=("reference", "fp32"))
    p.add_argument("--kernels", choices=("auto", "on", "off"), default="auto",
                   help="the Triton kernel ops (auto: on; on the CPU only under TRITON_INTERPRET=1)")
    p.add_argument("--passes", type=int, default=4,
                   help="passes per role; the median of the warm ones is reported (the first compiles)")
    p.add_argument("--detail", action="store_true", help="also the detail probes (runner-ups, recall)")
    p.add_argument("--device", default=None)
    p.add_argument("--graph", action="store_true",
                   help="two more passes per role, the decode step and then the prefill captured as a CUDA graph and "
                        "replayed")
    p.add_argument("--decode-loop", type=int, default=0, metavar="N",
                   help="also N one-token decode steps per role, eager and on the engine's piecewise CUDA graphs")
    p.add_argument("--profile", action="store_true",
                   help="one more pass per role under torch.profiler: release-layer-profile.txt")
    p.add_argument("--moe-fp8", action="store_true", help="routed experts on FP8 tensor cores (kernels/moe_f8.py)")
    p.add_argument("--ops", default="", help="kernel-ops knobs, name=value,... (TritonOps.KNOBS, e.g. linear_bf16_decode=0)")
    p.add_argument("--ab", default="", help="knob variants timed beside the defaults, e.g. 'mhc_f32_stream=0;attn_one_pass=1'")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    args.tokens = args.tokens or (24 if args.tiny else 4096)
    args.decode = args.decode or (4 if args.tiny else 64)
    args.roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    args.ab = [v.strip() for v in args.ab.split(";") if v.strip()]
    bad = [r for r in args.roles if r not in ROLES]
    if bad:
        p.error(f"unknown roles {bad}; choose from {', '.join(ROLES)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    deadline = started + args.budget_s
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from engine_helpers import tiny_config
        cfg, cfg_name = tiny_config(), "tests' tiny config"
    else:
        from engine.config import load_config
        cfg, cfg_name = load_config(args.config), f"config {args.config}"
    from engine.model.transformer import Model
    kernels = {"auto": True if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else False,
               "on": True, "off": False}[args.kernels]
    out = Path(args.out)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
              "config": cfg_name, "tokens": args.tokens, "decode": args.decode, "weights": args.weights,
              "budget_s": args.budget_s, "rows": [], "torch": torch.__version__}
    rates = measure_rates(device, small=device.type != "cuda")
    report["rates"] = rates
    gen = Generated(cfg, device)
    weights = weight_source(gen, args.weights)
    with torch.inference_mode():
        model = Model(cfg, weights, ModuloTokenizer(cfg), numerics=args.numerics, kernels=kernels, device=device)
    model.ops.moe_fp8_mma, knobs = args.moe_fp8, (model.ops.set_knobs(args.ops) if args.ops else {})  # TritonOps'
    report["ops"] = type(model.ops).__name__ + f" over {args.numerics}" + (", MoE on FP8 MMA" if args.moe_fp8 else "") \
        + "".join(f", {k}={v}" for k, v in knobs.items())
    picks = pick_layers(cfg)
    todo = [k for k in args.roles if k in picks]
    for key in args.roles:
        if key not in picks:
            report["rows"].append({"role": key, "title": TITLES[key], "status": "absent",
                                   "error": "the config has no such layer"})
    for i, key in enumerate(todo):
        layer = picks[key]
        if time.perf_counter() > deadline:
            report["rows"].append({"role": key, "title": TITLES[key], "layer": layer, "status": "skipped",
                                   "error": f"past the {args.budget_s:g} s budget"})
            continue
        try:
            with torch.inference_mode():
                rows = bench_role(key, layer, model, gen, weights, cfg, args, rates, device, deadline)
            report["rows"] += rows
            for row in rows:
                print(f"[{row['title']}] layer {layer} {row['phase']}: {row['time_s'] * 1e3:.2f} ms, floor "
                      f"{row['floor_s'] * 1e3:.3f} ms ({row['limit']}), {row['ratio']:.1f}x", flush=True)
        except Exception as err:  # noqa: BLE001 -- one role's failure must not lose the others
            report["rows"].append({"role": key, "title": TITLES[key], "layer": layer, "status": "error",
                                   "error": f"{type(err).__name__}: {err}".replace("\n", " "),
                                   "traceback": traceback.format_exc()[-3000:]})
            print(f"[{TITLES[key]}] failed: {err!r}", flush=True)
        # free layers no later role needs
        later = {L for k in todo[i + 1:] for L in chain(cfg, picks[k])}
        for L in sorted(gen.layers - later):
            gen.drop_layer(L)
            weights.forget(f"layers.{L}.")
            if hasattr(model.ops, "forget"):  # the kernel ops' device copies of the stored bytes
                model.ops.forget(f"layers.{L}.")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["wall_s"] = time.perf_counter() - started
        write(report, out)
    report["wall_s"] = time.perf_counter() - started
    write(report, out)
    print(table(report))
    return 0 if all(r["status"] in ("ok", "absent") for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
