"""engine.train.eval (`python -m engine eval`): the CLI's numbers against a direct forward, and its errors."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from engine.train import eval as ev
from engine.run.api import load

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n"


def test_cli_matches_direct_forward(tmp_path, capsys):
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert ev.main(["--text-file", str(path), "--json", "--max-len", "2048"]) == 0
    out = json.loads(capsys.readouterr().out)
    engine = load()
    ids = engine.tokenizer.encode(TEXT, add_bos=True)
    with torch.inference_mode():
        engine.model.reset()
        logits = engine.model.forward(torch.tensor(ids))
    direct = F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item()
    assert out["tokens"] == len(ids) - 1
    assert math.isclose(out["loss"], direct, rel_tol=1e-4)  # summation order (thread count) differs
    assert math.isclose(out["perplexity"], math.exp(out["loss"]), rel_tol=1e-12)
    # short windows restart the caches: same token count, a (slightly) different loss
    assert ev.main(["--text-file", str(path), "--json", "--max-len", "8"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["tokens"] == out["tokens"]


def test_cli_errors(tmp_path, capsys):
    assert ev.main(["--text-file", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in capsys.readouterr().err
    empty = tmp_path / "e.txt"
    empty.write_text("  \n", encoding="utf-8")
    assert ev.main(["--text-file", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err


def test_text_file_is_bounded_and_regular(tmp_path, capsys, monkeypatch):
    """The text is read like every other file the engine opens (engine/safe_io.py): a regular file
    under a size cap, UTF-8; anything else is one line naming the path, before any model loads."""
    import os

    def load_refused(*a, **k):
        raise AssertionError("the checkpoint was loaded for a text that cannot be read")

    monkeypatch.setattr("engine.run.api.load", load_refused)
    monkeypatch.setattr(ev, "MAX_TEXT_BYTES", 100)
    big = tmp_path / "big.txt"
    big.write_text("x" * 101, encoding="utf-8")
    assert ev.main(["--text-file", str(big)]) == 2
    err = capsys.readouterr().err
    assert "101 bytes" in err and "(100)" in err and err.count("\n") == 1
    assert ev.main(["--text-file", str(tmp_path)]) == 2
    assert "folder" in capsys.readouterr().err
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # reading it would block forever
    assert ev.main(["--text-file", str(fifo)]) == 2
    assert "FIFO" in capsys.readouterr().err
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    assert ev.main(["--text-file", str(latin)]) == 2
    assert "not UTF-8" in capsys.readouterr().err
