"""Expert + tensor parallelism over torch.distributed (torchrun: NCCL on GPUs, gloo on CPUs).

The split follows the release's reference code:
- embedding and head by vocabulary rows (embedding: masked lookup + all_reduce; head: all_gather);
- attention `wq_b` and `attn_sink` by heads, `wo_a` by groups, `wo_b` by input columns + all_reduce;
- the indexer's `wq_b` and `weights_proj` by index heads, with the partial index scores all_reduced
  before any masking or top-k;
- routed experts by contiguous ranges (each rank computes its own experts' share, then all_reduce);
  everything else (norms, wq_a, wkv, compressor, gate, shared expert, mHC, Engram) is replicated.

A `Parallel` object is the model's only handle on the group; with one process there is none (the
model's `parallel` is None) and nothing here is called. `ShardedWeights` gives each rank only its
slice of a weight, reading from a release-layout checkpoint only the rows it needs when the split is
along dim 0. For the kernel ops (engine/ops/triton.py) it hands out the slices in their stored formats
(`stored`: E4M3 rows or columns with their 32 x 32 scale blocks, owned experts' packed FP4), and with
`stored_formats` set its float values of FP8/FP4 weights are made per call and not kept, as
engine/ops/stored.py StoredWeights does in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..checkpoint.weights import TensorCache

WEIGHT_BLOCK = 32  # FP8 weights carry one scale per 32x32 block


class ParallelError(ValueError):
    """A model/world-size combination that cannot be split; the message says which count and why."""


# -- the group ---------------------------------------------------------------------------------------

class Parallel:
    """This process's place in the group: rank, world size, device, and the collectives the model
    uses. Every collective sums or gathers in fp32."""

    def __init__(self, rank: int, world: int, device: torch.device | str = "cpu", group=None):
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.group = group

    def __repr__(self) -> str:
        return f"Parallel(rank={self.rank}, world={self.world}, device={self.device})"

    # -- set-up ------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, backend: str | None = None, share_gpus: bool = False) -> "Parallel | None":
        """Join the group torchrun described in the environment (RANK, WORLD_SIZE, LOCAL_RANK,
        MASTER_ADDR/PORT). None when WORLD_SIZE is absent or 1: the single-process engine.
        share_gpus: more ranks than GPUs, rank r on GPU r % count, collectives through gloo (NCCL takes
        one rank a GPU): the parallel engine's GPU path checked where one GPU is lent, not timed."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if share_gpus:
            if not torch.cuda.is_available():
                raise ParallelError("sharing GPUs between ranks needs a GPU; none is visible to this process")
            if backend not in (None, "gloo"):
                raise ParallelError(f"ranks sharing a GPU talk through gloo, not {backend} (NCCL takes one rank a GPU)")
            backend, local = "gloo", local % torch.cuda.device_count()
        cuda = torch.cuda.is_available() and (backend != "gloo" or share_gpus)
        if cuda:
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            kwargs = {"device_id": device} if cuda and not share_gpus else {}
            dist.init_process_group(backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world, **kwargs)
        return cls(rank, world, device)

    def bind_thread(self) -> None:
        """Collectives on CUDA need the rank's device current in the calling thread too."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- splits ------------------------------------------------------------------------------------
    def split(self, n: int, what: str = "items") -> tuple[int, int]:
        """This rank's contiguous range [start, stop) of n items, n divisible by the world size."""
        if n % self.world:
            raise ParallelError(f"{n} {what} cannot be split evenly over {self.world} processes")
        part = n // self.world
        return self.rank * part, (self.rank + 1) * part

    def local(self, n: int, what: str = "items") -> int:
        a, b = self.split(n, what)
        return b - a

    def owns_expert(self, expert: int, n_experts: int) -> bool:
        a, b = self.split(n_experts, "routed experts")
        return a <= expert < b

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial t (fp32)."""
        y = t.float().contiguous()
        dist.all_reduce(y, group=self.group)
        return y

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t concatenated along the last axis, in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)

    def embed(self, local_table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of a vocab-split table: each rank looks up the ids it holds, zeros the rest, and the
        all_reduce adds exactly one real row per token. local_table: [V/world, dim] -> [T, dim]."""
        start = self.rank * local_table.shape[0]
        local = ids - start
        outside = (local < 0) | (local >= local_table.shape[0])
        rows = local_table[local.masked_fill(outside, 0)].float()
        return self.all_reduce(rows.masked_fill(outside[:, None], 0.0))

    def broadcast(self, obj=None):
        """Rank 0's object on every rank (pickled; requests of the service)."""
        box = [obj]
        nccl = self.device.type == "cuda" and dist.get_backend(self.group) == "nccl"
        dist.broadcast_object_list(box, src=0, group=self.group, device=self.device if nccl else None)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every rank's object, in rank order, on every rank (small things: memory, timings)."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def check_splittable(cfg: ModelConfig, world: int) -> None:
    """Raise ParallelError naming every count the reference splits that `world` does not divide."""
    counts = [("n_heads", cfg.n_heads), ("o_groups", cfg.o_groups), ("index_n_heads", cfg.index_n_heads),
              ("vocab_size", cfg.vocab_size), ("n_routed_experts", cfg.n_routed_experts)]
    bad = [f"{name}={n}" for name, n in counts if n % world]
    if bad:
        raise ParallelError(f"cannot split this model over {world} processes: {', '.join(bad)} "
                            f"not divisible by {world}")


