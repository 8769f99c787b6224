"""The trainer's attention over picked entries, read in place (kernels/sparse_attn_train.py) against the
gathered PyTorch form the trainer uses by default, at the training step's shapes, on one GPU.

python benches/picked_attn.py [--batch 28] [--seq 4096] [--out DIR]

Per compress ratio (m = 2: N = T/2 entries, m = 1: N = T), forward and forward + backward of the
attention over each token's 64 picks (bf16 q [B, T, 4, 128] and entries; both outputs, o and lse,
in the loss as the trainer merges them with the window), and of the indexer KL's scores (4 x 64).
Baseline, measured in the same run: gather into [B, T, k, D], einsum, log-sum-exp, einsum, autograd.
Also: the parity of the two (relative L2 of o, dq, dE against a float32 gathered form) and a sweep of
the kernels' tokens per program and warps. Writes picked-attn.md / picked-attn.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import sparse_attn_train as sat  # noqa: E402


def causal_picks(B: int, T: int, m: int, K: int, device) -> torch.Tensor:
    """Random distinct-enough picks among each token's visible entries (-1 where fewer than K)."""
    visible = (torch.arange(T, device=device) + 1) // m                              # [T]
    r = torch.rand(B, T, K, device=device)
    idx = (r * visible.clamp_min(1)[None, :, None]).long()
    idx = torch.where(torch.arange(K, device=device)[None, None, :] < visible[None, :, None], idx, -1)
    return idx.to(torch.int32)


