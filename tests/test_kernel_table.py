"""benches/kernel_table.py: each case's newest row, labelled with its run."""

import json

from benches import kernel_table


def _row(name, us):
    return {"name": name, "us": us, "floor_us": 10.0, "limit": "HBM", "goal_us": 20, "extra": "", "check": "ok"}


def test_each_case_takes_its_newest_run(tmp_path):
    old = {"date": "2026-12-01 10:00 UTC", "rows": [_row("a", 100.0), _row("b", 50.0)]}
    new = {"date": "2026-12-02 10:00 UTC", "rows": [_row("a", 80.0)]}
    paths = []
    for name, log in (("old-log.json", old), ("new-log.json", new)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(log))
    out = tmp_path / "t.md"
    kernel_table.main([str(p) for p in paths] + ["--out", str(out)])
    rows = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| a")
            or line.startswith("| b")}
    assert "| 80.0 |" in rows["a"] and "new-log.json, 2026-12-02" in rows["a"]
    assert "| 50.0 |" in rows["b"] and "old-log.json, 2026-12-01" in rows["b"]
    assert "| 12% |" in rows["a"]  # 10 / 80 of its own run's ceiling
