"""How long the explorer's pure builders take (the work behind one page render), on the release config
and a synthetic 1,000-token run. Run: `python benches/ui.py` (prints ms per builder, best of 5)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from engine.config import release_config  # noqa: E402
from engine.roles import role_plan  # noqa: E402
from engine.tally import tally_from_config  # noqa: E402
from explorer import layer_views as lv  # noqa: E402
from explorer.diagram import diagram_figure  # noqa: E402
from explorer.kv_view import kv_figure  # noqa: E402
from explorer.plan import plan_figure  # noqa: E402
from explorer.tally_view import box_stats, layer_params, margin_lines, tally_figure  # noqa: E402
from explorer_synth import synthetic_layer, synthetic_run  # noqa: E402


def best_ms(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    cfg = release_config()
    plan = role_plan(cfg)
    tally = tally_from_config(cfg)
    T = 1000
    run = synthetic_run(T, {24: synthetic_layer(T, k=64, n_experts=384, seed=1)})
    probe = lv.layer_probe(run, 24)
    topk = lv.topk_model(run, probe)
    routing = lv.routing_model(run, probe, 384)
    cases = {
        "tally_from_config (cached by the app)": lambda: tally_from_config(cfg),
        "plan_figure + to_json": lambda: plan_figure(cfg, plan, layer_params=layer_params(tally), selected=24).to_json(),
        "diagram_figure(reindex) + to_json": lambda: diagram_figure(cfg, "reindex", box_stats(tally, 24),
                                                                    role=plan[24]).to_json(),
        "tally margin + figure + to_json": lambda: tally_figure(margin_lines(tally, "decode"), "decode").to_json(),
        "kv_figure + to_json": lambda: kv_figure(cfg, 1_000_000).to_json(),
        f"topk map ({T} tokens) + to_json": lambda: lv.topk_figure(topk, query=T - 1).to_json(),
        f"token strip ({T} tokens)": lambda: lv.token_strip_html(run["tokens"], lv.selection_counts(topk)),
        f"routing heatmap ({T}x384) + to_json": lambda: lv.routing_heatmap(routing, run["tokens"]).to_json(),
        "mHC token figure + to_json": lambda: lv.mhc_token_figure(probe, T - 1).to_json(),
        f"layer CSV ({T} tokens)": lambda: lv.layer_csv(run, 24),
    }
    width = max(map(len, cases))
    for name, fn in cases.items():
        print(f"{name:<{width}}  {best_ms(fn):8.1f} ms")


if __name__ == "__main__":
    main()
