"""The release-size model over several GPUs (expert + tensor parallel), random weights, no download.

    torchrun --standalone --nproc-per-node 8 benches/parallel.py [--tokens 4096] [--out FILE]
    python benches/parallel.py --nproc 8                  # the same, spawning the ranks itself
    python benches/parallel.py --smoke                    # tiny config, 2 gloo processes on the CPU

Each rank generates only its shard of the weights on its GPU, in the release's stored formats (FP8
with 32x32 E8M0 scales, FP4 routed experts, BF16/F32 the rest); the Engram tables are never
materialized: their rows are a hash of (table, row, column), made on demand. Then one prompt of
`--tokens` random ids goes through all layers with every probe, and rank 0 reports:
- per-layer time (synchronized around each block) against a roofline per GPU (FP8 tensor-core peak
  and HBM bandwidth for the ideal release kernels; fp32 peak for what this engine computes in);
- memory per GPU (resident shard, peak allocated);
- click-to-view: the explorer's request for one layer through the engine service (HTTP on rank 0,
  every rank computing) until the layer's view model and figure are built.
See notes/parallel.md. GPU numbers are not yet measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# H200 SXM peaks (dense): the roofline's denominators
PEAK = {"hbm_Bps": 4.8e12, "fp8_flops": 1979e12, "bf16_flops": 989e12, "fp32_flops": 67e12}


def smoke_config():
    """A tiny config with every role (SWA, Full m=2 and m=1, Reuse, Reindex, Engram): the tests' own."""
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_helpers import tiny_config
    return tiny_config()


class ModuloTokenizer:
    """Stands in for the tokenizer on random ids: the Engram compressed id is the id modulo its size."""

    def __init__(self, cfg):
        self.size, self.vocab, self.eos_id = cfg.engram_compressed_vocab_size, cfg.vocab_size, 1

    def compressed_vocab(self):
        return [i % self.size for i in range(self.vocab)], self.size

    def token_strings(self, ids):
        return [f"<{i}>" for i in ids]

    def decode(self, ids):
        return "".join(self.token_strings(ids))


# -- weights made on the device, in the release formats -------------------------------------------------

