"""How long the explorer takes, against its budget (a layer click should show its views in under 1 s
once the prompt has run).

    python benches/ui.py            # the pure builders behind one render (release config, synthetic run)
    python benches/ui.py --browser  # also, in Debian's chromium: time to first paint on a fresh start, the
                                    # first run of a 1,000-token prompt, and click-to-view after it

Each row prints its time and its share of the 1 s click budget measured against in the same run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from engine.config import release_config  # noqa: E402
from engine.roles import role_plan  # noqa: E402
from engine.tally import tally_from_config  # noqa: E402
from explorer import layer_views as lv, selection_view as sel  # noqa: E402
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
        f"picks' scores + prompt panel ({T} tokens) + to_json": lambda: sel.selection_figure(
            sel.query_scores(probe, T - 1), probe, 1, run["tokens"]).to_json(),
        f"gate-score margins ({T}x384) + to_json": lambda: sel.routing_figure(probe, T - 1).to_json(),
        f"layer CSV ({T} tokens)": lambda: lv.layer_csv(run, 24),
    }
    rows = [(name, best_ms(fn)) for name, fn in cases.items()]
    if "--browser" in sys.argv:
        rows += browser_timings()
    width = max(len(name) for name, _ in rows)
    print(f"{'what':<{width}}  {'ms':>8}  {'of 1 s click budget':>19}")
    for name, ms in rows:
        print(f"{name:<{width}}  {ms:8.1f}  {ms / CLICK_BUDGET_MS:18.0%}")


CLICK_BUDGET_MS = 1000.0


def browser_timings() -> list[tuple[str, float]]:
    """First paint, first run of a long prompt, and click-to-view, in a real browser."""
    sys.path.insert(0, str(REPO / "tests" / "browser"))
    from harness import CHROMIUM, CHROMIUM_ARGS, streamlit_server
    from playwright.sync_api import sync_playwright

    prompt, n_tokens = thousand_token_prompt()
    rows = []
    log = REPO / "test-artifacts" / "bench_ui.log"
    with streamlit_server({"EXPLORER_SOURCE": "shipped", "EXPLORER_TIMING": "1"}, "bench_ui.log") as url, \
            sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1680, "height": 1300})
        start = time.perf_counter()
        page.goto(url + "/?layer=2&tab=full_m2")
        page.wait_for_selector(".st-key-plan_chart .js-plotly-plot .scatterlayer .point", timeout=300_000)
        rows.append(("browser: first paint of the plan (fresh start)", 1000 * (time.perf_counter() - start)))
        page.locator(".st-key-prompt_text textarea").fill(prompt)
        page.keyboard.press("Control+Enter")
        start = time.perf_counter()
        # the sample prompt's views are already drawn (same layer): this prompt's are drawn when the token
        # strip has one chip per token of it
        page.wait_for_function(f"() => document.querySelectorAll('.st-key-token_strip .strip > span[title]').length"
                               f" === {n_tokens}", timeout=300_000)
        views_drawn(page, 2)
        rows.append((f"browser: first run of a {n_tokens}-token prompt (all layers)", 1000 * (time.perf_counter() - start)))
        clicks, parts = [], {}
        for layer in CLICKED_LAYERS:
            settled(page)
            trace = page.locator(".st-key-plan_chart .js-plotly-plot .scatterlayer .trace").last
            seen = len(log.read_text().splitlines())
            start, clicked_at = time.perf_counter(), time.time()
            trace.locator(".point").nth(layer).click(force=True)
            views_drawn(page, layer)
            done_at = time.time()
            clicks.append(1000 * (time.perf_counter() - start))
            rows.append((f"browser: click-to-view, layer {layer}", clicks[-1]))
            for name, ms in server_timings(log.read_text().splitlines()[seen:], clicked_at, done_at):
                parts.setdefault(name, []).append(ms)
        browser.close()
    rows.append((f"browser: click-to-view, median of {len(clicks)}", statistics.median(clicks)))
    rows.append((f"browser: click-to-view, slowest of {len(clicks)}", max(clicks)))
    rows += [(f"  {name}, median", statistics.median(ms)) for name, ms in parts.items()]
    return rows


# every role, twice: the first visit of a layer and a return to it
CLICKED_LAYERS = (24, 9, 20, 31, 2, 14) * 2


def settled(page) -> None:
    """Wait until the browser has finished the previous update, as a user reading the page would."""
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=300_000)
    page.wait_for_timeout(400)
    page.evaluate("() => new Promise(done => requestIdleCallback(() => done(), {timeout: 3000}))")


def thousand_token_prompt() -> tuple[str, int]:
    """The first ~1,000 tokens of the long sample prompt (the issue's benchmark size), and the count
    the app will see (BOS included)."""
    from engine.tokenizer import load_tokenizer
    tok = load_tokenizer(REPO / "assets" / "model" / "tokenizer.json")
    text = (REPO / "assets" / "prompts" / "04_long_incident_review.txt").read_text()
    ids = tok.encode(text, add_bos=True)
    prompt = tok.decode(ids[1:1000])
    return prompt, len(tok.encode(prompt, add_bos=True))


def server_timings(lines: list[str], clicked_at: float, done_at: float) -> list[tuple[str, float]]:
    """The app's own per-section times for one rerun (EXPLORER_TIMING lines in the server log), and
    where the rest of the click went: click -> script start, script end -> views drawn."""
    out, marks = [], {}
    for line in lines:
        if line.startswith("[timing] "):
            name, value, unit = line[len("[timing] "):].rsplit(" ", 2)
            if unit == "s":
                marks[name] = float(value)
            else:
                out.append((f"server: {name}", float(value)))
    if "script-started-at" in marks:
        out.append(("browser: click -> script start", 1000 * (marks["script-started-at"] - clicked_at)))
    if "script-ended-at" in marks:
        out.append(("browser: script end -> views drawn", 1000 * (done_at - marks["script-ended-at"])))
    return out


def views_drawn(page, layer: int) -> None:
    page.wait_for_selector(f"h2:has-text('Layer {layer} · ')", timeout=300_000)
    for key in ("topk_map", "mhc_token", "routing_map", "token_strip",   # each says its layer once drawn
                "topk_scores", "routing_margin"):
        page.wait_for_selector(f".st-key-{key} [data-tag='layer {layer}']", timeout=300_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=300_000)


if __name__ == "__main__":
    main()
