"""Runs the engine on a written checkpoint in N gloo processes (tests/test_engine_parallel.py).

python -m tests.parallel_workers CHECKPOINT OUT.pt WORLD|single IDS_CSV [kernels]
Each rank loads only its shard (ShardedWeights over the checkpoint); rank 0 saves, for activations
in float and FP8-rounded (the release's kernels), the run's JSON and the prefill logits, plus what
each rank read. With `kernels`: the kernel ops (engine/ops/triton.py; on the CPU the kernels' own
references) on each rank's stored slices, FP8-rounded activations only (the kernels' inputs).
`single`: the single-process runs (`reference`) in this process, saved the same way. FP8 rounding turns
the all_reduce's different summation order (~1e-7) into an occasional rounding flip (~1e-3 downstream),
so exact agreement is checked without it.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_engine(checkpoint: str, parallel=None, act_quant: bool = False, kernels: bool = False):
    """The engine over the checkpoint (sharded when `parallel` is given), with the stand-in
    tokenizer the tiny configs' Engram needs; `kernels`: the kernel ops, on stored slices per rank."""
    from engine.run.api import Engine
    from engine.checkpoint.inventory import checkpoint_config
    from engine.checkpoint.reader import CheckpointReader
    from engine.serve.parallel import ShardedWeights
    from engine.checkpoint.weights import CheckpointWeights
    from tests.engine_helpers import IdentityTokenizer

    cfg = checkpoint_config(checkpoint)
    weights = CheckpointWeights(CheckpointReader(checkpoint, cfg))
    if parallel is not None:
        weights = ShardedWeights(weights, parallel, cfg, stored_formats=kernels)
    # fp32 numerics: each rank's partial sums are added before any rounding; under reference numerics a
    # rank would round its partial GEMM outputs to bf16 first, so the two layouts could not agree exactly
    return Engine(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), source=checkpoint,
                  identity="test", parallel=parallel, act_quant=act_quant, numerics="fp32", kernels=kernels)


def one_run(engine, ids: list[int]) -> dict:
    """The run's JSON (with 3 generated tokens) and the prefill logits."""
    result = engine.run(ids, generate=3, image_spans=[(5, 9)]).to_json()
    with torch.inference_mode():
        engine.model.reset()
        logits = engine.model.forward(torch.tensor(ids))
    return {"json": result, "logits": logits}


def modes(kernels: bool) -> tuple[bool, ...]:
    """Activation rounding off and on; the kernels take FP8-rounded activations only."""
    return (True,) if kernels else (False, True)


def reference(checkpoint: str, ids: list[int], kernels: bool = False) -> dict:
    """The single-process runs, activations in float and FP8-rounded."""
    return {quantized: one_run(build_engine(checkpoint, act_quant=quantized, kernels=kernels), ids)
            for quantized in modes(kernels)}


def _rank(rank: int, world: int, port: int, checkpoint: str, out: str, ids: list[int], kernels: bool) -> None:
    from engine.serve.parallel import Parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel = Parallel(rank, world)
    runs = {}
    for quantized in modes(kernels):
        engine = build_engine(checkpoint, parallel, act_quant=quantized, kernels=kernels)
        runs[quantized] = one_run(engine, ids)
    read = parallel.gather_objects(engine.model.weights.bytes_read)
    runs["ops"] = type(engine.model.ops).__name__
    if rank == 0:
        torch.save({**runs, "bytes_read": read}, out)
    parallel.close()


def main(argv: list[str]) -> int:
    checkpoint, out, ids = argv[0], argv[1], [int(v) for v in argv[3].split(",")]
    kernels = argv[4:] == ["kernels"]
    if argv[2] == "single":
        torch.save(reference(checkpoint, ids, kernels), out)
        return 0
    world = int(argv[2])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(world, free_port(), checkpoint, out, ids, kernels), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