def gathered_attention(q, entries, idx):
    """The gathered form: (o [B, T, H, D], lse [B, T, H])."""
    B = entries.shape[0]
    g = entries[torch.arange(B, device=entries.device)[:, None, None], idx.long().clamp_min(0)]
    s = torch.einsum("bthd,btkd->bthk", q, g).float().masked_fill((idx < 0)[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("bthk,btkd->bthd", p.to(g.dtype), g).float(), lse


def gathered_scores(a, entries, idx):
    B = entries.shape[0]
    g = entries[torch.arange(B, device=entries.device)[:, None, None], idx.long().clamp_min(0)]
    return torch.einsum("bthd,btkd->bthk", a, g).float().masked_fill((idx < 0)[:, :, None, :], 0.0)


def in_place_attention(q, entries, idx, index):
    o, lse, _ = sat.picked_attention(q, entries, idx, *index)
    return o, lse


def ms(fn, rep=50) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def device_name(dev: str) -> str:
    return torch.cuda.get_device_name() if dev == "cuda" else dev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=28)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--picks", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (tiny shapes)")
    args = ap.parse_args()
    dev = args.device
    if dev == "cpu":
        triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0)[1]  # noqa: E731 (no CUDA timer: 1 ms)
    B, T, K, H, D, Hi, Di = args.batch, args.seq, args.picks, 4, 128, 4, 64
    torch.manual_seed(0)
    rows, sweep, parity = [], [], []
    for m in (2, 1):
        N = T // m
        idx = causal_picks(B, T, m, K, dev)
        index = sat.pick_index(idx, N)
        q = (torch.randn(B, T, H, D, device=dev) * 0.1).bfloat16().requires_grad_(True)
        e = torch.randn(B, N, D, device=dev).bfloat16().requires_grad_(True)
        go, gl = torch.randn(B, T, H, D, device=dev), torch.randn(B, T, H, device=dev)
        qi = (torch.randn(B, T, Hi, Di, device=dev) * 0.1).bfloat16().requires_grad_(True)
        ki = torch.randn(B, N, Di, device=dev).bfloat16().requires_grad_(True)
        gs = torch.randn(B, T, Hi, K, device=dev)

        def att_loss(fn):
            o, lse = fn()
            return (o * go).sum() + (lse.nan_to_num(neginf=0.0) * gl).sum()

        def both(fn, leaves):
            return lambda: torch.autograd.grad(att_loss(fn), leaves)

        forms = {
            "attention": (lambda: gathered_attention(q, e, idx), lambda: in_place_attention(q, e, idx, index), (q, e)),
            "KL scores": (lambda: (gathered_scores(qi, ki, idx), None), lambda: (sat.picked_scores(qi, ki, idx, *index),
                                                                                 None), (qi, ki)),
        }
        for name, (base, new, leaves) in forms.items():
            if name == "KL scores":
                step = lambda fn: (lambda: torch.autograd.grad((fn()[0] * gs).sum(), leaves))
            else:
                step = lambda fn: both(fn, leaves)
            with torch.no_grad():
                f_base, f_new = ms(base), ms(new)
            fb_base, fb_new = ms(step(base)), ms(step(new))
            rows.append(dict(m=m, N=N, op=name, fwd_gathered_ms=f_base, fwd_in_place_ms=f_new,
                             fwd_bwd_gathered_ms=fb_base, fwd_bwd_in_place_ms=fb_new, speedup=fb_base / fb_new))
            print(rows[-1], flush=True)
        with torch.no_grad():  # one pick-index build, as the trainer makes once per pick set
            rows.append(dict(m=m, N=N, op="pick_index", fwd_in_place_ms=ms(lambda: sat.pick_index(idx, N))))
        # parity against float32 gathered (the bf16 forms both round; report both against float32)
        q32, e32 = q.detach().float().requires_grad_(True), e.detach().float().requires_grad_(True)
        ref = gathered_attention(q32, e32, idx)
        ref_g = torch.autograd.grad((ref[0] * go).sum() + (ref[1].nan_to_num(neginf=0.0) * gl).sum(), (q32, e32))
        for name, fn in (("gathered bf16", lambda: gathered_attention(q, e, idx)),
                         ("in place bf16", lambda: in_place_attention(q, e, idx, index))):
            out = fn()
            grads = torch.autograd.grad((out[0] * go).sum() + (out[1].nan_to_num(neginf=0.0) * gl).sum(), (q, e))
            parity.append(dict(m=m, form=name, o=rel(out[0], ref[0]), dq=rel(grads[0], ref_g[0]),
                               de=rel(grads[1], ref_g[1])))
            print(parity[-1], flush=True)
        # the kernels' knobs
        with torch.no_grad():
            o, lse, _ = sat.run_forward(q, e, idx, softmax=True)
            delta = (go * o).sum(-1)
            for tpp in (1, 2, 4, 8) if dev == "cuda" else (2,):
                for warps in (2, 4, 8) if dev == "cuda" else (4,):
                    f = ms(lambda: sat.run_forward(q, e, idx, True, tpp, warps))
                    b = ms(lambda: sat.run_backward(q, e, idx, *index, go, lse, gl, delta, tpp, warps))
                    sweep.append(dict(m=m, tokens_per_program=tpp, num_warps=warps, fwd_ms=f, bwd_ms=b))
                    print(sweep[-1], flush=True)
        del q, e, qi, ki
        torch.cuda.empty_cache()

    lines = [f"# Picked-entry attention, in place vs gathered ({device_name(dev)}, B={B}, T={T}, k={K})", "",
             "| m | N | op | fwd gathered ms | fwd in place ms | fwd+bwd gathered ms | fwd+bwd in place ms | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['m']} | {r['N']} | {r['op']} | {r.get('fwd_gathered_ms', float('nan')):.3f} | "
                     f"{r['fwd_in_place_ms']:.3f} | {r.get('fwd_bwd_gathered_ms', float('nan')):.3f} | "
                     f"{r.get('fwd_bwd_in_place_ms', float('nan')):.3f} | {r.get('speedup', float('nan')):.2f}x |")
    lines += ["", "Parity against a float32 gathered form (relative L2):", "", "| m | form | o | dq | dE |",
              "|---|---|---|---|---|"]
    lines += [f"| {p['m']} | {p['form']} | {p['o']:.2e} | {p['dq']:.2e} | {p['de']:.2e} |" for p in parity]
    lines += ["", "Kernel knobs (attention, ms):", "", "| m | tokens/program | warps | forward | backward (+ reduce) |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['m']} | {s['tokens_per_program']} | {s['num_warps']} | {s['fwd_ms']:.3f} | {s['bwd_ms']:.3f} |"
              for s in sweep]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(os.path.join(args.out, "picked-attn.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "picked-attn.json"), "w") as f:
            json.dump({"rows": rows, "parity": parity, "sweep": sweep, "device": device_name(dev)}, f, indent=1)


if __name__ == "__main__":
    main()
