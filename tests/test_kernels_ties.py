"""The tie-marks kernel (kernels/ties.py) on the CPU under TRITON_INTERPRET=1, against engine/model/attention.py
tie_marks on the picks the engine's top-k takes: untied rows, ties at the k-th score shared with unpicked
entries, rows with fewer picks than k, rows of one value, -inf gaps, and rows longer than one scan block."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

from engine.model.attention import NEG_INF, tie_marks, topk_in_position_order

_, ties = interpreted("_formats", "ties")


def _rows(gen, n):
    rows = [torch.randn(n, generator=gen),                                  # all distinct: nothing tied
            (torch.randperm(n, generator=gen) % 4).float(),                 # ties at the k-th value (n/4 of each)
            torch.where(torch.arange(n) < 3, torch.randn(n, generator=gen), torch.tensor(NEG_INF)),  # short row
            torch.zeros(n),                                                 # one value everywhere
            torch.where(torch.arange(n) % 3 == 0, torch.tensor(NEG_INF),
                        torch.randint(0, 3, (n,), generator=gen).float())]  # -inf gaps among ties
    return torch.stack(rows)


@pytest.mark.parametrize("n,k", [(40, 8), (40, 5), (5000, 16)])
def test_tie_marks_kernel_is_the_engines(gen, n, k):
    scores = _rows(gen, n)
    idx, picked = topk_in_position_order(scores, k)
    want_kth, want_tied = tie_marks(scores, idx, picked)
    kth, tied = ties.tie_marks_triton(scores, idx, picked)
    assert torch.equal(kth, want_kth) and torch.equal(tied, want_tied)
    assert want_tied[1].any() and not want_tied[0].any() and want_kth[2] == NEG_INF  # the cases are there
    assert ties.tie_marks_triton(scores[:, :0], idx[:, :0], picked[:, :0])[0].eq(NEG_INF).all()
    with pytest.raises(ValueError, match="tie marks"):
        ties.tie_marks_triton(scores, idx[:, :2], picked)
