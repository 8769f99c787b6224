"""A CED-aware prefill and a probed decode, beside the reference's full prefill.

In V4.1-Flash the decoder's global KV is layer 20's projection of the encoder's output (the first
Full layer with compress ratio 1, `roles.decoder_start`), so a prompt token needs only layers 0-19
and layer 20's compressor and index keys. The decoder layers also have sliding windows, which a
generated token fills with the decoder's states of the last prompt tokens: a serving prefill must
replay a bounded tail of the prompt through the decoder. `prefill="ced"` does exactly that: layers
0..19 and layer 20's KV/index-key projection over the whole prompt, the decoder's blocks (layer 20's
attention onward) over the last `replay` prompt tokens only, whose windows fill from that replay.
With replay >= the prompt length it is the full prefill.

The mechanics live in `Model.run_chunk(decoder_from=...)`; this module checks the request and runs
the decode loop with probes at the generated tokens (what the explorer and the bench compare).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .pipeline import join_probes
from ..roles import decoder_start, role_plan

PREFILLS = ("full", "ced")


class PrefillError(ValueError):
    """A prefill request the model cannot run; the message says why."""


def check(cfg: ModelConfig, prefill: str, replay) -> int | None:
    """The replay length for a prefill request (None for "full"); default: the window size."""
    if prefill not in PREFILLS:
        raise PrefillError(f"prefill must be one of {list(PREFILLS)}, got {prefill!r}")
    if prefill == "full":
        if replay is not None:
            raise PrefillError("replay applies only to prefill='ced'")
        return None
    split = decoder_start(cfg)
    if split >= cfg.n_layers:
        raise PrefillError("this model has no decoder half (no KV source with compress ratio 1): "
                           "a CED prefill needs one")
    for role in role_plan(cfg)[split:cfg.n_layers]:
        if role.kv_source is not None and role.kv_source < split:
            raise PrefillError(f"layer {role.layer} reads the encoder's KV source {role.kv_source}: a CED "
                               "prefill needs every decoder layer to read the decoder's own sources")
    if replay is None:
        return cfg.window_size
    if isinstance(replay, bool) or not isinstance(replay, int) or replay < 1:
        raise PrefillError(f"replay must be a whole number of prompt tokens >= 1, got {replay!r}")
    return replay


def decoder_from(n_prompt: int, replay: int | None) -> int | None:
    """First prompt position the decoder runs on (None: all of them)."""
    if replay is None or replay >= n_prompt:
        return None
    return n_prompt - replay


def decode(model, logits: torch.Tensor, steps: int, device, eos_id: int | None = None,
           continuation: list[int] | None = None, probes=None) -> tuple[list[int], dict]:
    """Greedy decode after a prefill whose last logits row is `logits[-1]`.

    Each step picks the argmax and feeds it (or, with `continuation`, feeds that step's given token:
    a teacher-forced decode, so two prefills can be compared on the same tokens). Stops after
    `steps` tokens, or after an end-of-sequence pick when decoding greedily.
    Returns (the picks, {layer: probes over the fed tokens' rows} when `probes` asks for some)."""
    picks: list[int] = []
    collected: dict = {}
    for step in range(steps):
        pick = int(logits[-1].argmax())
        picks.append(pick)
        if continuation is None and eos_id is not None and pick == eos_id:
            break
        fed = pick if continuation is None else int(continuation[step])
        got: dict | None = {} if probes is not None else None
        logits = model.forward(torch.tensor([fed], device=device), probes=probes, collect=got)
        for layer, probe in (got or {}).items():
            collected[layer] = probe if layer not in collected else join_probes(collected[layer], probe)
    return picks, collected
