"""On-request probes of one selection layer (ProbeRequest.detail): how good its top-k is.

- runner-ups: the best entries the indexer did NOT pick, with their scores, so a view can show how
  close the k-th pick was to the (k+1)-th;
- selection recall: the share of the attention mass the layer's own queries would put on their
  selected entries if they attended to every visible compressed entry (softmax over the visible
  entries only: no window, no sink), averaged over heads.

Both cost a [queries, entries] pass per head, so they run only for the layers asked for.
"""

from __future__ import annotations

import torch

RUNNER_UPS = 8      # unselected entries kept per query, best first
RECALL_BLOCK = 256  # queries at once: bounds memory at [block, heads, entries]


def runner_ups(scores: torch.Tensor, picks: torch.Tensor, r: int = RUNNER_UPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The r best unpicked entries per query, best first (ties: lower position first).
    scores [B, W] with invisible entries at -inf; picks [B, k] entry ids, -1 padded.
    Returns (entries long [B, r], -1 padded; scores float [B, r], -inf padded)."""
    s = scores.detach().float().clone()
    width = s.shape[-1]
    if picks.numel():
        valid = (picks >= 0) & (picks < width)
        rows = torch.arange(s.shape[0], device=s.device)[:, None].expand_as(picks)
        s[rows[valid], picks[valid]] = float("-inf")
    if width < r:
        s = torch.nn.functional.pad(s, (0, r - width), value=float("-inf"))
    # a stable descending sort puts equal scores in position order
    values, order = torch.sort(s, dim=-1, descending=True, stable=True)
    values, order = values[:, :r], order[:, :r]
    missing = ~torch.isfinite(values)
    return order.masked_fill(missing, -1), values.masked_fill(missing, float("-inf"))


def selection_recall(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, picks: torch.Tensor,
                     parallel=None, n_heads: int | None = None) -> torch.Tensor:
    """Per query: the mean over heads of the softmax mass (over the visible entries) on the picks.
    q [T, H, D] already scaled by 1/sqrt(D); kv [N, D] the global entries; visible [T] entry counts;
    picks [T, k] entry ids, -1 padded. With `parallel` each rank holds H of `n_heads` heads: the
    per-head sums are added over ranks. Returns float32 [T]; NaN where a query sees no entry."""
    T, H, _ = q.shape
    n = kv.shape[0]
    entry = torch.arange(n, device=q.device)
    sums = []
    for a in range(0, T, RECALL_BLOCK):
        b = slice(a, a + RECALL_BLOCK)
        logits = torch.einsum("thd,nd->thn", q[b].float(), kv.float())           # [B, H, N]
        hidden = entry[None, :] >= visible[b, None]                               # [B, N]
        probs = torch.softmax(logits.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
        chosen = torch.zeros_like(hidden)
        p = picks[b]
        ok = (p >= 0) & (p < n)
        rows = torch.arange(p.shape[0], device=q.device)[:, None].expand_as(p)
        chosen[rows[ok], p[ok]] = True
        sums.append((probs * chosen[:, None, :]).sum(-1).sum(-1))                # [B]: summed over heads
    total = torch.cat(sums) if sums else q.new_zeros(0)
    if parallel is not None:
        total = parallel.all_reduce(total)
    recall = total / (n_heads or H)
    return recall.masked_fill(visible <= 0, float("nan")).float()
