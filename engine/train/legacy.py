"""Train the small V4.1-Flash model with the engine's own forward, then export it in the release layout.

    python -m engine.train prepare            # tokenize build/corpus -> build/tokens/*.npy (uint16)
    python -m engine.train train --out DIR    # train on a wall-clock budget, export DIR/model

The model IS `engine.model.Model` over a `TensorWeights` whose tensors are views of nn.Parameters,
so what is trained is exactly what the engine runs. Three phases on the time budget:

1. dense warm-up: index_topk and candidate_topk_blocks larger than any entry count, so every
   attention layer with a global branch sees all visible global entries and the indexer learns
   the whole distribution;
2. sparse: the real top-k (64 entries, 32 candidate blocks of 8);
3. sparse + quantization-aware: FP8 (E4M3, E8M0 per 32x32) fake-quantized dense linears and FP4
   (E2M1, E8M0 per 32) fake-quantized routed experts, straight-through.

Losses: next-token cross-entropy, plus the indexer KL (DeepSeek-V3.2 style): per index source, the
target is the attention mass on its selected global entries summed over heads (and over the Reuse
layers that borrow its top-k), renormalized and detached; the prediction is the softmax of the
indexer's scores over the same entries. Expert balance is auxiliary-loss-free: after each step,
bias_e += gamma * sign(mean load - load_e) per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import attention, quant
from .config import ModelConfig, load_config
from .layout import tensor_specs
from .model import Model, ProbeRequest
from .roles import FULL, REINDEX
from .weights import TensorWeights

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "assets" / "configs" / "small.json"
TOKENS_DIR = REPO / "build" / "tokens"
EXPERT_PARTS = ("w1", "w2", "w3")


# -- data ----------------------------------------------------------------------------------------

def prepare(corpus_dir: Path, out_dir: Path) -> None:
    """Tokenize each document of the corpus (with <bos>) into one uint16 stream per split, plus the
    training split's token counts (for the unigram baseline)."""
    from .tokenizer import load_tokenizer
    tok = load_tokenizer(REPO / "assets" / "tokenizer" / "tokenizer.json")
    manifest = json.loads((REPO / "assets" / "corpus" / "MANIFEST.json").read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "heldout"):
        raw = (corpus_dir / f"{split}.txt").read_bytes()
        docs = [d for d in manifest["documents"] if d["split"] == split]
        texts = [raw[d["offset"]: d["offset"] + d["bytes"]].decode("utf-8") for d in docs]
        encoded = tok.backend.encode_batch(texts, add_special_tokens=False)
        ids = np.concatenate([np.array([tok.bos_id] + e.ids, dtype=np.uint16) for e in encoded])
        np.save(out_dir / f"{split}.npy", ids)
        print(f"{split}: {len(docs)} documents, {ids.size} tokens")
    counts = np.bincount(np.load(out_dir / "train.npy"), minlength=tok.vocab_size)
    np.save(out_dir / "train_counts.npy", counts.astype(np.int64))


# -- parameters ----------------------------------------------------------------------------------

