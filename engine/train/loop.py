"""The training run: phases on a wall-clock budget, logging, held-out checks, export.

Phases (fractions of the budget):
1. dense warm-up: every global layer attends every visible entry; the indexer learns the whole
   attention distribution (KL over all visible entries);
2. sparse: the real top-k and candidate pool; the indexer's KL over its picks;
3. quantization-aware: FP8 dense linears (E4M3, E8M0 per 32x32), FP4 routed experts, FP8 Engram
   rows, straight-through; the caches' FP8/FP4 rounding is on in every phase.

One step = B sequences of T tokens drawn at random offsets of the training stream, all on the GPU:
no host synchronization inside a step (logging syncs every `log_every` steps). Expert balance is
auxiliary-loss-free: bias_e += gamma * sign(mean load - load_e) per layer after each step.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..model.engram import EngramLayout
from ..profiling import profile_report
from .batched import BatchedForward, StepOptions
from .params import Trainee


def phase_name(frac: float, step: int, a) -> str:
    """The phase of a step, from the share of the budget spent: the dense warm-up, then sparse, then
    the quantization-aware end. With `dense_every` N > 0, every N-th sparse step runs dense too,
    so the layers keep attending every entry (what the selection-recall probe measures) while the
    indexer's picks train. `smoke` splits `max_steps` evenly over the three phases."""
    if a.smoke:
        return ("dense", "sparse", "quant")[min(step * 3 // max(a.max_steps, 3), 2)]
    if frac < a.dense_frac:
        return "dense"
    if frac < 1 - a.quant_frac:
        every = a.dense_every
        return "dense" if every and step % every == every - 1 else "sparse"
    return "quant"


@dataclass
class Phase:
    name: str
    batch: int
    seq: int
    opts: StepOptions


class PhaseClock:
    """Seconds of GPU timeline per phase, from CUDA events around each step (no host sync inside the
    loop: the events are read when the log syncs anyway). Steps that compiled are left out. On the
    CPU the host's wall time is the timeline."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.seconds: dict[str, float] = {}
        self.tokens: dict[str, int] = {}

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, phase: str, tokens: int, start, end) -> None:
        self.pending.append((phase, tokens, start, end))

    def collect(self) -> dict[str, int]:
        """Fold the finished steps in (call after a sync); tokens/s per phase so far."""
        for phase, tokens, start, end in self.pending:
            s = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            self.seconds[phase] = self.seconds.get(phase, 0.0) + s
            self.tokens[phase] = self.tokens.get(phase, 0) + tokens
        self.pending.clear()
        return {k: round(self.tokens[k] / v) for k, v in self.seconds.items() if v > 0}


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq] windows at random offsets of a 1-D token stream (on its device, no sync)."""
    offsets = torch.randint(0, stream.numel() - seq, (batch, 1), device=stream.device, generator=gen)
    return stream[offsets + torch.arange(seq, device=stream.device)].long()


class Run:
    """One training run over a token stream; `log` collects events for train_log.json."""

    def __init__(self, cfg: ModelConfig, trainee: Trainee, lookup: torch.Tensor, args, device: torch.device):
        self.cfg, self.trainee, self.args, self.device = cfg, trainee, args, device
        layout = EngramLayout.from_config(cfg) if cfg.engram_layer_ids else None
        speed = {"bf16": args.bf16, "compile_parts": args.compile and device.type == "cuda",
                 "checkpoint": args.checkpoint,
                 "fused_picks": device.type == "cuda" if args.fused_picks is None else args.fused_picks}
        self.fwd = BatchedForward(cfg, trainee.get, layout, lookup.to(device), **speed)
        self.dense_fwd = BatchedForward(cfg.replace(index_topk=1 << 20, candidate_topk_blocks=1 << 20),
                                        trainee.get, layout, lookup.to(device), **speed,
                                        sparse_limits=(cfg.index_topk, cfg.candidate_topk_blocks))
        decay, rest = trainee.decay_groups()
        fused = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **fused)
        self.params = list(trainee.params.values())
        self.biases = [trainee.biases[f"layers.{L}.ffn.gate.bias"] for L in range(cfg.n_layers)]  # updated in place
        self.log: dict = {"config": cfg.to_dict(), "device": str(device), "events": [], "args": vars(args)}
        self.started = time.time()

    def note(self, **kv) -> None:
        kv["t"] = round(time.time() - self.started, 1)
        self.log["events"].append(kv)
        print(json.dumps(kv), flush=True)

    def phases(self) -> dict[str, Phase]:
        a = self.args
        balance = a.seq_balance > 0
        return {"dense": Phase("dense", a.dense_batch, a.dense_seq, StepOptions(dense=True, margin=a.margin,
                                                                             focus=a.focus > 0, seq_balance=balance)),
                "sparse": Phase("sparse", a.batch, a.seq, StepOptions(margin=a.margin, seq_balance=balance)),
                "quant": Phase("quant", a.batch, a.seq, StepOptions(fake_quant=True, margin=a.margin,
                                                                    seq_balance=balance))}

    def step(self, phase: Phase, ids: torch.Tensor, lr: float):
        a = self.args
        for group in self.opt.param_groups:
            group["lr"] = lr
        fwd = self.dense_fwd if phase.opts.dense else self.fwd
        out = fwd(ids, phase.opts)
        loss = out.loss_ce + a.kl_weight * out.loss_kl + a.margin * out.loss_margin
        if out.loss_focus is not None:
            loss = loss + a.focus * out.loss_focus
        if out.loss_balance is not None:
            loss = loss + a.seq_balance * out.loss_balance
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.opt.step()
        with torch.no_grad():  # every layer's routing biases in one step (out.loads: [n_layers, E])
            steps = a.gamma * torch.sign(out.loads.mean(-1, keepdim=True) - out.loads)
            torch._foreach_add_(self.biases, list(steps.unbind(0)))
        return out, gnorm

    def profiled_step(self, phase: Phase, ids: torch.Tensor, lr: float):
        """One step under torch.profiler: where a step's time goes, written to `profile.txt` beside the
        log and noted as an event: engine/profiling.py's tables (the forward's named parts and the autograd
        nodes, the kernels by name, the ops by their own kernel time and by the host's), and how much of the
        step's wall the GPU was busy (the rest waits on the host's launches)."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.time()
        for fwd in (self.fwd, self.dense_fwd):
            fwd.named_parts = True
        try:
            with profile(activities=activities) as prof:
                result = self.step(phase, ids, lr)
                sync()
        finally:
            for fwd in (self.fwd, self.dense_fwd):
                fwd.named_parts = False
        wall = time.time() - t0
        report = profile_report(prof, self.device.type == "cuda")
        out = Path(self.args.profile_out or ".")
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.txt").write_text(
            f"phase {phase.name}, {phase.batch} x {phase.seq} tokens, wall {wall:.3f} s (profiler on), "
            f"GPU kernels {report['kernel_s']:.3f} s in {report['launches']} launches, GPU busy "
            f"{report['busy_s']:.3f} s of the {report['span_s']:.3f} s from first to last kernel\n\n" + report["text"])
        self.note(event="profile", phase=phase.name, wall_s=round(wall, 3), gpu_kernel_s=round(report["kernel_s"], 3),
                  gpu_busy_s=round(report["busy_s"], 3), launches=report["launches"])
        return result

    def train(self, stream: torch.Tensor, extra: torch.Tensor | None = None, extra_share: float = 0.0) -> None:
        """Train on `stream`; with `extra`, that share of each batch's sequences comes from it
        (the prose stream, so that it is not drowned by the larger code stream)."""
        a = self.args
        phases = self.phases()
        gen = torch.Generator(device=stream.device).manual_seed(a.seed + 1)
        t0 = time.time()
        step = tokens = 0
        mark_t, mark_tokens = t0, 0
        loads_ema = None
        # each phase's latest batch loss, kept as a tensor (no sync) and read when the log syncs: with
        # --dense-every dividing --log-every, every logged step would otherwise be a dense one
        last_ce: dict[str, torch.Tensor] = {}
        # The budget clock leaves out each phase's first step: with --compile that step compiles for
        # minutes, and counted in, it would eat the dense warm-up's whole share of the budget.
        first_steps_s, started = 0.0, set()
        clock = PhaseClock(self.device)
        while True:
            # with a wall-clock deadline (compiling included), the budget shrinks as compiling eats it
            budget = min(a.budget_s, a.deadline_s - first_steps_s) if a.deadline_s else a.budget_s
            frac = (time.time() - t0 - first_steps_s) / max(budget, 1e-9)
            if frac >= 1.0 or (a.max_steps and step >= a.max_steps):
                break
            name = phase_name(frac, step, a)
            phase = phases[name]
            lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
            n_extra = round(phase.batch * extra_share) if extra is not None else 0
            ids = sample_batch(stream, phase.batch - n_extra, phase.seq, gen)
            if n_extra:
                ids = torch.cat([ids, sample_batch(extra, n_extra, phase.seq, gen)])
            first = name not in started
            step_t0 = time.time()
            mark = clock.mark()
            profiled = bool(a.profile_step) and step == a.profile_step
            try:
                if profiled:
                    out, gnorm = self.profiled_step(phase, ids, lr)
                else:
                    out, gnorm = self.step(phase, ids, lr)
                if first:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    started.add(name)
                    first_steps_s += time.time() - step_t0
                    self.note(event="first_step", phase=name, seconds=round(time.time() - step_t0, 1))
                elif not profiled:  # (the profiler's own work would count as the step's)
                    clock.add(name, phase.batch * phase.seq, mark, clock.mark())
            except torch.OutOfMemoryError:
                self.opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                phase.batch = max(1, phase.batch // 2)
                self.note(event="oom", phase=name, batch=phase.batch)
                continue
            last_ce[name] = out.loss_ce.detach()
            loads = out.loads.detach()
            loads_ema = loads if loads_ema is None else loads_ema * 0.95 + loads * 0.05
            step += 1
            tokens += phase.batch * phase.seq
            if step % a.log_every == 0 or step in (1, 3):
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.time()
                tok_s = (tokens - mark_tokens) / max(now - mark_t, 1e-9)
                mark_t, mark_tokens = now, tokens
                ce = float(out.loss_ce.detach())
                if not math.isfinite(ce):
                    self.note(event="abort", reason="non-finite loss", step=step)
                    raise SystemExit(f"training aborted: non-finite loss at step {step}")
                share = loads_ema / loads_ema.sum(-1, keepdim=True) * self.cfg.n_routed_experts
                zero = {str(k): round(float(v), 3) for k, v in out.zero_picks.items()}
                extras = {}
                if out.loss_focus is not None:
                    extras = {"focus": round(float(out.loss_focus.detach()), 4),
                              "focus_recall": {str(k): round(float(v), 3) for k, v in out.focus_recall.items()}}
                if out.loss_balance is not None:
                    extras["balance"] = round(float(out.loss_balance.detach()), 4)
                extras["phase_tok_s"] = clock.collect()
                extras["ce_by_phase"] = {k: round(float(v), 4) for k, v in last_ce.items()}
                self.note(event="step", step=step, phase=name, batch=phase.batch, seq=phase.seq, lr=round(lr, 6),
                          ce=round(ce, 4), kl=round(float(out.loss_kl.detach()), 4), margin=round(float(out.loss_margin.detach()), 4),
                          gnorm=round(float(gnorm), 3), tokens=tokens, zero_picks=zero,
                          min_load=round(float(share.min()), 3), max_load=round(float(share.max()), 3),
                          mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1) if self.device.type == "cuda" else 0,
                          tok_s=round(tok_s), **extras)
        train_s = time.time() - t0
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        phase_tok_s = clock.collect()
        self.log.update(steps=step, tokens_seen=tokens, train_s=round(train_s, 1),
                        first_steps_s=round(first_steps_s, 1), phase_tok_s=phase_tok_s,
                        phase_s={k: round(v, 1) for k, v in clock.seconds.items()})
        self.note(event="trained", steps=step, tokens=tokens, train_s=round(train_s, 1),
                  first_steps_s=round(first_steps_s, 1),
                  tok_s=round(tokens / max(train_s, 1e-9)), phase_tok_s=phase_tok_s)

    @torch.no_grad()
    def heldout(self, name: str, tokens: torch.Tensor, seq: int, max_windows: int, fake_quant: bool) -> dict:
        """Loss, zero-score picks and selection recall per index layer on held-out windows."""
        n = min(max_windows, (tokens.numel() - 1) // seq)
        if n == 0:
            return {}
        ids = tokens[: n * seq].view(n, seq).long()
        ce, zero, recall, recent = [], {}, {}, {}
        for b in range(n):
            out = self.fwd(ids[b: b + 1], StepOptions(fake_quant=fake_quant, analysis=True))
            ce.append(float(out.loss_ce))
            for L, v in out.zero_picks.items():
                zero.setdefault(L, []).append(float(v))
            for L, r in out.recall.items():
                recall.setdefault(L, []).append(float(r["recall"]))
                recent.setdefault(L, []).append(float(r["recent_k"]))
        mean = lambda d: {str(k): round(float(np.nanmean(v)), 4) for k, v in d.items()}
        result = {"loss": round(float(np.mean(ce)), 4), "windows": n, "seq": seq, "zero_picks": mean(zero),
                  "recall": mean(recall), "recent_k_recall": mean(recent)}
        self.note(event="heldout", name=name, **result)
        return result