# -- which weights are split, and how ---------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    dim: int      # the axis cut into `world` contiguous parts
    what: str     # the unit, for error messages (heads, groups, ...)


def split_of(name: str) -> Split | None:
    """How the reference splits the weight `name` (None: replicated)."""
    if name in ("embed.weight", "head.weight"):
        return Split(0, "vocabulary rows")
    if not name.startswith("layers."):
        return None
    leaf = name.split(".", 2)[2]
    return _LAYER_SPLITS.get(leaf)


_LAYER_SPLITS = {
    "attn.wq_b.weight": Split(0, "heads"),
    "attn.attn_sink": Split(0, "heads"),
    "attn.wo_a.weight": Split(0, "groups"),
    "attn.wo_b.weight": Split(1, "groups"),
    "attn.indexer.wq_b.weight": Split(0, "index heads"),
    "attn.indexer.weights_proj.weight": Split(0, "index heads"),
}


def expert_of(name: str) -> int | None:
    """The routed expert a backbone weight belongs to (`layers.L.ffn.experts.E.w1.weight` -> E)."""
    parts = name.split(".")
    if len(parts) > 4 and parts[0] == "layers" and parts[2] == "ffn" and parts[3] == "experts":
        return int(parts[4])
    return None


# -- per-rank weights ---------------------------------------------------------------------------------

