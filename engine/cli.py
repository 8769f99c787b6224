"""`python -m engine <command>`: one argparse entry for every command: tally, inspect, skeleton, plan
(from a config or checkpoint headers), run and eval (a prompt or a text file through the engine),
serve (the engine over HTTP/JSON for the explorer). Training has its own: `python -m engine.train`.

Adding a command: its arguments and run functions here, and one `Command` in COMMANDS. `run(args)`
returns the exit code. User errors (bad config, bad checkpoint, bad arguments) print one line to
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import ConfigError, load_config
from .ops import DEFAULT_NUMERICS, NUMERICS
from .run.common import DEFAULT_CHECKPOINT, EngineError
from .safe_io import read_text
from .train import eval as evaluation  # (torch-free at import: its torch comes with the model)

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "assets" / "configs" / "v41-flash.json"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad command-line usage (reported in one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{self.prog}: {message} (see --help)")


# -- formatting -----------------------------------------------------------------------------------

def fmt_count(n: float) -> str:
    """12_345_678 -> '12.35 M'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g} B"


def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> str:
    right = set(range(1, len(headers))) if right is None else right
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- tally ----------------------------------------------------------------------------------------

def _tally_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", type=Path, help=f"config file (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})")
    src.add_argument("--checkpoint", type=Path, help="checkpoint folder (headers only)")
    p.add_argument("--context", type=int, help="also report cache bytes at this many tokens of context")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _run_tally(args: argparse.Namespace) -> int:
    from .checkpoint.inventory import checkpoint_config
    from .tally import cache_breakdown_at, tally_from_checkpoint, tally_from_config

    if args.context is not None and args.context < 0:
        raise UsageError("tally: --context must not be negative")
    if args.checkpoint is not None:
        t = tally_from_checkpoint(args.checkpoint)
        cfg = checkpoint_config(args.checkpoint)
        source = f"checkpoint headers: {args.checkpoint}"
    else:
        path = args.config or DEFAULT_CONFIG
        cfg = load_config(path)
        t = tally_from_config(cfg)
        source = f"config: {path}"
    cache = cache_breakdown_at(cfg, args.context) if args.context is not None else None
    if args.json:
        out = t.to_json()
        if cache is not None:
            out["cache"] = cache
        print(json.dumps(out, indent=1))
        return 0
    print(f"source: {source}")
    print(table(["box", "group", "dtype", "shape", "inst", "params/inst", "total params", "bytes", "active/gen",
                 "active/prompt"],
                [[r.name, r.group, r.fmt or r.dtype, "x".join(map(str, r.shape)), r.instances, fmt_count(r.params),
                  fmt_count(r.total_params), fmt_bytes(r.total_bytes), fmt_count(r.active_decode_params),
                  fmt_count(r.active_prefill_params)] for r in t.rows], right={4, 5, 6, 7, 8, 9}))
    print()
    groups = Counter()
    for r in t.rows:
        groups[r.group] += r.total_params
    print(table(["group", "params"], [[g, f"{n:,}"] for g, n in groups.items()]))
    print()
    figures = [
        ("all parameters", t.total_params), ("backbone (all but Engram tables and DSpark)", t.backbone_params),
        ("routed experts (backbone)", t.routed_expert_params), ("Engram tables", t.engram_params),
        ("DSpark (dense + routed)", t.dspark_params), ("  dense", t.dspark_dense_params),
        ("  routed", t.dspark_routed_params), ("vision tower + aligner", t.vision_params),
        ("active per generated token", t.active_decode_params), ("active per prompt token", t.active_prefill_params)]
    print(table(["figure", "parameters", ""], [[k, f"{v:,}", fmt_count(v)] for k, v in figures]))
    print()
    print(f"checkpoint: {t.tensor_count:,} tensors, {t.checkpoint_bytes:,} bytes ({fmt_bytes(t.checkpoint_bytes)})")
    print(table(["dtype", "bytes"], [[d, f"{b:,}"] for d, b in t.bytes_by_dtype.items()]))
    print()
    print(table(["KV source", "ratio", "entries/token", "entry B", "index key B", "B/token"],
                [[k.layer, k.ratio, f"{k.entries_per_token:g}", k.main_entry_bytes, k.index_key_bytes,
                  f"{k.bytes_per_token:g}"] for k in t.kv]))
    print(f"global KV per token: {t.kv_bytes_per_token:g} B; sliding window per layer: {t.window_bytes_per_layer:,} B")
    if cache is not None:
        print(f"cache at {cache['context_len']:,} tokens: global KV {fmt_bytes(cache['global_kv'])}, index keys "
              f"{fmt_bytes(cache['index_keys'])}, windows {fmt_bytes(cache['windows'])}, "
              f"total {cache['total']:,} B ({fmt_bytes(cache['total'])})")
    return 0