def init_params(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float32 initial values of every weight in the layout (scales excluded). Routed experts are
    stacked per layer: `layers.L.ffn.experts.wX` [E, out, in]. Returns name -> tensor."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    hc = cfg.hc_mult
    depth_scale = (2 * cfg.n_layers) ** -0.5  # output projections: keep the residual growth bounded
    for spec in tensor_specs(cfg):
        name, shape = spec.name, spec.logical_shape
        if spec.part == "scale" or name.endswith("gate.bias") or name.endswith("gate.bias_vl"):
            continue
        if spec.expert is not None:
            stacked = f"layers.{spec.layer}.ffn.experts.{name.split('.')[-2]}"
            if stacked not in out:
                E = cfg.n_routed_experts
                fan_in = shape[1]
                scale = fan_in ** -0.5 * (depth_scale if stacked.endswith("w2") else 1.0)
                out[stacked] = torch.randn((E, *shape), generator=gen) * scale
            continue
        if name.endswith(("norm.weight", "q_weight", "k_weight")) or name.endswith("_scale"):
            value = torch.ones(shape)
        elif name.endswith("attn_sink"):
            value = torch.zeros(shape)
        elif name.endswith("_base"):
            # pre 0.5 each, post 1, comb close to the identity (each copy mostly keeps itself)
            value = torch.zeros(shape)
            value[2 * hc:] = (torch.eye(hc) * 4.0).flatten()
        elif name.endswith("_fn"):
            value = torch.randn(shape, generator=gen) * 0.02 * shape[1] ** -0.5
        elif name == "embed.weight":
            value = torch.randn(shape, generator=gen)
        elif name.endswith("engram.embed.weight"):
            value = torch.randn(shape, generator=gen) * 0.5
        else:
            fan_in = shape[-1]
            value = torch.randn(shape, generator=gen) * fan_in ** -0.5
            if name.endswith(("wo_b.weight", "shared_experts.w2.weight")):
                value = value * depth_scale
        out[name] = value
    return out


class Trainee:
    """The trainable parameters, the routing biases, and the per-step `TensorWeights` built from them."""

    def __init__(self, cfg: ModelConfig, device: str, seed: int = 0):
        self.cfg = cfg
        self.specs = {s.name: s for s in tensor_specs(cfg)}
        self.params = {k: torch.nn.Parameter(v.to(device)) for k, v in init_params(cfg, seed).items()}
        self.biases = {f"layers.{L}.ffn.gate.bias": torch.zeros(cfg.n_routed_experts, device=device)
                       for L in range(cfg.n_layers)}

    def weights(self, fake_quant: bool = False) -> TensorWeights:
        """A weight source over the parameters; with fake_quant, dense FP8 linears and routed experts
        see their stored-format rounding in the forward, identity gradient in the backward."""
        cfg, tensors = self.cfg, {}
        for name, p in self.params.items():
            if ".ffn.experts." in name:
                w = p
                if fake_quant:
                    w = p + (quant.fp4_roundtrip(p.detach(), 32, "e8m0") - p.detach())
                layer, part = name.split(".")[1], name.split(".")[-1]
                for e in range(cfg.n_routed_experts):
                    tensors[f"layers.{layer}.ffn.experts.{e}.{part}.weight"] = w[e]
                continue
            spec = self.specs[name]
            if fake_quant and spec.dtype == "F8_E4M3" and len(spec.shape) == 2 and spec.kind != "engram.embed":
                q, s = quant.quantize_fp8_weight(p.detach(), 32)
                p = p + (quant.dequantize_fp8_weight(q, s, 32) - p.detach())
            elif fake_quant and spec.kind == "engram.embed":
                p = p + (quant.fp8_roundtrip(p.detach(), 32) - p.detach())
            tensors[name] = p
        tensors.update(self.biases)
        return TensorWeights(tensors)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """Float CPU tensors by checkpoint name (logical shapes), for `write_checkpoint`."""
        out = {}
        for name, p in self.params.items():
            p = p.detach().float().cpu()
            if ".ffn.experts." in name:
                layer, part = name.split(".")[1], name.split(".")[-1]
                for e in range(self.cfg.n_routed_experts):
                    out[f"layers.{layer}.ffn.experts.{e}.{part}.weight"] = p[e].clone()
            else:
                out[name] = p
        for name, b in self.biases.items():
            out[name] = b.detach().float().cpu()
            if self.cfg.vision_enabled:  # no image positions in training: bias_vl is the text bias
                out[name + "_vl"] = out[name].clone()
        return out


# -- losses --------------------------------------------------------------------------------------

def indexer_kl(model: Model) -> torch.Tensor:
    """Mean KL(target || indexer) over the index sources' query rows that selected anything."""
    consumers: dict[int, list[int]] = {}
    for role in model.plan:
        if role.index_source is not None:
            consumers.setdefault(role.index_source, []).append(role.layer)
    total, count = 0.0, 0
    for src_layer, users in consumers.items():
        attn = model.attn[src_layer]
        if attn.role.role not in (FULL, REINDEX) or getattr(attn, "last_topk", None) is None:
            continue
        idx = attn.last_topk  # [T, k]
        valid = idx >= 0
        mass = sum(model.attn[u].global_probs.detach().sum(dim=1) for u in users
                   if getattr(model.attn[u], "global_probs", None) is not None)  # [T, k]
        mass = mass.float().masked_fill(~valid, 0.0)
        row_sum = mass.sum(-1, keepdim=True)
        rows = row_sum.squeeze(-1) > 0
        if not bool(rows.any()):
            continue
        target = mass / row_sum.clamp_min(1e-30)
        pred = attn.index_scores.float().gather(-1, idx.clamp_min(0)).masked_fill(~valid, -1e30)
        logp = F.log_softmax(pred, dim=-1)
        kl = (target * (target.clamp_min(1e-30).log() - logp)).masked_fill(~valid, 0.0).sum(-1)
        total = total + kl[rows].mean()
        count += 1
    return total / max(count, 1) if count else torch.zeros(())


def update_biases(trainee: Trainee, collect: dict, gamma: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing; returns the per-layer load [n_layers, E] of this step."""
    E = trainee.cfg.n_routed_experts
    loads = []
    for L in range(trainee.cfg.n_layers):
        experts = collect[L]["routing"]["experts"]
        load = torch.bincount(experts.flatten(), minlength=E).float()
        trainee.biases[f"layers.{L}.ffn.gate.bias"] += gamma * torch.sign(load.mean() - load)
        loads.append(load)
    return torch.stack(loads)


# -- evaluation ------------------------------------------------------------------------------------

@torch.no_grad()
def heldout_loss(cfg: ModelConfig, weights, tokens: torch.Tensor, window: int, tokenizer=None,
                 act_quant: bool = False) -> dict:
    """Mean next-token loss (nats) over every position but the first, windows overlapping by one."""
    model = Model(cfg, weights, tokenizer, act_quant=act_quant)
    total, n = 0.0, 0
    start = 0
    while start < tokens.numel() - 1:
        chunk = tokens[start: start + window]
        model.reset()
        logits = model.forward(chunk)
        total += F.cross_entropy(logits[:-1].float(), chunk[1:], reduction="sum").item()
        n += chunk.numel() - 1
        start += window - 1
    return {"loss": total / n, "tokens": n, "ppl": math.exp(total / n)}


# -- training ------------------------------------------------------------------------------------

def train(args) -> None:
    started = time.time()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    cfg = load_config(args.config)
    if args.tiny:
        cfg = cfg.replace(dim=64, q_lora_rank=32, head_dim=32, rope_head_dim=16, n_heads=2, o_groups=2,
                          o_lora_rank=32, index_n_heads=2, index_head_dim=32, moe_inter_dim=32,
                          n_routed_experts=8, n_activated_experts=2, window_size=8, index_topk=8,
                          candidate_topk_blocks=4, engram_head_dim=32)
    from .tokenizer import load_tokenizer
    tokenizer = load_tokenizer(REPO / "assets" / "tokenizer" / "tokenizer.json")
    train_ids = torch.from_numpy(np.load(Path(args.tokens) / "train.npy").astype(np.int64)).to(device)
    held_text = (REPO / "assets" / "corpus" / "heldout_sample.txt").read_text()
    held_ids = torch.tensor(tokenizer.encode(held_text, add_bos=True)[: args.eval_tokens], device=device)
    # Queries scored/attended at once: one block per sequence removes the per-block Python loops
    # (launch-bound on the GPU); memory is the same since training keeps every block for backward.
    attention.QUERY_BLOCK = args.query_block or max(args.seq, args.dense_seq)
    log = {"config": cfg.to_dict(), "device": device, "events": [], "query_block": attention.QUERY_BLOCK}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def note(**kv):
        kv["t"] = round(time.time() - started, 1)
        log["events"].append(kv)
        print(json.dumps(kv), flush=True)

    trainee = Trainee(cfg, device, args.seed)
    n_params = sum(p.numel() for p in trainee.params.values())
    note(event="init", params=n_params, train_tokens=int(train_ids.numel()), eval_tokens=int(held_ids.numel()))
    if args.eval_tokens > 0 and not args.skip_init_eval:
        r = heldout_loss(cfg, trainee.weights(), held_ids, args.eval_window, tokenizer)
        log["heldout_init"] = r
        note(event="heldout_init", **r)

    dense_cfg = cfg.replace(index_topk=1 << 20, candidate_topk_blocks=1 << 20)
    decay = [p for n, p in trainee.params.items() if p.dim() >= 2 and "engram.embed" not in n and n != "embed.weight"]
    no_decay = [p for n, p in trainee.params.items() if not (p.dim() >= 2 and "engram.embed" not in n and n != "embed.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    budget = args.budget_s
    t0 = time.time()
    step, tokens_seen = 0, 0
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    loads_acc = None
    mark_t, mark_tokens = time.time(), 0
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        phase = "dense" if frac < args.dense_frac else ("sparse" if frac < 1 - args.quant_frac else "quant")
        if args.smoke:  # one step of each phase, whatever the clock says
            phase = ("dense", "sparse", "quant")[min(step, 2)]
        seq = args.dense_seq if phase == "dense" else args.seq
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr
        offset = int(torch.randint(0, train_ids.numel() - seq - 1, (1,), generator=gen))
        ids = train_ids[offset: offset + seq]
        model = Model(dense_cfg if phase == "dense" else cfg, trainee.weights(fake_quant=phase == "quant"),
                      tokenizer, act_quant=False)
        collect: dict = {}
        opt.zero_grad(set_to_none=True)
        try:
            logits = model.forward(ids, probes=ProbeRequest(kinds={"routing"}), collect=collect)
            ce = F.cross_entropy(logits[:-1], ids[1:])
            kl = indexer_kl(model)
            loss = ce + args.kl_weight * kl
            loss.backward()
        except torch.OutOfMemoryError:
            # fall back to shorter sequences rather than lose the run
            del model, collect
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if phase == "dense":
                args.dense_seq //= 2
            else:
                args.seq //= 2
            note(event="oom", phase=phase, seq=seq)
            continue
        gnorm = torch.nn.utils.clip_grad_norm_(list(trainee.params.values()), 1.0)
        opt.step()
        with torch.no_grad():
            loads = update_biases(trainee, collect, args.gamma)
        loads_acc = loads if loads_acc is None else loads_acc * 0.9 + loads * 0.1
        step += 1
        tokens_seen += seq
        if not math.isfinite(ce.item() if step <= 3 or step % args.log_every == 0 else 0.0):
            note(event="abort", reason="non-finite loss", step=step)
            raise SystemExit(f"training aborted: non-finite loss at step {step}")
        if step % args.log_every == 0 or step == 1:
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.time()
            tok_s = (tokens_seen - mark_tokens) / max(now - mark_t, 1e-9)
            mark_t, mark_tokens = now, tokens_seen
            share = loads_acc / loads_acc.sum(-1, keepdim=True) * cfg.n_routed_experts
            note(event="step", step=step, phase=phase, seq=seq, lr=round(lr, 6), ce=round(ce.item(), 4),
                 kl=round(float(kl.detach()) if torch.is_tensor(kl) else float(kl), 4), gnorm=round(float(gnorm), 3), tokens=tokens_seen,
                 min_load_share=round(share.min().item(), 3), max_load_share=round(share.max().item(), 3),
                 mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else 0,
                 tok_s=round(tok_s))
        del model, collect, logits, loss
    log["steps"], log["tokens_seen"], log["train_s"] = step, tokens_seen, round(time.time() - t0, 1)
    note(event="trained", steps=step, tokens=tokens_seen, train_s=log["train_s"],
         tok_s=round(tokens_seen / max(log["train_s"], 1e-9)))
    print("loss curve (step, phase, seq, ce, tok/s):", " | ".join(
        f"{e['step']} {e['phase'][0]} {e['seq']} {e['ce']} {e['tok_s']}" for e in log["events"] if e["event"] == "step"),
        flush=True)

    if args.eval_tokens > 0:
        for key, fq in (("heldout_float", False), ("heldout_fakequant", True)):
            r = heldout_loss(cfg, trainee.weights(fake_quant=fq), held_ids, args.eval_window, tokenizer)
            log[key] = r
            note(event=key, **r)

    from .checkpoint import CheckpointReader, write_checkpoint
    model_dir = out / "model"
    write_checkpoint(cfg, model_dir, tensors=trainee.export_tensors(), n_shards=args.n_shards)
    total = sum(f.stat().st_size for f in model_dir.iterdir())
    note(event="exported", bytes=total)
    log["checkpoint_bytes"] = total
    if args.eval_tokens > 0:
        # the exported bytes, dequantized, through the engine's forward with FP8 activations
        reader = CheckpointReader(model_dir, cfg)
        names = [s.name for s in tensor_specs(cfg) if s.part != "scale"]
        deq = {n: reader.dequantized(n).float().to(device) for n in names}
        dtypes = {n: reader.entry(n).dtype for n in names}
        r = heldout_loss(cfg, TensorWeights(deq, dtypes), held_ids, args.eval_window, tokenizer, act_quant=True)
        log["heldout_exported"] = r
        note(event="heldout_exported", **r)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize build/corpus into build/tokens")
    p.add_argument("--corpus", default=str(REPO / "build" / "corpus"))
    p.add_argument("--out", default=str(TOKENS_DIR))
    t = sub.add_parser("train", help="train on a wall-clock budget and export")
    t.add_argument("--config", default=str(DEFAULT_CONFIG))
    t.add_argument("--tokens", default=str(TOKENS_DIR))
    t.add_argument("--out", required=True)
    t.add_argument("--budget-s", type=float, default=400.0)
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--seq", type=int, default=2048)
    t.add_argument("--dense-seq", type=int, default=1024)
    t.add_argument("--dense-frac", type=float, default=0.2)
    t.add_argument("--quant-frac", type=float, default=0.25)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=30)
    t.add_argument("--kl-weight", type=float, default=0.3)
    t.add_argument("--gamma", type=float, default=0.01)
    t.add_argument("--eval-tokens", type=int, default=16384)
    t.add_argument("--eval-window", type=int, default=2048)
    t.add_argument("--n-shards", type=int, default=4)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--query-block", type=int, default=0,
                   help="engine.attention.QUERY_BLOCK while training (0: the longest sequence)")
    t.add_argument("--skip-init-eval", action="store_true", help="no held-out loss at initialization")
    t.add_argument("--smoke", action="store_true", help="one step per phase (dense, sparse, quant); use --max-steps 3")
    t.add_argument("--cpu", action="store_true")
    t.add_argument("--tiny", action="store_true", help="a tiny-width variant for CPU debugging")
    args = parser.parse_args(argv)
    if args.cmd == "prepare":
        prepare(Path(args.corpus), Path(args.out))
    else:
        train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
