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
from .run.api import DEFAULT_CHECKPOINT, EngineError


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
        engine = _load(args.checkpoint, parallel)
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
    from .run.api import load
    if parallel is None:
        return load(path)
    return load(path, parallel=parallel)


COMMANDS = [Command("serve", "serve the engine over HTTP/JSON for the explorer (see engine/serve/service.py)",
                    _serve_args, _serve)]