# -- inspect --------------------------------------------------------------------------------------

def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="checkpoint folder")
    p.add_argument("--config", type=Path, help="compare against this config instead of DIR/config.json")


def _run_inspect(args: argparse.Namespace) -> int:
    from .checkpoint.inventory import check_against_config, checkpoint_config, read_inventory

    inv = read_inventory(args.dir)
    cfg = load_config(args.config) if args.config else checkpoint_config(args.dir)
    print(f"checkpoint: {args.dir}  ({len(inv.shards)} shards, {len(inv):,} tensors, {inv.total_bytes:,} data bytes)")
    counts = inv.count_by_dtype()
    print(table(["dtype", "tensors", "bytes"], [[d, counts[d], f"{b:,}"] for d, b in inv.bytes_by_dtype().items()]))
    print()
    print(table(["shard", "tensors", "data bytes", "file size"],
                [[s.filename, s.n_tensors, f"{s.data_bytes:,}", fmt_bytes(s.size)] for s in inv.shards]))
    print()
    by_layer: Counter = Counter()
    n_layer: Counter = Counter()
    for e in inv.tensors.values():
        parts = e.name.split(".")
        key = f"{parts[0]}.{parts[1]}" if parts[0] in ("layers", "mtp") else parts[0]
        by_layer[key] += e.nbytes
        n_layer[key] += 1

    def order(k: str):
        p = k.split(".")
        return ({"layers": 1, "mtp": 2}.get(p[0], 0), int(p[1]) if len(p) > 1 else 0, k)
    print(table(["part", "tensors", "bytes"], [[k, n_layer[k], f"{by_layer[k]:,}"] for k in sorted(by_layer, key=order)]))
    problems = check_against_config(inv, cfg)
    print()
    if problems:
        print(f"{len(problems)} mismatches with the config:")
        for p in problems:
            print(f"  {p}")
        return 1
    print("matches the config's layout: every tensor present with the expected dtype and shape")
    return 0


# -- skeleton -------------------------------------------------------------------------------------

