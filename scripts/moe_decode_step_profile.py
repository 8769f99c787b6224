"""The FP4 MoE at a release decode step (64 tokens x top-6 of 384 experts), launched twice for Nsight
Compute: `ncu -k regex:_moe_gate_up_kernel -s 1 -c 1 python3 scripts/moe_decode_step_profile.py` profiles
the warm launch (the first compiles). GPU only."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import moe  # noqa: E402


def main() -> None:
    dev, e, inter, dim, k, tokens = "cuda", 384, 2304, 5120, 6, 64
    gen = torch.Generator(device=dev).manual_seed(0)

    def fp4(rows, cols):
        packed = torch.randint(-128, 128, (e, rows, cols // 2), dtype=torch.int8, device=dev, generator=gen)
        scale = torch.randint(112, 124, (e, rows, cols // 32), dtype=torch.uint8, device=dev, generator=gen)
        return packed, scale.view(torch.float8_e8m0fnu)

    (w1, s1), (w3, s3), (w2, s2) = fp4(inter, dim), fp4(inter, dim), fp4(dim, inter)
    x = torch.randn(tokens, dim, device=dev, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:k] for _ in range(tokens)]).int()
    tw = torch.softmax(torch.randn(tokens, k, device=dev, generator=gen), -1)
    for _ in range(2):
        moe.moe_fp4_triton(x, w1, s1, w3, s3, w2, s2, ids, tw)
    torch.cuda.synchronize()
    print("experts touched", int(torch.unique(ids).numel()))


if __name__ == "__main__":
    main()