class ShardedWeights:
    """A rank's view of a weight source: split weights come back as this rank's slice, replicated
    ones whole, routed experts only when this rank owns them. Over a CheckpointWeights, a dim-0
    slice reads only its rows (and the matching scale rows) from the shard file."""

    def __init__(self, base, parallel: Parallel, cfg: ModelConfig, cache_bytes: int = 2 << 30,
                 stored_formats: bool = False):
        from ..ops.stored import HandedOut
        check_splittable(cfg, parallel.world)
        self.base, self.parallel, self.cfg = base, parallel, cfg
        self.reader = getattr(base, "reader", None)
        self.device = parallel.device
        self.cache = TensorCache(cache_bytes)
        self.bytes_read = 0  # stored bytes read for split weights (tests of laziness)
        self.stored_formats = stored_formats  # the kernel ops run: FP8/FP4 float values are not kept
        self._stored: dict[str, torch.Tensor | None] = {}
        self._handed = HandedOut()

    # the WeightSource surface
    def has(self, name: str) -> bool:
        return self.base.has(name)

    def stored_dtype(self, name: str) -> str:
        return self.base.stored_dtype(name)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self.base.rows(name, index)

    def get(self, name: str) -> torch.Tensor:
        if self.stored_formats:
            value = self._from_stored(name)
            if value is not None:
                return value
        if self.device.type == "cpu" and split_of(name) is None:
            self._check_expert(name)
            return self.base.get(name)  # the base's own cache already holds it
        return self.cache.get(name, lambda n: self._load(n).to(self.device))

    # the stored formats (the kernel ops on this rank)
    def stored(self, name: str) -> torch.Tensor | None:
        """This rank's slice of `name` in its stored dtype on the rank's device (kept); None when the
        checkpoint has no such tensor, or a split FP8 weight's slice does not fall on its scale blocks."""
        if self.reader is None or name not in self.reader:
            return None
        self._check_expert(name)
        if name not in self._stored:
            self._stored[name] = self._stored_slice(name)
        return self._stored[name]

    def _stored_slice(self, name: str) -> torch.Tensor | None:
        reader = self.reader
        entry = reader.entry(name)
        weight = name[: -len(".scale")] + ".weight" if name.endswith(".scale") else name
        split = split_of(weight)
        if split is None:
            return reader.tensor(name).to(self.device)
        rows = reader.entry(weight).shape[split.dim] if weight in reader else entry.shape[split.dim]
        a, b = self.parallel.split(rows, split.what)
        scaled = weight.endswith(".weight") and weight[: -len(".weight")] + ".scale" in reader
        if scaled and (a % WEIGHT_BLOCK or b % WEIGHT_BLOCK):
            return None  # the slice would cut a scale block: the float path (get) serves this weight
        if name != weight:  # a scale: its blocks of 32 along the split axis
            a, b = a // WEIGHT_BLOCK, b // WEIGHT_BLOCK
        if split.dim == 0 and len(entry.shape) == 2 and hasattr(reader, "read_rows"):
            t = reader.read_rows(name, np.arange(a, b))  # only this rank's rows leave the file
        else:
            t = reader.tensor(name).narrow(split.dim, a, b - a).contiguous()
        self.bytes_read += t.numel() * t.element_size()
        return t.to(self.device)

    def _from_stored(self, name: str) -> torch.Tensor | None:
        """The float value of an FP8/FP4 weight from this rank's stored slice, made for this call and
        not kept; None for any other weight (the cached float path)."""
        from ..ops.stored import QUANTIZED
        if self.reader is None or not name.endswith(".weight") or name not in self.reader \
                or self.stored_dtype(name) not in QUANTIZED:
            return None
        w, s = self.stored(name), self.stored(name[: -len(".weight")] + ".scale")
        if w is None or s is None:
            return None
        return self._handed.dequantized(name, w, s, self.reader)

    def _check_expert(self, name: str) -> None:
        expert = expert_of(name)
        if expert is not None and not self.parallel.owns_expert(expert, self.cfg.n_routed_experts):
            a, b = self.parallel.split(self.cfg.n_routed_experts)
            raise KeyError(f"'{name}': rank {self.parallel.rank} holds routed experts {a}..{b - 1} only")

    def _load(self, name: str) -> torch.Tensor:
        self._check_expert(name)
        split = split_of(name)
        if split is None:
            return self.base.get(name)
        if self.reader is None:
            full = self.base.get(name)
            a, b = self.parallel.split(full.shape[split.dim], split.what)
            return full.narrow(split.dim, a, b - a).contiguous()
        return self._read_slice(name, split)

    def _read_slice(self, name: str, split: Split) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor, dequantized to float32."""
        from .. import quant

        reader = self.reader
        name = name if name in reader else name + ".weight"
        entry = reader.entry(name)
        a, b = self.parallel.split(entry.shape[split.dim] * (2 if entry.dtype == "I8" and split.dim == 1 else 1),
                                   split.what)
        scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        scale_name = scale_name if scale_name is not None and scale_name in reader else None
        aligned = a % WEIGHT_BLOCK == 0 and b % WEIGHT_BLOCK == 0
        if scale_name is not None and (entry.dtype != "F8_E4M3" or not aligned):
            # a layout the slicing below does not know: dequantize whole, then cut (same values)
            full = reader.dequantized(name)
            self.bytes_read += entry.nbytes
            return full.narrow(split.dim, a, b - a).contiguous()
        if split.dim == 0 and len(entry.shape) == 2:
            w = reader.read_rows(name, np.arange(a, b))
            self.bytes_read += w.numel() * w.element_size()
            if scale_name is None:
                return w.float()
            s = reader.read_rows(scale_name, np.arange(a // WEIGHT_BLOCK, b // WEIGHT_BLOCK))
            return quant.dequantize_fp8_weight(w, s, WEIGHT_BLOCK)
        w = reader.tensor(name)  # 1-D sinks, and column splits (wo_b): read whole, dequantize the slice
        self.bytes_read += entry.nbytes
        w = w.narrow(split.dim, a, b - a)
        if scale_name is None:
            return w.float().contiguous()
        s = reader.tensor(scale_name).narrow(split.dim, a // WEIGHT_BLOCK, (b - a) // WEIGHT_BLOCK)
        return quant.dequantize_fp8_weight(w.contiguous(), s.contiguous(), WEIGHT_BLOCK)
