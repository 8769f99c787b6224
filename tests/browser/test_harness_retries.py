"""The browser harness's retry rule (no browser): a lost input is done again, a kept one is not, and the last
timeout is the one reported."""

from __future__ import annotations

import pytest

from harness import _until_settled

PlaywrightTimeout = pytest.importorskip("playwright.sync_api").TimeoutError


def _run(answers):
    """Acts, then settles with the next answer (True, False, or a timeout); returns how many acts it took."""
    acts, answers = [], iter(answers)

    def settled():
        answer = next(answers)
        if answer is PlaywrightTimeout:
            raise PlaywrightTimeout("timed out")
        return answer

    _until_settled(lambda: acts.append(1), settled, "the test input")
    return len(acts)


def test_a_kept_input_is_done_once():
    assert _run([True]) == 1


def test_a_lost_input_is_done_again_until_it_holds():
    assert _run([False, True]) == 2
    assert _run([PlaywrightTimeout, False, True]) == 3


def test_three_lost_inputs_fail_with_what_was_lost():
    with pytest.raises(AssertionError, match="the test input did not hold after 3 tries"):
        _run([False, False, False])
    with pytest.raises(PlaywrightTimeout):
        _run([False, PlaywrightTimeout, PlaywrightTimeout])
