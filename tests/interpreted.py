"""Kernel modules as the CPU tests run them: TRITON_INTERPRET=1 set before triton is imported, and each
module reloaded so its jit functions are the interpreter's even where an earlier test imported them
compiled. Import this before anything that imports triton."""

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"


def interpreted(*names: str):
    """kernels.<name> for each name, (re)built for the interpreter, in order (dependencies first)."""
    mods = [importlib.reload(importlib.import_module(f"kernels.{n}")) for n in names]
    return mods[0] if len(mods) == 1 else mods