def _skeleton_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config file (default: the release)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--shards", type=int, default=None, help="number of shards (default: the release's plan)")


def _run_skeleton(args: argparse.Namespace) -> int:
    from .checkpoint.writer import write_skeleton

    cfg = load_config(args.config)
    out = write_skeleton(cfg, args.out, args.shards)
    files = sorted(out.glob("*.safetensors"))
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(getattr(f.stat(), "st_blocks", 0) * 512 for f in files)
    print(f"wrote {len(files)} sparse shards + index + config.json to {out}: "
          f"{fmt_bytes(apparent)} apparent, {fmt_bytes(on_disk)} on disk")
    return 0


# -- plan -----------------------------------------------------------------------------------------

def _plan_args(p: argparse.ArgumentParser) -> None:
    from .plan import ENGRAM_PLACES, GPUS, PlanInputs
    d = PlanInputs()
    p.add_argument("--config", type=Path, help="config file or checkpoint folder (default: the release)")
    p.add_argument("--gpu", default=d.gpu, choices=list(GPUS), help=f"GPU model (default {d.gpu})")
    for name, what in (("gpus", "GPU count"), ("ep", "expert-parallel degree (routed experts)"),
                       ("tp", "tensor-parallel degree (attention heads, vocabulary)"),
                       ("batch", "sequences decoded together"), ("context", "tokens of context per sequence"),
                       ("chunk", "prefill chunk in tokens")):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name), help=f"{what} (default {getattr(d, name)})")
    p.add_argument("--dp-attention", action="store_true", help="attention groups serve separate sequences")
    p.add_argument("--engram", default=d.engram, choices=ENGRAM_PLACES, help="where the Engram tables live")
    p.add_argument("--reserve", type=float, default=d.reserve, help=f"share of HBM kept for the runtime ({d.reserve})")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _run_plan(args: argparse.Namespace) -> int:
    from .plan import PlanError, PlanInputs, make_plan

    cfg = load_config(args.config or DEFAULT_CONFIG)
    inputs = PlanInputs(gpu=args.gpu, gpus=args.gpus, ep=args.ep, tp=args.tp, dp_attention=args.dp_attention,
                        batch=args.batch, context=args.context, engram=args.engram, chunk=args.chunk,
                        reserve=args.reserve)
    try:
        plan = make_plan(cfg, inputs)
    except PlanError as err:
        raise UsageError(f"plan: {err}") from None
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
        return 0
    m, i = plan.memory, inputs
    attention = "DP attention" if i.dp_attention else f"attention replicated over {i.groups} group(s)"
    print(f"{plan.gpu.name} x {i.gpus}: EP {i.ep}, TP {i.tp}, {attention}; batch {i.batch}, context {i.context:,}, "
          f"Engram tables on {i.engram}")
    rows = [[k, fmt_bytes(v)] for k, v in list(m.weights.items()) + list(m.caches.items()) if v]
    rows += [["activations (one prefill chunk)", fmt_bytes(m.activations["total"])], ["runtime reserve", fmt_bytes(m.reserve)],
             ["used / HBM", f"{fmt_bytes(m.used)} / {fmt_bytes(m.hbm)}"], ["free", fmt_bytes(m.free)]]
    print(table(["bytes per GPU", ""], rows))
    print(f"{'fits' if m.fits else 'DOES NOT FIT'}: {m.sequences_per_gpu} sequence(s) per GPU; largest batch at this "
          f"context {plan.largest_batch:,}; longest context at this batch {plan.largest_context:,}")
    for title, ph in (("decode step", plan.decode), (f"prefill chunk of {plan.prefill.tokens:,} ending at "
                                                     f"{plan.prefill.position:,}", plan.prefill)):
        print(f"\n{title}: {ph.time_s * 1e3:.3f} ms per GPU, limited by {ph.limit}")
        print(table(["role", "layers", "GFLOP", "HBM bytes", "link bytes", "us/layer", "limit"],
                    [[r.role, len(r.layers) or "-", f"{r.flops / 1e9:.2f}", fmt_bytes(r.hbm_bytes), fmt_bytes(r.link_bytes),
                      f"{r.time_s * 1e6:.1f}", r.limit] for r in ph.rows]))
        print("sent per GPU: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in ph.comm.items()) if ph.comm else
              "sent per GPU: nothing (one GPU)")
        if ph.fetch_s:
            print(f"Engram rows from {i.engram}: {ph.fetch_s * 1e3:.3f} ms (prefetched)")
    print(f"\nupper bounds: {plan.tokens_per_s:,.0f} generated tokens/s in all, {1 / plan.decode.time_s:,.1f} per "
          f"sequence; time to first token >= {plan.ttft_s:.3f} s for {i.context:,} prompt tokens")
    for note in plan.notes:
        print(f"note: {note}")
    return 0


# -- run ------------------------------------------------------------------------------------------

MAX_PROMPT_BYTES = 16 << 20   # far beyond any max_seq_len of text; a bigger file is the wrong file
MAX_GENERATE = 1 << 20        # a sane ceiling before the model's own max_seq_len check


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                   help="release-layout checkpoint folder (default: the shipped small model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    src.add_argument("--ids", help="comma-separated token ids instead of text (e.g. 0,523,77)")
    p.add_argument("--layer", type=int, action="append", help="layer to probe (repeatable; default: all)")
    p.add_argument("--generate", type=int, default=0, help="greedy tokens to generate after the prompt")
    p.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="reference: the official bf16 dtype flow (default); fp32: float32 between every op")
    p.add_argument("--image-span", action="append", default=[], metavar="START:END",
                   help="mark token positions START..END-1 as image positions (routes with bias_vl)")
    p.add_argument("--json", dest="json_out", help="write the probes as JSON to this file ('-' for stdout)")
    p.add_argument("--prefill", choices=("full", "ced"), default="full",
                   help="full: every layer over the prompt (the reference); ced: the encoder over the prompt, "
                        "the decoder over only its last --replay tokens")
    p.add_argument("--replay", type=int, help="ced: prompt tokens the decoder runs on (default: the window size)")


