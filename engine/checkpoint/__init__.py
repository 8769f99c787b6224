"""Checkpoint I/O: layout.py (the tensor contract), inventory.py (headers, no torch), reader.py,
writer.py, weights.py (where a tensor comes from: file, memory, a rank's shard).

Import from the files: this package imports nothing, so the header-only inventory loads without torch."""
