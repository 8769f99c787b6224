"""Two prompts compared token by token after aligning them: a diff of the two token sequences
(difflib) pairs up the tokens both prompts share, so a two-token edit shifts nothing and is not read
as "differs at 137 of 201 positions".

Selections are compared in token space: each query's picks become the prompt positions their
entries cover (entry j of ratio m covers tokens j*m .. j*m+m-1), B's positions are mapped back to A's
through the alignment, and the two sets are compared only at query pairs the alignment matched.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping


class AlignError(ValueError):
    """The runs cannot be aligned as asked; the message says why."""


@dataclass
class Alignment:
    pairs: list[tuple[int, int]]          # (position in A, position in B) of tokens both share, in order
    only_a: list[int]                     # A's positions with no partner (deleted or replaced)
    only_b: list[int]                     # B's positions with no partner (inserted or replaced)
    edits: list[tuple[str, int, int, int, int]]   # difflib opcodes other than "equal": (tag, a0, a1, b0, b1)

    @property
    def b_to_a(self) -> dict[int, int]:
        return {b: a for a, b in self.pairs}


def align_tokens(a: list[str], b: list[str]) -> Alignment:
    """Match the token sequences (no junk heuristic: a long prompt's common tokens must still match)."""
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    pairs, only_a, only_b, edits = [], [], [], []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(range(a0, a1), range(b0, b1)))
        else:
            only_a.extend(range(a0, a1))
            only_b.extend(range(b0, b1))
            edits.append((tag, a0, a1, b0, b1))
    return Alignment(pairs, only_a, only_b, edits)


@dataclass
class AlignedSelections:
    alignment: Alignment
    layer: int
    compared: int                 # aligned query pairs where both runs picked something
    differ: list[int]             # A positions of aligned queries whose picks (in token space) differ
    jaccard: float | None         # mean over the compared queries
    only_a_tokens: int            # tokens of A with no partner in B
    only_b_tokens: int
    routing_jaccard: float | None = None   # mean overlap of the routed experts at the aligned token pairs


def _covered(row, ratio: int, T: int) -> set[int]:
    out = set()
    for j in row or []:
        if j is not None and int(j) >= 0:
            out.update(range(int(j) * ratio, min(int(j) * ratio + ratio, T)))
    return out


def _layer(run: Mapping[str, Any], layer: int) -> Mapping[str, Any]:
    layers = run.get("layers") or {}
    probe = layers.get(str(layer), layers.get(layer))
    if probe is None:
        raise AlignError(f"the run has no probes for layer {layer}")
    return probe


def aligned_selections(run_a: Mapping[str, Any], run_b: Mapping[str, Any], layer: int) -> AlignedSelections:
    """Compare the picks of `layer` in two runs at the query pairs the token alignment matched."""
    tokens_a, tokens_b = list(run_a.get("tokens") or []), list(run_b.get("tokens") or [])
    al = align_tokens(tokens_a, tokens_b)
    pa, pb = _layer(run_a, layer), _layer(run_b, layer)
    topk_a, topk_b = pa.get("topk"), pb.get("topk")
    if topk_a is None or topk_b is None:
        raise AlignError(f"layer {layer} recorded no selections in {'A' if topk_a is None else 'B'}")
    ma, mb = int(pa.get("compress_ratio") or 1), int(pb.get("compress_ratio") or 1)
    b_to_a = al.b_to_a
    differ, scores = [], []
    for qa, qb in al.pairs:
        sa = _covered(topk_a[qa], ma, len(tokens_a))
        sb = {b_to_a.get(t, -1 - t) for t in _covered(topk_b[qb], mb, len(tokens_b))}   # unmatched: never equal
        if not sa and not sb:
            continue
        scores.append(len(sa & sb) / len(sa | sb))
        if sa != sb:
            differ.append(qa)
    return AlignedSelections(al, layer, len(scores), differ, sum(scores) / len(scores) if scores else None,
                             len(al.only_a), len(al.only_b), _routing_overlap(pa, pb, al))


def _routing_overlap(pa: Mapping[str, Any], pb: Mapping[str, Any], al: Alignment) -> float | None:
    ea, eb = (pa.get("routing") or {}).get("experts"), (pb.get("routing") or {}).get("experts")
    if not ea or not eb or not al.pairs:
        return None
    total = 0.0
    for qa, qb in al.pairs:
        sa, sb = set(ea[qa]), set(eb[qb])
        total += len(sa & sb) / len(sa | sb) if sa | sb else 1.0
    return total / len(al.pairs)


def aligned_summary(res: AlignedSelections) -> list[str]:
    """Lines for the side-by-side: what the alignment matched, then how the picks compare."""
    al = res.alignment
    lines = [f"Token alignment: {len(al.pairs):,} tokens in both prompts, {res.only_a_tokens:,} only in A, "
             f"{res.only_b_tokens:,} only in B ({len(al.edits)} edit{'s' if len(al.edits) != 1 else ''})."]
    if res.compared:
        lines.append(f"Layer {res.layer}: over {res.compared:,} aligned queries the picks (as prompt tokens) overlap "
                     f"{100 * res.jaccard:.0f}% on average (Jaccard); identical at {res.compared - len(res.differ):,}.")
    else:
        lines.append(f"Layer {res.layer}: no aligned query picked anything in both runs.")
    if res.routing_jaccard is not None:
        lines.append(f"Routed experts at the aligned tokens overlap {100 * res.routing_jaccard:.0f}% on average.")
    return lines


def edits_text(al: Alignment, tokens_a: list[str], tokens_b: list[str], limit: int = 5) -> list[str]:
    """The first few edits in words: `replaced 'cat' (A 12) with 'dog' (B 12)`."""
    out = []
    for tag, a0, a1, b0, b1 in al.edits[:limit]:
        ta, tb = "".join(tokens_a[a0:a1]), "".join(tokens_b[b0:b1])
        if tag == "replace":
            out.append(f"replaced {ta!r} (A {a0}-{a1 - 1}) with {tb!r} (B {b0}-{b1 - 1})")
        elif tag == "delete":
            out.append(f"removed {ta!r} (A {a0}-{a1 - 1})")
        else:
            out.append(f"inserted {tb!r} (B {b0}-{b1 - 1}, after A {a0 - 1})")
    if len(al.edits) > limit:
        out.append(f"… and {len(al.edits) - limit} more")
    return out
