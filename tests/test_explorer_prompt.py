"""Sidebar helpers: sample prompts, uploads, image spans."""

from __future__ import annotations

import pytest

from explorer import prompt as pr


def test_samples_are_shipped_and_long_one_is_long():
    samples = pr.sample_prompts()
    assert len(samples) >= 3
    lengths = {s.id: len(pr.tokenize(s.text)[0]) for s in samples}
    assert max(lengths.values()) >= 1000
    assert any("def " in s.text for s in samples)          # a code prompt


def test_parse_span():
    assert pr.parse_span("", 10) is None
    assert pr.parse_span("2-5", 10) == (2, 5)
    assert pr.parse_span(" 0:10 ", 10) == (0, 10)
    for bad in ("5-2", "3-11", "a-b", "7"):
        with pytest.raises(pr.PromptError):
            pr.parse_span(bad, 10)


def test_decode_upload():
    assert pr.decode_upload("a.txt", "héllo".encode()) == "héllo"
    with pytest.raises(pr.PromptError, match="not UTF-8"):
        pr.decode_upload("a.bin", b"\xff\xfe\x00")
    with pytest.raises(pr.PromptError, match="empty"):
        pr.decode_upload("a.txt", b"  \n")