def _spans(values: list[str]) -> list[tuple[int, int]]:
    spans = []
    for v in values:
        try:
            a, b = (int(x) for x in v.split(":"))
        except ValueError:
            raise EngineError(f"--image-span {v!r}: expected START:END, e.g. 10:20") from None
        spans.append((a, b))
    return spans


def _run(args: argparse.Namespace) -> int:
    try:
        if args.generate < 0 or args.generate > MAX_GENERATE:
            raise EngineError(f"--generate must be 0..{MAX_GENERATE:,} (and the prompt plus the generated tokens "
                              "must fit in the model's max_seq_len)")
        if args.prompt_file:
            prompt = read_text(args.prompt_file, "prompt file", MAX_PROMPT_BYTES, EngineError,
                               missing="cannot read the prompt file (no such file)")
        elif args.ids is not None:
            try:
                prompt = [int(v) for v in args.ids.split(",") if v.strip()]
            except ValueError:
                raise EngineError(f"--ids {args.ids!r}: expected comma-separated integers") from None
        else:
            prompt = args.prompt
        from .run.api import load  # (torch comes with the model, not with the CLI)
        engine = load(args.checkpoint, numerics=args.numerics)
        result = engine.run(prompt, layers=args.layer, image_spans=_spans(args.image_span), generate=args.generate,
                            prefill=args.prefill, replay=args.replay)
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json_out:
        text = json.dumps(result.to_json())
        if args.json_out == "-":
            print(text)
            return 0
        Path(args.json_out).write_text(text)
    rows = []
    for L, lr in sorted(result.layers.items()):
        sel = "-" if lr.topk is None else f"{int((lr.topk[-1] >= 0).sum())} of {lr.n_entries}"
        experts = " ".join(str(e) for e in lr.routing["experts"][-1].tolist()) if lr.routing else "-"
        rows.append([L, lr.label, lr.kv_source if lr.kv_source is not None else "-",
                     lr.index_source if lr.index_source is not None else "-", sel, experts, f"{lr.time_s * 1e3:.1f}"])
    print(f"{len(result.token_ids)} tokens through {engine.cfg.n_layers} layers in {result.time_s:.2f} s "
          f"({engine.source}, {result.numerics} numerics)")
    if result.prefill == "ced":
        print(f"prefill: ced, the decoder over the last {min(result.replay, len(result.token_ids))} prompt tokens "
              f"({result.prefill_s:.2f} s)")
    print(table(["layer", "role", "KV from", "top-k from", "last token selects", "last token experts", "ms"], rows))
    cache = result.cache_bytes
    print(f"cache held: global {fmt_bytes(cache['global'])} (formula {fmt_bytes(result.kv_bytes_formula)}), "
          f"windows {fmt_bytes(cache['window'])}")
    if result.generated_ids:
        print(f"generated: {result.generated_text!r}")
    if args.json_out and args.json_out != "-":
        print(f"probes written to {args.json_out}")
    return 0


# -- serve ----------------------------------------------------------------------------------------
# One process:          python -m engine serve --checkpoint DIR
# Several (one a GPU):  torchrun --standalone --nproc-per-node 8 -m engine serve --checkpoint DIR
# Rank 0 answers HTTP; every rank loads only its shard and computes its part of each run.

