"""The forward, one concept a file, named as the official reference names them: transformer.py (Model:
embed, the blocks, head), attention.py (Attention, its Compressor and Indexer parts, the caches),
moe.py (Gate, MoE), mhc.py, engram.py, rope.py, selection_probe.py (the detail probes).

Import from the files (`from engine.model.transformer import Model`): this package imports nothing, so
engine/ops can use mhc.py and rope.py without loading the model."""
