"""Repository layout rules (issue 17): no Python module over 600 lines, anywhere in the repository
(tests and scripts included), and app.py stays wiring: it builds no page section itself."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def _python_files() -> list[Path]:
    """Every .py file git knows of or would add (tracked, and untracked but not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def test_no_module_is_over_600_lines():
    files = _python_files()
    assert len(files) > 100 and ROOT / "app.py" in files   # the listing found the repository
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text(encoding="utf-8", errors="replace").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_app_is_wiring_only():
    """app.py defines no section of its own beyond the analysis fragment and main(), and draws no chart."""
    tree = ast.parse((ROOT / "app.py").read_text(encoding="utf-8"))
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert functions <= {"analysis", "main"}, functions
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"chart", "named_chart", "plotly_chart"}
    assert "<style>" not in (ROOT / "app.py").read_text(encoding="utf-8")
