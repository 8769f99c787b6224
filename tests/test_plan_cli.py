"""`python -m engine plan`: the issue's command line, its JSON, and one-line errors."""

from __future__ import annotations

import json

from engine.cli import main


def test_plan_command_text_and_json(capsys):
    args = ["plan", "--gpu", "h200", "--gpus", "8", "--ep", "8", "--tp", "1", "--batch", "64", "--context", "131072"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "NVIDIA H200 SXM x 8: EP 8, TP 1" in text and "fits: 64 sequence(s) per GPU" in text
    assert "decode step:" in text and "prefill chunk of 4,096 ending at 131,072" in text
    assert main(args + ["--json", "--dp-attention", "--engram", "host"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["dp_attention"] is True and out["memory"]["sequences_per_gpu"] == 8
    assert out["memory"]["weights"]["Engram tables"] == 0 and out["memory"]["host_bytes"] == 202_758_032_400
    assert out["tokens_per_s"] == 64 / out["decode"]["time_s"]
    assert {r["role"] for r in out["decode"]["rows"]} >= {"SWA-only", "Full m=1", "Reindex m=1 (pool)", "Reuse m=2"}


def test_plan_command_errors_are_one_line(capsys):
    assert main(["plan", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: plan: tp=3 does not divide gpus=8"
    assert main(["plan", "--context", "2000000"]) == 2
    assert "model's maximum 1,048,576" in capsys.readouterr().err
    assert main(["plan", "--gpu", "a100"]) == 2
    assert "invalid choice: 'a100'" in capsys.readouterr().err
