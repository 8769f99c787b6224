"""GPU check of the indexer decode scores (benches/kernels.py case_indexer's shapes and data), with the
error's location. On a GPU: python scripts/indexer_gpu_check.py [--after attn] [--seeds 0,1,2] (notes/kernels.md, run 3)
--after attn: run benches/kernels.case_attn first (today's order: attn then indexer)."""
import argparse, os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton
from benches import kernels as B
from kernels import indexer

ap = argparse.ArgumentParser(); ap.add_argument("--after", default=""); ap.add_argument("--seeds", default="0,1,2")
a = ap.parse_args()
p = torch.cuda.get_device_properties(0)
print(p.name, p.multi_processor_count, "SMs; torch", torch.__version__, "triton", triton.__version__,
      "| tf32", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(), flush=True)
if "attn" in a.after:
    torch.manual_seed(0); bw, mm = B.ceilings(); B.case_attn(bw, mm); torch.cuda.synchronize()
    print("after case_attn | tf32", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())


def rel(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / x.norm()).item()


h, d, n = 32, 128, 1 << 20
for seed in map(int, a.seeds.split(",")):
    torch.manual_seed(seed)
    qp, qs = B.rand_fp4((1, h, d), 32); kp, ks = B.rand_fp4((n, d), 32)
    w = torch.randn(1, h, device="cuda") * (128 ** -0.5) * (32 ** -0.5)
    nv = torch.tensor([n], dtype=torch.int32, device="cuda")
    args = (qp, qs, kp, ks, w, nv)
    s1 = indexer.indexer_scores_triton(*args); torch.cuda.synchronize()
    q64, k64 = B.fp4_dev(qp, qs, 32)[0].double(), B.fp4_dev(kp, ks, 32).double()
    ref64 = (torch.relu(q64 @ k64.T) * w[0].double()[:, None]).sum(0)  # float64 on the device
    ref32 = (torch.relu(q64.float() @ k64.float().T) * w[0][:, None]).sum(0)  # the bench's expression
    s_copy = s1.clone()
    B.bench(lambda: indexer.indexer_scores_triton(*args), graph=True)
    s2 = indexer.indexer_scores_triton(*args); torch.cuda.synchronize()
    err = (s1[0].double() - ref64).abs()
    blk = err.view(-1, 1024).norm(dim=1) / ref64.norm()
    bad = (err > 1e-5 * ref64.abs().max()).nonzero().flatten()
    print(f"seed {seed}: rel(ref64, kernel) {rel(ref64, s1[0]):.1e}; rel(ref64, bench fp32 ref) {rel(ref64, ref32):.1e}; "
          f"kernel non-finite {(~torch.isfinite(s1)).sum().item()}; scores changed by the graph bench "
          f"{not torch.equal(s1, s_copy)}; second launch identical {torch.equal(s1, s2)}; "
          f"entries off {bad.numel()} (first/last {bad[:1].tolist()} {bad[-1:].tolist()}); "
          f"worst 1024-blocks {blk.topk(min(3, blk.numel())).indices.tolist()} ({blk.topk(min(3, blk.numel())).values.tolist()})", flush=True)
    if bad.numel():
        i = bad[:5]
        print("   kernel", s1[0, i].tolist(), "ref64", ref64[i].tolist())
