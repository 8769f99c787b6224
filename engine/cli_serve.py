"""`python -m engine serve`: the engine as an HTTP/JSON service the explorer can attach to.

One process:          python -m engine serve --checkpoint DIR
Several (one a GPU):  torchrun --standalone --nproc-per-node 8 -m engine serve --checkpoint DIR
Rank 0 answers HTTP; every rank loads only its shard and computes its part of each run.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .__main__ import Command
from .api import DEFAULT_CHECKPOINT, EngineError


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                   help="release-layout checkpoint folder (default: the shipped small model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--per-client", type=int, default=4,
                   help="runs one client may have waiting at once (default 4)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="torch.distributed backend under torchrun "
                   "(default: nccl with GPUs, gloo without)")
    p.add_argument("--verbose", action="store_true", help="log every request on stderr")


def _serve(args: argparse.Namespace) -> int:
    from .parallel import Parallel, ParallelError
    from .serve import EngineService, follow, host_warning, make_server

    if args.per_client < 1:
        print("error: --per-client must be at least 1", file=sys.stderr)
        return 2
    parallel = None
    try:
        parallel = Parallel.from_env(args.backend)
        engine = _load(args.checkpoint, parallel)
    except (EngineError, ParallelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if parallel is not None and parallel.rank != 0:
        follow(engine, parallel)
        parallel.close()
        return 0
    service = EngineService(engine, parallel, per_client=args.per_client)
    try:
        server = make_server(service, args.host, args.port, args.verbose)
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
    print(f"engine service on http://{host}:{port} ({engine.source}, {world} process{'es' if world > 1 else ''}); "
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


def _load(path: str, parallel):
    from .api import load
    if parallel is None:
        return load(path)
    return load(path, parallel=parallel)


COMMANDS = [Command("serve", "serve the engine over HTTP/JSON for the explorer (see engine/serve.py)",
                    _serve_args, _serve)]
