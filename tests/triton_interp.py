"""A faster Triton CPU interpreter for the tests, computing exactly what the stock one computes.

Triton's interpreter (triton/runtime/interpreter.py) swaps triton.language's builtins for interpreted
versions at every kernel launch AND at every call of a @triton.jit helper from inside a kernel
(`_patch_lang`). Each swap runs `inspect.getmembers` over tl, tl.core, tl.tensor, tl.math and
tl.core.tensor_descriptor_base (hundreds of attributes, sorted) to find the builtins. On this
project's kernels, called from the engine's forward, that scan (and the garbage it makes) is most of
the interpreted time: tests/test_kernel_path.py's worker took 175 s on one core with it, 53 s without,
its JSON the same bit for bit; tests/test_kernels_*.py (larger tiles, fewer calls) 115 s -> 85 s.

`speed_up()` replaces that scan with a list of the builtin names taken once, while nothing is
patched. What gets patched is unchanged: the same names, in the same (sorted) order, each only if
its current value is still a builtin, exactly as the stock filter decides. (After the snapshot the
set of builtin-valued names can only shrink: patches turn builtins into lambdas, and a scope
restores only values it recorded during a launch, so a name outside the snapshot can never be a
builtin again.) Packages not in the snapshot, and Triton versions whose interpreter does not have
this shape, keep the stock code.
"""

from __future__ import annotations

import inspect
import os

_DONE = {"installed": False}


def env_without_interpreter() -> dict:
    """This process's environment without TRITON_INTERPRET, for a subprocess whose kernels must not be
    interpreted (the kernel test modules set it in the suite's process; a child would inherit it)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def speed_up() -> bool:
    """Install the cached builtin scan (idempotent); False if this Triton's interpreter differs."""
    if _DONE["installed"]:
        return True
    from triton import language as tl
    from triton.runtime import interpreter

    stock = getattr(interpreter, "_patch_builtin", None)
    if stock is None or list(inspect.signature(stock).parameters) != ["pkg", "builder", "scope"] \
            or not hasattr(interpreter, "_patch_attr") or not hasattr(tl.core, "is_builtin"):
        return False
    pkgs = [tl, tl.core, tl.tensor, tl.math]
    if hasattr(tl.core, "tensor_descriptor_base"):
        pkgs.append(tl.core.tensor_descriptor_base)
    names: dict[int, tuple[object, list[str]]] = {}
    for pkg in pkgs:
        found = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        if not found:   # something is patched right now: no snapshot, stock code
            return False
        names[id(pkg)] = (pkg, found)

    def _patch_builtin(pkg, builder, scope):
        hit = names.get(id(pkg))
        if hit is None or hit[0] is not pkg:
            return stock(pkg, builder, scope)
        for name in hit[1]:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin
    _DONE["installed"] = True
    return True