class GeneratedWeights:
    """A rank's shard of random weights, stored as the release stores them. For the kernel ops
    (`stored_formats`, engine/ops/triton.py) the shard's stored tensors are read as they are (`reader`,
    `stored`) and FP8/FP4 float values are made per call, not kept; else dequantized to fp32 on first use
    (byte-bounded LRU). Engram table rows are computed from (table, row, column)."""

    def __init__(self, cfg, parallel, seed: int = 0, cache_bytes: int = 8 << 30):
        from engine.checkpoint.layout import tensor_specs
        from engine.serve.parallel import check_splittable
        from engine.checkpoint.weights import TensorCache

        if parallel is not None:
            check_splittable(cfg, parallel.world)
        self.cfg, self.parallel = cfg, parallel
        self.device = parallel.device if parallel is not None else torch.device("cpu")
        self.specs = {s.name: s for s in tensor_specs(cfg)
                      if s.part == "weight" and s.group != "vision" and s.stage is None and s.layer is not None
                      or s.name in ("embed.weight", "head.weight", "norm.weight")}
        self.shard: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # name -> (stored, scale)
        self.cache = TensorCache(cache_bytes)
        self.seed = seed
        started = time.perf_counter()
        for name, spec in self.specs.items():
            if spec.kind.endswith("engram.embed"):
                continue  # rows on demand
            if not self._mine(name):
                continue
            self.shard[name] = self._make(name, spec)
        self.generate_s = time.perf_counter() - started
        from engine.ops.stored import HandedOut, TensorReader
        tensors = {}
        for name, (w, scale) in self.shard.items():
            tensors[name] = w
            if scale is not None:
                tensors[name[: -len(".weight")] + ".scale"] = scale
        self.reader = TensorReader(tensors)  # the rank's shard as the kernel ops read stored bytes
        self.stored_formats = False
        self._handed = HandedOut()

    def _mine(self, name: str) -> bool:
        from engine.serve.parallel import expert_of
        expert = expert_of(name)
        return expert is None or self.parallel is None or self.parallel.owns_expert(expert, self.cfg.n_routed_experts)

    def _make(self, name, spec):
        from engine import quant
        from engine.serve.parallel import split_of
        from engine.checkpoint.weights import init_weight

        shape = list(spec.logical_shape)
        split = split_of(name) if self.parallel is not None else None
        if split is not None:
            shape[split.dim] = self.parallel.local(shape[split.dim], split.what)
        # the same seed on every rank for replicated weights (crc32: Python's hash() differs per process)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode())
                                                              + 7919 * (self.parallel.rank if split else 0))
        with torch.device(self.device):
            value = init_weight(name, tuple(shape), gen)
        if spec.dtype == "I8":
            return quant.quantize_fp4_weight(value, 32)
        if spec.dtype == "F8_E4M3":
            return quant.quantize_fp8_weight(value, 32)
        if spec.dtype == "BF16":
            return value.to(torch.bfloat16), None
        return value.float(), None

    def resident_bytes(self) -> int:
        return sum(w.numel() * w.element_size() + (0 if s is None else s.numel() * s.element_size())
                   for w, s in self.shard.values())

    # the WeightSource surface
    def has(self, name: str) -> bool:
        return name in self.specs

    def stored_dtype(self, name: str) -> str:
        return self.specs[name].dtype

    def stored(self, name: str) -> torch.Tensor | None:
        """The rank's stored tensor (its slice already), or None."""
        return self.reader.tensors.get(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.shard:
            raise KeyError(f"weight '{name}' is not held by this rank")
        if self.stored_formats and self.shard[name][1] is not None:  # made per call, not kept
            return self._handed.dequantized(name, *self.shard[name], self.reader)
        return self.cache.get(name, self._dequantize)

    def _dequantize(self, name: str) -> torch.Tensor:
        from engine.ops.stored import dequantize
        w, s = self.shard[name]
        return w.float() if s is None else dequantize(w, s)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Engram rows [*index.shape, head_dim]: about N(0, 1), FP8-rounded per 32 like the stored table."""
        from engine import quant
        cols = self.specs[name].logical_shape[-1]
        table = 1 + self.cfg.engram_layer_ids.index(int(name.split(".")[1]))
        idx = index.to(self.device).long()[..., None]
        col = torch.arange(cols, device=self.device)
        u1 = _hash_uniform(idx * 2654435761 + col * 40503 + table * 97 + self.seed)
        u2 = _hash_uniform(idx * 2246822519 + col * 3266489917 + table * 131 + self.seed + 1)
        normal = torch.sqrt(-2 * torch.log(u1.clamp_min(1e-7))) * torch.cos(2 * torch.pi * u2)
        return quant.fp8_roundtrip(normal.flatten(0, -2), 32).view(normal.shape)


def _hash_uniform(x: torch.Tensor) -> torch.Tensor:
    """A splitmix-style integer mix (int64, wrapping) -> uniform floats in [0, 1)."""
    x = x ^ (x >> 31)
    x = x * 0x7FB5D329728EA185
    x = x ^ (x >> 27)
    x = x * 0x01B8F0B3C5E8F7E7
    x = x ^ (x >> 33)
    return (x & 0xFFFFFF).float() / float(1 << 24)


# -- the roofline -----------------------------------------------------------------------------------

def layer_work(cfg, role, tokens: int, world: int) -> dict:
    """Ideal work of one layer's prefill on one GPU: flops and weight bytes, split parts / world."""
    from engine.checkpoint.layout import tensor_specs

    T, d, H, hd = tokens, cfg.dim, cfg.n_heads, cfg.head_dim
    m = role.compress_ratio
    split = repl = 0.0
    repl += 2 * T * d * cfg.q_lora_rank + 2 * T * d * hd                  # wq_a, wkv
    split += 2 * T * cfg.q_lora_rank * H * hd                              # wq_b
    split += 2 * T * H * hd * cfg.o_lora_rank + 2 * T * cfg.o_groups * cfg.o_lora_rank * d  # wo_a, wo_b
    selected = min(cfg.index_topk, T // m) if m else 0
    split += 4 * T * H * hd * (min(cfg.window_size, T) + selected)        # scores + values
    if role.role == "full":
        repl += 2 * T * d * hd * (2 if m > 1 else 1) + 2 * (T // m) * hd * cfg.index_head_dim
    if role.role in ("full", "reindex"):
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        split += 2 * T * cfg.q_lora_rank * ih * ihd + 2 * T * d * ih + 2 * T * (T // m) * ih * ihd
    repl += 2 * 2 * T * cfg.hc_mult * d * (2 + cfg.hc_mult) * cfg.hc_mult  # mHC mixes
    repl += 2 * T * d * cfg.n_routed_experts + 3 * 2 * T * d * cfg.moe_inter_dim  # gate, shared expert
    split += cfg.n_activated_experts * 3 * 2 * T * d * cfg.moe_inter_dim    # routed experts
    if role.engram:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        repl += 2 * T * cols * d * (cfg.hc_mult + 1)
    from engine.serve.parallel import expert_of, split_of
    bytes_split = bytes_repl = 0
    for s in tensor_specs(cfg):
        if s.layer != role.layer or s.stage is not None or s.kind.endswith("engram.embed"):
            continue
        if expert_of(s.name) is not None or split_of(s.name) is not None \
                or split_of(s.name[: -len(".scale")] + ".weight") is not None:
            bytes_split += s.nbytes
        else:
            bytes_repl += s.nbytes
    flops = split / world + repl
    nbytes = bytes_split / world + bytes_repl
    return {"flops": flops, "bytes": nbytes,
            "roofline_fp8_s": max(flops / PEAK["fp8_flops"], nbytes / PEAK["hbm_Bps"]),
            "roofline_fp32_s": max(flops / PEAK["fp32_flops"], nbytes / PEAK["hbm_Bps"])}


# -- one rank ---------------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_layers(cfg, n: int):
    """The config of the first n layers (the quick check): the per-layer lists cut to them, no
    DSpark stages, no candidate pool unless its source layer is among them."""
    keep = [i for i, layer in enumerate(cfg.engram_layer_ids) if layer < n]
    return cfg.replace(
        n_layers=n, n_mtp_layers=0, compress_ratios=cfg.compress_ratios[:n],
        kv_source_layers=tuple(L for L in cfg.kv_source_layers if L < n),
        index_source_layers=tuple(L for L in cfg.index_source_layers if L < n),
        candidate_source_layer=cfg.candidate_source_layer if cfg.candidate_source_layer < n else -1,
        engram_layer_ids=tuple(cfg.engram_layer_ids[i] for i in keep),
        engram_num_embeddings=tuple(cfg.engram_num_embeddings[i] for i in keep),
        dspark_target_layer_ids=tuple(L for L in cfg.dspark_target_layer_ids if L < n))


def rank_main(args) -> dict | None:
    from engine.model.block import Block
    from engine.run.api import Engine
    from engine.config import release_config
    from engine.ops.triton import decide
    from engine.serve.parallel import Parallel
    from engine.serve.service import EngineService, follow, make_server

    parallel = Parallel.from_env("gloo" if args.smoke else args.backend, share_gpus=args.share_gpus)
    if parallel is None:
        raise SystemExit("run under torchrun, or with --nproc N (or --smoke)")
    torch.manual_seed(0)
    if parallel.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // parallel.world))
    cfg = smoke_config() if args.smoke else release_config()
    n_layers = args.layers or cfg.n_layers
    if n_layers < cfg.n_layers:
        cfg = first_layers(cfg, n_layers)
    weights = GeneratedWeights(cfg, parallel, cache_bytes=args.cache_gb << 30)
    kernels = {"auto": None, "on": True, "off": False}[args.kernels]
    weights.stored_formats = decide(kernels, weights, parallel.device, parallel)
    engine = Engine(cfg, weights, ModuloTokenizer(cfg), source="random release-format weights",
                    identity=f"random-{'smoke' if args.smoke else 'release'}", parallel=parallel, kernels=kernels)
    device = parallel.device
    block_s: dict[int, float] = {}
    block_forward = Block.forward

    def timed_block(self, *a, **k):  # synchronized per-layer wall time (GPU work is asynchronous)
        _sync(device)
        started = time.perf_counter()
        out = block_forward(self, *a, **k)
        _sync(device)
        block_s[self.layer] = time.perf_counter() - started
        return out

    Block.forward = timed_block  # this process runs only this bench
    ids = torch.randint(5, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    if args.warmup:
        engine.run(ids[:256], probes=())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    started = time.perf_counter()
    result = engine.run(ids)
    _sync(device)
    prompt_s = time.perf_counter() - started
    memory = {"rank": parallel.rank, "resident_weights_bytes": weights.resident_bytes(),
              "generate_s": round(weights.generate_s, 3)}
    if device.type == "cuda":
        memory["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        memory["total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    memory = parallel.gather_objects(memory)
    report = None
    if parallel.rank == 0:
        layers = []
        for role in engine.plan[: cfg.n_layers]:
            work = layer_work(cfg, role, args.tokens, parallel.world)
            t = block_s.get(role.layer, 0.0)
            layers.append({"layer": role.layer, "role": role.label, "time_s": round(t, 5),
                           "roofline_fp8_s": work["roofline_fp8_s"], "roofline_fp32_s": work["roofline_fp32_s"],
                           "gflop_per_gpu": round(work["flops"] / 1e9, 3), "weight_mb_per_gpu": round(work["bytes"] / 1e6, 3),
                           "of_fp8_roofline": round(work["roofline_fp8_s"] / t, 4) if t else None})
        report = {"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                  "world": parallel.world, "tokens": args.tokens, "n_layers": cfg.n_layers, "smoke": args.smoke,
                  "share_gpus": args.share_gpus,
                  "prompt_s": round(prompt_s, 3), "layers": layers, "memory": memory,
                  "ops": type(engine.model.ops).__name__,
                  "json_layers": len(result.layers)}
    # click-to-view: the app's request for one layer through the service
    if parallel.rank == 0:
        report["click_to_view"] = _click_to_view(engine, parallel, ids, cfg, EngineService, make_server)
    else:
        follow(engine, parallel)
    parallel.barrier()
    parallel.close()
    return report


def _click_to_view(engine, parallel, ids, cfg, EngineService, make_server) -> dict:
    from explorer.remote import RemoteEngine
    try:
        from explorer import layer_views as lv
    except ImportError:  # a GPU box without the app's packages: time the service's answer alone
        lv = None

    service = EngineService(engine, parallel)
    server = make_server(service, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    service.start()
    out: dict = {"clicks": []}
    try:
        # as the app does: one run of every layer, kept on the service; each click fetches its layers
        client = RemoteEngine(f"http://127.0.0.1:{server.server_address[1]}")
        started = time.perf_counter()
        kept = client.run(ids)
        out.update(run_all_layers_s=round(time.perf_counter() - started, 3), engine_run_s=kept.time_s)
        reindex = [r.layer for r in engine.plan[: cfg.n_layers] if r.role == "reindex"]
        reuse = [r.layer for r in engine.plan[: cfg.n_layers] if r.role == "reuse" and r.index_source is not None]
        for layer in (reindex[:1] + reuse[-1:]):
            r = engine.plan[layer]
            asked = sorted({layer} | ({r.index_source} if r.index_source is not None else set()))
            started = time.perf_counter()
            run = kept.to_json(layers=asked)
            answered = time.perf_counter() - started
            if lv is not None:
                probe = lv.layer_probe(run, layer)
                model = lv.topk_model(run, probe)
                lv.topk_figure(model)
                lv.routing_heatmap(lv.routing_model(run, probe, cfg.n_routed_experts), run["tokens"])
            out["clicks"].append({"layer": layer, "layers_fetched": asked, "answer_s": round(answered, 3),
                        "view_s": round(time.perf_counter() - started, 3) if lv is not None else None,
                        "json_mb": round(len(json.dumps(run)) / 1e6, 2)})
    finally:
        server.shutdown()
        server.server_close()
        service.stop()  # tells the other ranks to stop following
    return out


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    report = rank_main(args)
    if report is not None:
        _emit(report, args)


def _emit(report: dict, args) -> None:
    print(f"{report['world']} x {report['device']}: {report['tokens']} tokens through {report['n_layers']} layers "
          f"in {report['prompt_s']:.2f} s")
    print(f"{'layer':>5}  {'role':<10} {'ms':>9} {'fp8 roofline ms':>16} {'fp32 roofline ms':>17} {'of fp8':>7}")
    for row in report["layers"]:
        frac = row["of_fp8_roofline"]
        print(f"{row['layer']:>5}  {row['role']:<10} {row['time_s'] * 1e3:>9.2f} {row['roofline_fp8_s'] * 1e3:>16.4f} "
              f"{row['roofline_fp32_s'] * 1e3:>17.4f} {'-' if frac is None else f'{frac:.1%}':>7}")
    for m in report["memory"]:
        peak = m.get("peak_allocated_bytes")
        print(f"rank {m['rank']}: weights {m['resident_weights_bytes'] / 1e9:.3f} GB resident"
              + (f", peak {peak / 1e9:.2f} GB of {m['total_bytes'] / 1e9:.0f} GB" if peak else "")
              + f", generated in {m['generate_s']:.1f} s")
    views = report["click_to_view"]
    print(f"the prompt through every layer via the service: {views['run_all_layers_s']:.2f} s "
          f"(engine {views['engine_run_s']:.2f} s); then each click fetches its layers' probes:")
    for c in views["clicks"]:
        print(f"click-to-view layer {c['layer']} (fetches {c['layers_fetched']}): answer {c['answer_s']:.2f} s, "
              + (f"view {c['view_s']:.2f} s, " if c['view_s'] is not None else "view not built (no plotly), ")
              + f"JSON {c['json_mb']} MB")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"written to {args.out}")


def _print_roofline(tokens: int, world: int) -> int:
    from engine.config import release_config
    from engine.roles import role_plan
    cfg = release_config()
    total8 = total32 = 0.0
    print(f"release prefill of {tokens} tokens on {world} H200 (ideal split): per-layer lower bounds")
    print(f"{'layer':>5}  {'role':<10} {'GFLOP/GPU':>10} {'weights MB/GPU':>15} {'fp8 ms':>8} {'fp32 ms':>8}")
    for role in role_plan(cfg)[: cfg.n_layers]:
        w = layer_work(cfg, role, tokens, world)
        total8 += w["roofline_fp8_s"]
        total32 += w["roofline_fp32_s"]
        print(f"{role.layer:>5}  {role.label:<10} {w['flops'] / 1e9:>10.1f} {w['bytes'] / 1e6:>15.1f} "
              f"{w['roofline_fp8_s'] * 1e3:>8.2f} {w['roofline_fp32_s'] * 1e3:>8.2f}")
    print(f"all {cfg.n_layers} layers: fp8 {total8 * 1e3:.1f} ms, fp32 {total32 * 1e3:.1f} ms")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="prompt length (default 4096; --smoke 96)")
    p.add_argument("--layers", type=int, default=None, help="run only the first N layers (default: all)")
    p.add_argument("--nproc", type=int, default=None, help="spawn N ranks here instead of using torchrun")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None)
    p.add_argument("--cache-gb", type=int, default=8, help="dequantized-weight cache per rank (GB)")
    p.add_argument("--kernels", choices=("auto", "on", "off"), default="auto",
                   help="the Triton kernel ops on each rank's stored shard (auto: on CUDA)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the 256-token warm-up run")
    p.add_argument("--smoke", action="store_true", help="tiny config, gloo on the CPU (2 ranks unless --nproc)")
    p.add_argument("--share-gpus", action="store_true", help="ranks share the GPUs (rank r on GPU r %% count, "
                   "gloo collectives): the kernel path of several ranks checked on one GPU; its times say nothing")
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--roofline", type=int, metavar="WORLD", help="only print the release roofline per layer for "
                   "WORLD GPUs (no run, no GPU needed)")
    args = p.parse_args(argv)
    if args.tokens is None:
        args.tokens = 96 if args.smoke else 4096
    if args.roofline:
        return _print_roofline(args.tokens, args.roofline)
    if args.smoke:
        args.warmup = False
    if "WORLD_SIZE" in os.environ:
        report = rank_main(args)
        if report is not None:
            _emit(report, args)
        return 0
    import torch.multiprocessing as mp
    world = args.nproc or (2 if args.smoke or args.share_gpus else torch.cuda.device_count())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(world, port, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
