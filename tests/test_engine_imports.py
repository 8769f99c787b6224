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


# -- one seam: the forward takes its ops, it does not choose or fall back (issue 15 item 3) -------------

OPS_NAMES = {"ops", "gemm", "act"}  # what carries the numerics and the kernels into the forward


def seam_breaches(paths) -> list[str]:
    """Where forward modules pick arithmetic of their own: an `ops`/`gemm`/`act` tested against None
    (a fallback when none was given), an import of a particular ops module (engine.ops.fp32, ...), a
    function named for kernels (kernel specifics belong in engine/ops/triton.py). The model's
    constructor choosing once through `engine.ops.for_model` is the seam itself and allowed."""
    bad = []
    for path in paths:
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                names = [n for n in [node.left, *node.comparators] if isinstance(n, ast.Name) and n.id in OPS_NAMES]
                attrs = [n for n in [node.left, *node.comparators] if isinstance(n, ast.Attribute) and n.attr in OPS_NAMES]
                if names or attrs:
                    bad.append(f"{where}:{node.lineno} tests {(names or attrs)[0].__class__.__name__} against None")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "kernel" in node.name:
                bad.append(f"{where}:{node.lineno} def {node.name}")
        for target, _ in imports(path):
            if _under(target, ("engine.ops",)) and target != "engine.ops":
                bad.append(f"{where} imports {target}")
            if target == "engine.ops" and path.name != "transformer.py":
                bad.append(f"{where} imports engine.ops (only the Model chooses its ops)")
    return bad


def test_the_forward_takes_its_ops_with_no_fallbacks():
    assert seam_breaches(sorted((ENGINE / "model").glob("*.py"))) == []


def test_the_seam_check_sees_a_planted_fallback(tmp_path, monkeypatch):
    pkg = tmp_path / "engine" / "model"
    pkg.mkdir(parents=True)
    (tmp_path / "engine" / "ops").mkdir()
    (tmp_path / "engine" / "ops" / "fp32.py").write_text("")
    (pkg / "attention.py").write_text(
        "from ..ops.fp32 import Fp32Ops\n"
        "def f(ops=None, gemm=None):\n    ops = ops if ops is not None else Fp32Ops()\n"
        "    return 1 if gemm is None else 2\n"
        "class Indexer:\n    def index_kernels(self):\n        pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad = seam_breaches([pkg / "attention.py"])
    assert len(bad) == 4, bad
