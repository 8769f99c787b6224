"""The FP4 MoE at a release decode step (64 tokens x top-6 of 384 experts), launched twice for Nsight
Compute: `ncu -k regex:_moe_gate_up_kernel -s 1 -c 1 python3 scripts/moe_decode_step_profile.py` profiles
the warm launch (the first compiles). GPU only."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benches.kernel_bench import rand_fp4  # noqa: E402
from kernels import moe  # noqa: E402


def main() -> None:
    dev, e, inter, dim, k, tokens = "cuda", 384, 2304, 5120, 6, 64
    torch.manual_seed(0)
    (w1, s1), (w3, s3), (w2, s2) = (rand_fp4(shape, 32) for shape in ((e, inter, dim), (e, inter, dim), (e, dim, inter)))
    x = torch.randn(tokens, dim, device=dev).bfloat16()
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(tokens)]).int()
    tw = torch.softmax(torch.randn(tokens, k, device=dev), -1)
    for _ in range(2):
        moe.moe_fp4_triton(x, w1, s1, w3, s3, w2, s2, ids, tw)
    torch.cuda.synchronize()
    print("experts touched", int(torch.unique(ids).numel()))


if __name__ == "__main__":
    main()
