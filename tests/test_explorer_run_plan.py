"""explorer/run_plan.py: when the explorer runs the model, what it probes and why it does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config
from engine.roles import role_plan
from explorer import run_plan
from explorer.prompt import SOURCE_CONFIG, SOURCE_PATH, SOURCE_SHIPPED

RELEASE = Path(__file__).resolve().parents[1] / "assets" / "configs" / "v41-flash.json"


@pytest.fixture(scope="module")
def plan():
    return role_plan(load_config(RELEASE))


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 8)
    return tmp_path


def test_probe_layers_follow_the_top_k_source(plan):
    # the release: layer 2 is Full m=2 (its own top-k), 19 reuses 14's, 21 reuses 20's, 0 is SWA-only
    assert run_plan.probe_layers(plan[2]) == (2,)
    assert run_plan.probe_layers(plan[19]) == (14, 19)
    assert run_plan.probe_layers(plan[21]) == (20, 21)
    assert run_plan.probe_layers(plan[0]) == (0,)


def test_weights_folder_needs_shards_and_a_weights_source(tmp_path, ckpt):
    assert run_plan.weights_folder(SOURCE_PATH, str(ckpt)) == ckpt
    assert run_plan.weights_folder(SOURCE_SHIPPED, str(ckpt)) == ckpt
    assert run_plan.weights_folder(SOURCE_CONFIG, str(ckpt)) is None       # config only never loads weights
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_plan.weights_folder(SOURCE_PATH, str(empty)) is None
    assert run_plan.weights_folder(SOURCE_PATH, "/does/not/exist") is None


def test_why_no_run_first_reason_wins(plan, ckpt):
    layer = plan[20]
    assert run_plan.why_no_run(SOURCE_PATH, str(ckpt), "hello", layer, remote=False) is None
    assert run_plan.why_no_run(SOURCE_CONFIG, str(ckpt), "hello", layer, remote=False) == run_plan.NO_WEIGHTS_CONFIG
    no_weights = run_plan.why_no_run(SOURCE_PATH, "/does/not/exist", "hello", layer, remote=False)
    assert no_weights.startswith("No weights at /does/not/exist")
    # a remote engine needs no local shards
    assert run_plan.why_no_run(SOURCE_PATH, "/does/not/exist", "hello", layer, remote=True) is None
    assert run_plan.why_no_run(SOURCE_PATH, str(ckpt), "  \n", layer, remote=False) == run_plan.EMPTY_PROMPT
    assert run_plan.why_no_run(SOURCE_PATH, str(ckpt), "hello", plan[41], remote=False) == run_plan.DSPARK_NOT_RUN


def test_parity_needs_local_weights_a_prompt_and_a_model_layer(plan, ckpt):
    ok = run_plan.parity_blocker(SOURCE_PATH, str(ckpt), "hi", plan[2], remote=False)
    assert ok is None
    for args in [(SOURCE_CONFIG, str(ckpt), "hi", plan[2], False), (SOURCE_PATH, str(ckpt), "hi", plan[2], True),
                 (SOURCE_PATH, str(ckpt), "", plan[2], False), (SOURCE_PATH, str(ckpt), "hi", plan[40], False),
                 (SOURCE_PATH, "/does/not/exist", "hi", plan[2], False)]:
        assert run_plan.parity_blocker(*args[:4], remote=args[4]) == run_plan.PARITY_NEEDS, args


def test_interpreter_possible_only_before_the_kernels_load():
    assert run_plan.interpreter_possible(False, {})                            # not imported yet: can switch on
    assert not run_plan.interpreter_possible(False, {"kernels.sparse_attn": object()})   # compiled kernels loaded
    assert run_plan.interpreter_possible(True, {"kernels.sparse_attn": object()})        # already interpreted
