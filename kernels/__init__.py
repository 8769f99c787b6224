"""Triton kernels for the engine at the release's shapes, each with its PyTorch reference.

Use `kernels.dispatch`: `use_triton(device) -> bool` (CUDA and triton importable); each function
below runs Triton on CUDA and the reference elsewhere; `compare(name, *args)` runs both and returns
{"name", "max_abs", "max_rel", "rel_l2", "mismatched_bytes"}.

Signatures (T tokens/queries, N cache entries; release values in brackets):
- indexer_scores(q_packed int8 [T,H,D/2], q_scale e8m0 [T,H,D/32], k_packed int8 [N,D/2],
  k_scale e8m0 [N,D/32], weights f32 [T,H], n_visible i32 [T], pool_mask bool [T,ceil(N/pb)] | None,
  pool_block=8) -> f32 [T,N] (-inf where masked)                                   [H=32, D=128]
- indexer_topk(same args..., pool_mask=None, topk=512, pool_block=8) -> i32 [T,topk], positions of
  the top scores in ascending order, -1 padded.
- topk_positions(values f32 [R,L], k, lengths i32 [R] | None) -> i32 [R,k] (same rule; -inf never chosen).
- sparse_attn(q bf16 [T,H,D], kv_packed int8 [N,D/2], kv_scale e4m3 [N,D/16], idx i32 [T,K],
  win e4m3 [W,D], win_scale e8m0 [W,D/32], win_idx i32 [T,Wn], sink f32 [H], scale=None)
  -> bf16 [T,H,D]                                                         [H=64, D=512, K=512, Wn=128]
- moe_fp4(x bf16 [T,dim], w1 int8 [E,I,dim/2], w1_scale e8m0 [E,I,dim/32], w3, w3_scale (same),
  w2 int8 [E,dim,I/2], w2_scale e8m0 [E,dim,I/32], topk_ids i32 [T,k], topk_weights f32 [T,k],
  swiglu_limit=10.0) -> f32 [T,dim] (routed experts only)           [E=384, dim=5120, I=2304, k=6]
- mhc(x [T,4,dim], fn f32 [24,4dim], scale [3], base [24], pre_prev f32 [T,4], y [T,dim] | None,
  post_old [T,4] | None, comb_old [T,4,4] | None, norm_eps=1e-20, hc_eps=1e-6, iters=20)
  -> (x_new [T,4,dim] | None, collapsed [T,dim], pre [T,4], post [T,4], comb [T,4,4])
- fp8_linear(x bf16 [M,K], w e4m3 [N,K], w_scale e8m0 [ceil(N/32),K/32]) -> bf16 [M,N]
- quantize_fp4(x [...,K], block, scale_kind "e8m0"|"e4m3") -> (int8 [...,K/2], scales [...,K/block])
- quantize_fp8(x [...,K], block=32) -> (e4m3 [...,K], e8m0 [...,K/32])   (bit-exact with engine.quant)
"""