def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                   help="release-layout checkpoint folder (default: the shipped small model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--per-client", type=int, default=4,
                   help="runs one client may have waiting at once (default 4)")
    p.add_argument("--max-generate", type=int, default=None,
                   help="tokens one request may generate (default 1024, and never past the model's max_seq_len)")
    p.add_argument("--run-timeout", type=float, default=None,
                   help="seconds a client waits for its run before a 504 (default 600)")
    p.add_argument("--read-timeout", type=float, default=None,
                   help="seconds a connection may stay silent before it is closed (default 30)")
    p.add_argument("--numerics", choices=NUMERICS, default=DEFAULT_NUMERICS,
                   help="reference: the official bf16 dtype flow (default); fp32: float32 between every op")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="torch.distributed backend under torchrun "
                   "(default: nccl with GPUs, gloo without)")
    p.add_argument("--verbose", action="store_true", help="log every request on stderr")


def _serve(args: argparse.Namespace) -> int:
    from .serve.parallel import Parallel, ParallelError
    from .serve.service import EngineService, follow, host_warning, make_server

    from .serve.service import MAX_GENERATE, READ_TIMEOUT_S, RUN_TIMEOUT_S

    max_generate = MAX_GENERATE if args.max_generate is None else args.max_generate
    run_timeout = RUN_TIMEOUT_S if args.run_timeout is None else args.run_timeout
    read_timeout = READ_TIMEOUT_S if args.read_timeout is None else args.read_timeout
    for bad, message in ((args.per_client < 1 or args.per_client > 1000, "--per-client must be 1..1000"),
                         (not 0 <= max_generate <= 1 << 20, "--max-generate must be 0..1048576"),
                         (not 1 <= run_timeout <= 86400, "--run-timeout must be 1..86400 seconds"),
                         (not 1 <= read_timeout <= 3600, "--read-timeout must be 1..3600 seconds"),
                         (not 0 <= args.port <= 65535, "--port must be 0..65535")):
        if bad:
            print(f"error: {message}", file=sys.stderr)
            return 2
    parallel = None
    try:
        parallel = Parallel.from_env(args.backend)
        engine = _load(args.checkpoint, parallel, args.numerics)
    except (EngineError, ParallelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if parallel is not None and parallel.rank != 0:
        follow(engine, parallel)
        parallel.close()
        return 0
    service = EngineService(engine, parallel, per_client=args.per_client, max_generate=max_generate,
                            run_timeout=run_timeout)
    try:
        server = make_server(service, args.host, args.port, args.verbose, read_timeout)
    except OSError as err:
        print(f"error: cannot listen on {args.host}:{args.port} ({err.strerror or err})", file=sys.stderr)
        if parallel is not None:  # release the other ranks
            service.start()
            service.stop()
        return 2
    warning = host_warning(args.host)
    if warning:
        print(warning, file=sys.stderr)
    host, port = server.server_address[:2]
    world = 1 if parallel is None else parallel.world
    print(f"engine service on http://{host}:{port} ({engine.source}, {engine.numerics} numerics, "
          f"{world} process{'es' if world > 1 else ''}); "
          "Ctrl-C stops it", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    service.start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.stop()
        if parallel is not None:
            parallel.close()
    return 0


def _interrupt(*_):
    raise KeyboardInterrupt  # SIGTERM stops the service like Ctrl-C


def _load(path: str, parallel, numerics: str):
    from .run.api import load
    if parallel is None:
        return load(path, numerics=numerics)
    return load(path, parallel=parallel, numerics=numerics)


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("tally", "parameters, bytes and KV figures from a config or checkpoint headers", _tally_args, _run_tally),
    Command("inspect", "inventory a checkpoint folder and list mismatches with its config", _inspect_args, _run_inspect),
    Command("skeleton", "write the full layout as sparse files (headers only)", _skeleton_args, _run_skeleton),
    Command("plan", "bytes per GPU, largest batch and context, roofline per role for a serving layout",
            _plan_args, _run_plan),
    Command("run", "run a prompt through the engine and print (or save) the probes", _run_args, _run),
    Command("eval", "mean next-token loss and perplexity of a checkpoint on a text file", evaluation.add_arguments,
            evaluation.run),
    Command("serve", "serve the engine over HTTP/JSON for the explorer (see engine/serve/service.py)",
            _serve_args, _serve),
)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description="DeepSeek-V4.1-Flash explorer engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=command.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    from .checkpoint.inventory import CheckpointError

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return 2
        return COMMANDS[args.command].run(args)
    except (UsageError, CheckpointError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130

