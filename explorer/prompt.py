"""The prompt side of the sidebar: shipped sample prompts, the model source choice, token counts and
the image span (positions routed with `bias_vl`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT_DIR = REPO_ROOT / "assets" / "prompts"
MODEL_DIR = REPO_ROOT / "assets" / "model"
RELEASE_CONFIG = REPO_ROOT / "assets" / "configs" / "v41-flash.json"

SOURCE_SHIPPED, SOURCE_PATH, SOURCE_CONFIG = "shipped", "path", "config"
SOURCE_TITLES = {SOURCE_SHIPPED: "Shipped small model", SOURCE_PATH: "Checkpoint folder",
                 SOURCE_CONFIG: "Config only (release)"}
MAX_UPLOAD_BYTES = 2_000_000


class PromptError(ValueError):
    """Unusable prompt input (upload, span); the message is shown to the user as is."""


@dataclass(frozen=True)
class Sample:
    id: str          # file stem, e.g. "01_python_lru_cache"
    title: str       # "Python lru cache"
    text: str


def sample_prompts(directory: Path = PROMPT_DIR) -> list[Sample]:
    """The shipped prompts, sorted by file name."""
    out = []
    for path in sorted(directory.glob("*.txt")):
        stem = path.stem
        words = stem.split("_", 1)[1] if "_" in stem and stem.split("_", 1)[0].isdigit() else stem
        out.append(Sample(stem, words.replace("_", " ").capitalize(), path.read_text(encoding="utf-8")))
    return out


def decode_upload(name: str, data: bytes) -> str:
    """Text of an uploaded file: UTF-8 only, bounded in size."""
    if len(data) > MAX_UPLOAD_BYTES:
        raise PromptError(f"{name} is {len(data):,} bytes; the limit is {MAX_UPLOAD_BYTES:,}.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PromptError(f"{name} is not UTF-8 text (byte {err.start} is invalid).") from None
    if not text.strip():
        raise PromptError(f"{name} is empty.")
    return text


@lru_cache(maxsize=4)
def _tokenizer(path: str | None):
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(path) if path else load_tokenizer()


def tokenize(text: str, tokenizer_path: str | None = None) -> tuple[list[int], list[str]]:
    """Token ids and strings with the shipped tokenizer (or a checkpoint's own tokenizer.json)."""
    tok = _tokenizer(tokenizer_path)
    ids = tok.encode(text, add_bos=True)
    return ids, tok.token_strings(ids)


def parse_span(raw: str, n_tokens: int) -> tuple[int, int] | None:
    """'12-40' (or '12:40', end exclusive) -> (12, 40); empty -> None; anything else raises."""
    raw = (raw or "").strip()
    if not raw:
        return None
    for sep in ("-", ":", "..", ","):
        if sep in raw:
            a, b = raw.split(sep, 1)
            break
    else:
        raise PromptError(f"image span '{raw}' should look like 12-40 (start inclusive, end exclusive).")
    try:
        start, end = int(a.strip().strip(".")), int(b.strip().strip("."))
    except ValueError:
        raise PromptError(f"image span '{raw}' should be two token positions, like 12-40.") from None
    if not 0 <= start < end <= n_tokens:
        raise PromptError(f"image span {start}-{end} must lie within the prompt's {n_tokens} tokens "
                          "(start < end).")
    return start, end
