"""The project's byte-level BPE tokenizer and its Engram compressed vocabulary.

Special ids (fixed; scripts/train_tokenizer.py asserts them):
    <bos> 0, <eos> 1, <pad> 2 (also the Engram pad), <image> 3, <dspark_noise> 4.
Vocabulary: 4096 ids in all (5 special + 256 bytes + 3835 merges).

The compressed vocabulary follows the release's rule (inference/engram.py): every id is decoded on its
own; text holding U+FFFD (a partial UTF-8 byte sequence) is keyed by its raw token string, anything
else by NFKC -> NFD -> strip accents -> lowercase -> runs of [ \\t\\r\\n] to one space -> strip, where a
token that is exactly one space stays one space (and an empty result falls back to the decoded text).
Equal keys share a compressed id; ids are handed out in first-seen order over token ids.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as _Backend

SPECIAL_TOKENS = {"<bos>": 0, "<eos>": 1, "<pad>": 2, "<image>": 3, "<dspark_noise>": 4}
VOCAB_SIZE = 4096
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / "tokenizer.json"
COMPRESSED_NAME = "compressed_vocab.json"
MAX_TOKENIZER_BYTES = 64 << 20   # the project's tokenizer.json is ~0.3 MB; large public ones ~10 MB
MAX_COMPRESSED_BYTES = 64 << 20


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or inconsistent."""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet's inverse: printable Latin-1 bytes map to themselves, the other
    bytes to code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def _key_normalizer() -> normalizers.Normalizer:
    # the private-use sentinel lets a lone space survive Strip(), as in the release
    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def text_key(text: str, normalizer: normalizers.Normalizer | None = None) -> str:
    """The compression key of decoded token text that holds no U+FFFD."""
    normalized = (normalizer or _key_normalizer()).normalize_str(text)
    return normalized if normalized else text


def compression_key(backend: _Backend, token_id: int, normalizer: normalizers.Normalizer | None = None) -> str:
    """The key under which `token_id` is merged into the compressed vocabulary."""
    text = backend.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        return backend.id_to_token(token_id)
    return text_key(text, normalizer)


def build_compressed_vocab(backend: _Backend) -> tuple[list[int], int]:
    """(lookup[token id] -> compressed id, compressed vocabulary size)."""
    normalizer = _key_normalizer()
    key_to_id: dict[str, int] = {}
    lookup = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        key = compression_key(backend, token_id, normalizer)
        lookup.append(key_to_id.setdefault(key, len(key_to_id)))
    return lookup, len(key_to_id)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_compressed_vocab(path: Path, lookup: list[int], size: int, tokenizer_path: Path) -> None:
    """Write the map with the hash of the tokenizer it belongs to (checked on load)."""
    record = {
        "tokenizer_sha256": _sha256(Path(tokenizer_path)),
        "vocab_size": len(lookup),
        "compressed_vocab_size": size,
        "method": "release engram.py rule, see engine/tokenizer.py",
        "lookup": lookup,
    }
    Path(path).write_text(json.dumps(record, separators=(",", ":")) + "\n", encoding="utf-8")


class Tokenizer:
    """Thin wrapper over a `tokenizers` byte-level BPE; ids are plain Python ints."""

    def __init__(self, backend: _Backend, path: Path | None = None):
        self.backend = backend
        self.path = Path(path) if path is not None else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = backend.token_to_id("<bos>")
        self.eos_id = backend.token_to_id("<eos>")
        self.pad_id = backend.token_to_id("<pad>")
        self.image_id = backend.token_to_id("<image>")
        self.dspark_noise_id = backend.token_to_id("<dspark_noise>")
        self._special_ids = {i for i in (self.bos_id, self.eos_id, self.pad_id, self.image_id,
                                         self.dspark_noise_id) if i is not None}
        self._compressed: tuple[list[int], int] | None = None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, with <bos> first unless add_bos is False."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("this tokenizer has no <bos> token; call encode(text, add_bos=False)")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of a sequence of ids (special tokens kept by default)."""
        ids = self._check_ids(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one (non-special) token stands for."""
        raw = self.backend.id_to_token(token_id)
        table = _byte_decoder()
        if token_id in self._special_ids or any(ch not in table for ch in raw):
            return raw.encode("utf-8")
        return bytes(table[ch] for ch in raw)

    def token_strings(self, ids) -> list[str]:
        """Each id as readable text; bytes that are not valid UTF-8 on their own show as <0xNN>."""
        out = []
        for token_id in self._check_ids(ids):
            if token_id in self._special_ids:
                out.append(self.backend.id_to_token(token_id))
                continue
            text = self.token_bytes(token_id).decode("utf-8", errors="surrogateescape")
            out.append("".join(f"<0x{ord(ch) - 0xDC00:02X}>" if 0xDC80 <= ord(ch) <= 0xDCFF else ch for ch in text))
        return out

    def compressed_vocab(self) -> tuple[list[int], int]:
        """(lookup list of len vocab_size, compressed size): from compressed_vocab.json next to the
        tokenizer file when it was made for this exact file, otherwise built (and cached)."""
        if self._compressed is None:
            self._compressed = self._load_compressed() or build_compressed_vocab(self.backend)
        return self._compressed

    def _load_compressed(self) -> tuple[list[int], int] | None:
        """The cached map, or None (then it is built): also when the file is damaged, with a warning
        naming it, since the cache is only a shortcut."""
        if self.path is None:
            return None
        cached = self.path.parent / COMPRESSED_NAME
        if not cached.exists():
            return None
        from .safe_io import read_text
        try:
            record = json.loads(read_text(cached, "compressed vocabulary", MAX_COMPRESSED_BYTES, TokenizerError))
            lookup, size = record["lookup"], record["compressed_vocab_size"]
            if not (isinstance(lookup, list) and isinstance(size, int) and not isinstance(size, bool)
                    and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < size for v in lookup)):
                raise TokenizerError(f"{cached}: the lookup is not a list of ids below compressed_vocab_size")
        except (TokenizerError, ValueError, KeyError, TypeError, RecursionError) as err:
            reason = str(err) if isinstance(err, TokenizerError) else f"{cached}: not a compressed vocabulary ({err})"
            warnings.warn(f"{reason}; building the map from the tokenizer instead", RuntimeWarning, stacklevel=3)
            return None
        if record.get("tokenizer_sha256") != _sha256(self.path) or len(lookup) != self.vocab_size:
            return None
        return list(lookup), size

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return ids


def load_tokenizer(path: str | Path = DEFAULT_PATH) -> Tokenizer:
    """Load a tokenizer.json (or a folder holding one)."""
    from .safe_io import read_text

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.exists():
        raise TokenizerError(f"no tokenizer at {path}; build it with scripts/build_corpus.py")
    text = read_text(path, "tokenizer file", MAX_TOKENIZER_BYTES, TokenizerError)  # regular files only, bounded
    try:
        backend = _Backend.from_str(text)
    except Exception as err:  # the Rust side raises a bare Exception
        detail = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise TokenizerError(f"{path}: not a readable tokenizer.json ({detail})") from None
    return Tokenizer(backend, path)
