"""The engine's imports run one way: the forward (model, its ops) never reaches up to what runs it
(api, probes, the wavefront, parity checks, the service, the CLI), and no two modules import each
other at load time. Read from the source with `ast`, and checked once in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# what runs the forward; the forward's modules must not import these, not even inside a function
ABOVE_THE_FORWARD = ("engine.run", "engine.serve", "engine.train", "engine.cli", "engine.__main__")
# the forward: the model and the ops it calls (engine/ops/triton.py reaches kernels/, lazily)
FORWARD = ("engine.model", "engine.ops")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import in the file, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from pkg import mod` names a module when pkg/mod.py exists
            subs = [f"{target}.{a.name}" for a in node.names
                    if (ROOT / Path(*f"{target}.{a.name}".split("."))).with_suffix(".py").exists()
                    or (ROOT / Path(*f"{target}.{a.name}".split(".")) / "__init__.py").exists()]
            out += [(t, id(node) in top) for t in (subs or [target])]
    return out


def engine_modules() -> dict[str, list[tuple[str, bool]]]:
    return {module_name(p): imports(p) for p in sorted(ENGINE.rglob("*.py"))}


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") or name.startswith(p + "_") for p in prefixes)


def test_the_forward_never_imports_what_runs_it():
    bad = [(mod, target) for mod, targets in engine_modules().items() if _under(mod, FORWARD)
           for target, _ in targets if _under(target, ABOVE_THE_FORWARD)]
    assert bad == []


def test_no_import_cycle_at_load_time():
    """Module-level imports between engine modules form no cycle (a package's __init__ counts as
    importing its parents, as Python loads them)."""
    graph = {mod: {t for t, top in targets if top and t.startswith("engine")}
             for mod, targets in engine_modules().items()}
    names = set(graph)
    for mod in graph:  # importing a.b.c loads a.b first
        graph[mod] = {t for t in graph[mod] if t in names}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(mod, stack):
        state[mod] = 1
        for t in sorted(graph.get(mod, ())):
            if state.get(t) == 1:
                cycle.extend(stack[stack.index(t):] + [t] if t in stack else [mod, t])
                return True
            if t not in state and visit(t, stack + [t]):
                return True
        state[mod] = 2
        return False

    for mod in sorted(graph):
        if mod not in state and visit(mod, [mod]):
            break
    assert cycle == []


def test_importing_the_model_loads_nothing_above_it():
    code = ("import sys, engine.model.transformer, engine.ops; "
            "print(sorted(m for m in sys.modules if m.startswith(('engine', 'kernels', 'triton'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = eval(proc.stdout.strip().splitlines()[-1])
    assert "engine.model.transformer" in loaded
    assert [m for m in loaded if _under(m, ABOVE_THE_FORWARD + ("engine.ops.triton", "kernels", "triton"))] == []


def test_the_checks_see_a_planted_upward_import(tmp_path, monkeypatch):
    """The AST reading resolves relative imports: a forward module importing the api is caught."""
    pkg = tmp_path / "engine"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("def f():\n    from .. import api\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", pkg)
    assert ("engine.api", False) in imports(pkg / "ops" / "__init__.py")
