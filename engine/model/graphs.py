"""Piecewise CUDA graphs for the decode step: the parts of each layer without caches, recorded once and replayed.

A one-token decode step on a GPU is bound by the host: each layer launches dozens of small kernels (the mHC,
the norms, the projections, the router, the routed and shared experts), each paying Python's and the
driver's launch. The parts of a layer that read no cache have the same shapes at every step: Block.mix_in
(the mHC collapse and RMSNorm before the attention), Block.ffn_half (everything after it), and inside the
attention its `queries`, `window_entries` and `output` and the indexer's `queries`. Each is recorded as a
CUDA graph and replayed; what reads or grows a cache (the window, the compressor, the indexer's scores and
top-k, the sparse attention) runs eagerly between them, as do the Engram's host lookups (the piecewise graphs
of serving engines). benches/release_layer.py --graph records a whole layer's step instead: a bench, its
caches frozen.

One piece (layer, part, input shapes) goes through three stages. Its first call runs it as it is (the
weights' lazy forms, the kernels' compiles and the one-time host checks happen there). Its second runs it
with the capture-safe forms (engine/capture.py) while CUDA refuses every host read: a piece that still reads
the host stays eager from then on, the reason kept in `refused`; otherwise it is recorded. Every later call
copies its inputs into the graph's own, replays it and hands out copies of the outputs (a replay rewrites
them). A graph reads everything by address: its inputs and outputs are held here; the pieces read nothing
else but weights, which the GPU weight sources and the ops keep for the model's life (a weight dequantized
per call is dequantized inside the recorded piece, so each replay makes it again; nothing is cached on the
layer objects, which a reset replaces).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..capture import branch_free

DECODE_ROWS = 1  # the chunks the graphs take: one token (a decode step); a prompt runs as it is


class DecodeGraphs:
    """The recorded pieces of one model's blocks on one GPU, passed to Block.forward as `pieces`.
    `replays` and `recorded` count (benches, tests); `refused` says why a piece stays eager."""

    def __init__(self, device, forget=None):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.device = device  # "cuda" without an index: the current device's tensors
        self.forget = forget  # called after a recording: drop what the model memoized during it
        self.pool = None  # one memory pool for every graph (they replay one at a time, in one stream)
        self.graphs: dict[tuple, _Recorded] = {}
        self.seen: set[tuple] = set()
        self.refused: dict[tuple, str] = {}
        self.replays = 0

    def _here(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" and (self.device.index is None or t.device.index == self.device.index)

    @property
    def recorded(self) -> int:
        return len(self.graphs)

    def __call__(self, layer: int, name: str, method, *args):
        if not all(a is None or isinstance(a, torch.Tensor) and self._here(a) for a in args):
            return method(*args)  # a probe's dict (or a tensor elsewhere): this call as it is
        key = (layer, name, tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args))
        recorded = self.graphs.get(key)
        if recorded is not None:
            self.replays += 1
            return recorded.replay(args)
        if key in self.refused or key not in self.seen:
            self.seen.add(key)
            return method(*args)
        return self._record(key, method, args)

    def _record(self, key, method, args):
        """The second call of a piece: checked for host reads, then recorded; returns this call's outputs."""
        try:
            with branch_free(), host_reads_refused():
                out = method(*args)
        except RuntimeError as err:
            if "synchronizing" not in str(err):
                raise
            self.refused[key] = f"reads the host: {str(err).splitlines()[0][:200]}"
            return method(*args)
        inputs = [None if a is None else a.clone() for a in args]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = method(*inputs)
        except RuntimeError as err:  # a capture CUDA refuses (e.g. a copy from pageable host memory)
            self.refused[key] = f"capture failed: {str(err).splitlines()[0][:200]}"
            return out
        finally:
            if self.forget is not None:
                self.forget()
        self.pool = graph.pool()
        self.graphs[key] = _Recorded(graph, inputs, outputs)
        return out


def called(layer: int, name: str, method, *args):
    """The plain `pieces`: the part called as it is."""
    return method(*args)


class _Recorded:
    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs

    def replay(self, args):
        for held, given in zip(self.inputs, args):
            if held is not None:
                held.copy_(given)
        self.graph.replay()
        if isinstance(self.outputs, torch.Tensor):
            return self.outputs.clone()
        return tuple(t.clone() for t in self.outputs)


@contextmanager
def host_reads_refused():
    """CUDA's sync debug mode at "error": a host read of device values raises (RuntimeError) instead of waiting."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)
