"""Train the project's byte-level BPE tokenizer on build/corpus/train.txt.

Vocabulary: 4096 ids in all. Fixed special ids (engine/tokenizer.py names them):
    0 <bos>   1 <eos>   2 <pad>   3 <image>   4 <dspark_noise>
then the 256 byte symbols, then 3835 merges. Writes assets/tokenizer/tokenizer.json and the
compressed (Engram) vocabulary assets/tokenizer/compressed_vocab.json.

Usage: python scripts/train_tokenizer.py [build/corpus/train.txt]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE, build_compressed_vocab, save_compressed_vocab  # noqa: E402

OUT_DIR = REPO / "assets" / "tokenizer"


def train(train_file: Path) -> Tokenizer:
    """Byte-level BPE with the special tokens first, so they take ids 0..4."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(train_file)], trainer)
    return tok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    train_file = Path(argv[0]) if argv else REPO / "build" / "corpus" / "train.txt"
    if not train_file.is_file():
        print(f"train_tokenizer: {train_file} not found; run scripts/build_corpus.py first", file=sys.stderr)
        return 1
    tok = train(train_file)
    for token, expected in SPECIAL_TOKENS.items():
        if tok.token_to_id(token) != expected:
            print(f"train_tokenizer: {token} got id {tok.token_to_id(token)}, expected {expected}", file=sys.stderr)
            return 1
    if tok.get_vocab_size() != VOCAB_SIZE:
        print(f"train_tokenizer: vocab {tok.get_vocab_size()} != {VOCAB_SIZE}", file=sys.stderr)
        return 1
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tok_path = OUT_DIR / "tokenizer.json"
    tok.save(str(tok_path))
    lookup, size = build_compressed_vocab(tok)
    save_compressed_vocab(OUT_DIR / "compressed_vocab.json", lookup, size, tok_path)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, compressed vocab {size} -> {OUT_DIR}", file=sys.stderr)
    print(json.dumps({"vocab_size": tok.get_vocab_size(), "compressed_vocab_size": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
