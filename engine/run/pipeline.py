"""Prefill on two CPU threads as a wavefront.

The prompt is cut in two chunks. The caller's thread runs the first chunk through all layers; a
second thread runs the second chunk one layer behind: it starts layer L only once the first chunk
has finished layer L, so every cache it reads (window, compressed KV, index keys) is complete and in
position order, exactly as when the chunks run one after the other (prefill and decode share this
chunked path). The result equals a one-thread prefill up to float summation order.

Why threads over chunks rather than torch's intra-op threads: the threads meet only 40 times per
prefill (once per layer), so a busy machine costs at worst the speed of one thread; intra-op threads
meet at every op (~10k per prefill), and with another process on the second core each meeting can
wait a scheduler slice (a 2,048-token prefill took 15x longer).
"""

from __future__ import annotations

import threading

import torch

from ..model.attention import NEG_INF

MIN_TOKENS = 768      # below this the second thread does not pay for itself (measured: 512 tokens break even)
FIRST_SHARE = 0.5     # measured: the first chunk is no cheaper per token (the indexer scores only visible entries)
PAD = {"topk": -1, "topk_scores": NEG_INF, "candidate_pool": False, "topk_tied": False}


class Aborted(RuntimeError):
    """The other chunk's thread failed; its own error is the one to report."""


class LayerGate:
    """What one chunk's thread waits on before each layer and signals after it."""

    def __init__(self, n_layers: int, previous: "LayerGate | None", abort: threading.Event):
        self.finished = [threading.Event() for _ in range(n_layers)]
        self.previous, self.abort = previous, abort

    def wait(self, layer: int) -> None:
        if self.previous is None:
            return
        while not self.previous.finished[layer].wait(timeout=0.05):
            if self.abort.is_set():
                raise Aborted("the other prefill chunk failed")

    def done(self, layer: int) -> None:
        self.finished[layer].set()


def usable(model, ids: torch.Tensor) -> bool:
    """The wavefront runs the CPU ops of one process (not the kernel ops), for prompts worth splitting."""
    return (ids.device.type == "cpu" and ids.shape[0] >= MIN_TOKENS and model.parallel is None
            and not model.ops.kernels)


def prefill(model, ids: torch.Tensor, image_mask: torch.Tensor | None, probes=None,
            collect: dict | None = None, decoder_from: int | None = None) -> torch.Tensor:
    """`model.forward(ids, ...)` for a prompt, on two threads. Returns logits [T, vocab]
    (decoder_from, a CED prefill: only the rows from that position on, see Model.run_chunk)."""
    T = ids.shape[0]
    cut = max(1, min(T - 1, round(T * FIRST_SHARE)))
    dead = image_mask if image_mask is not None else torch.zeros(T, dtype=torch.bool)
    history = (model.compressed_history, model.dead_history)
    second_history = model.history_after(ids[:cut], dead[:cut])
    abort = threading.Event()
    first_gate = LayerGate(model.cfg.n_layers, None, abort)
    second_gate = LayerGate(model.cfg.n_layers, first_gate, abort)
    collected: list[dict] = [{}, {}]
    outputs: list = [None, None]
    inference = torch.is_inference_mode_enabled()
    grad = torch.is_grad_enabled()

    def run_second():
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                outputs[1] = model.run_chunk(ids[cut:], model.pos + cut, _part(image_mask, cut, None), second_history,
                                             probes, collected[1], gate=second_gate, decoder_from=decoder_from)
        except BaseException as err:  # handed to the caller's thread below
            outputs[1] = err
            abort.set()

    worker = threading.Thread(target=run_second, name="prefill-second-chunk", daemon=True)
    worker.start()
    try:
        outputs[0] = model.run_chunk(ids[:cut], model.pos, _part(image_mask, 0, cut), history, probes,
                                     collected[0], gate=first_gate, decoder_from=decoder_from)
    except BaseException:
        abort.set()
        raise
    finally:
        worker.join()
    if isinstance(outputs[1], BaseException):
        raise outputs[1]
    model.remember(ids, dead)
    if collect is not None:
        for layer in sorted(collected[0].keys() | collected[1].keys()):  # a CED chunk may skip decoder layers
            parts = [c[layer] for c in collected if layer in c]
            collect[layer] = parts[0] if len(parts) == 1 else join_probes(*parts)
    return torch.cat(outputs)


def _part(mask: torch.Tensor | None, start: int, stop: int | None):
    return None if mask is None else mask[start:stop]


def join_probes(first, second, key: str | None = None):
    """One layer's probes of two consecutive chunks -> the probes of the whole prompt: per-token
    tensors stacked (rows of the narrower chunk padded where the first chunk saw fewer entries),
    times added, the entry count of the later chunk."""
    if isinstance(first, dict):
        return {k: join_probes(first[k], second[k], k) for k in first}
    if torch.is_tensor(first):
        if first.shape[1:] != second.shape[1:]:
            first, second = _pad_last(first, second.shape[-1], PAD[key]), _pad_last(second, first.shape[-1], PAD[key])
        return torch.cat([first, second])
    if key == "time_s":
        return first + second
    return second


def _pad_last(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[-1] >= width:
        return t
    out = t.new_full((*t.shape[:-1], width), value)
    out[..., :t.shape[-1]] = t
    return out
