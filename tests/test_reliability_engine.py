"""Hostile files and arguments at the engine's doors (issue 16): FIFOs and devices where files belong,
truncated or non-UTF-8 files, unbounded counts, wrong argument types, NaN weights, overlapping tensors.
Each gets one clear message (or, for NaN weights, one warning); nothing hangs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import warnings
from pathlib import Path

import pytest
import torch

from engine.cli import main as cli
from engine.run.api import EngineError, load
from engine.checkpoint.inventory import CheckpointError, read_inventory
from engine.config import ConfigError, load_config, release_config
from engine.tokenizer import TokenizerError, build_compressed_vocab, load_tokenizer
from engine.checkpoint.weights import random_weights
from tests.engine_helpers import tiny_config, write_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite) when the block blocks: SIGALRM interrupts a blocked open/read."""
    def expired(*_):
        raise TimeoutError(f"still blocked after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small checkpoint (no Engram, so no tokenizer needed) with max_seq_len 40."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_rel"), 3, 2, engram_layer_ids=(),
                                 engram_num_embeddings=(), max_seq_len=40)


@pytest.fixture
def copy_of(tiny, tmp_path):
    def make() -> Path:
        out = tmp_path / "ckpt"
        shutil.copytree(tiny, out)
        return out
    return make


def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def device(path: Path) -> Path:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")
    return path


def one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


# -- 2. FIFOs and devices where a file belongs ----------------------------------------------------

@pytest.mark.parametrize("make, kind", [(fifo, "FIFO"), (device, "device")])
def test_config_that_is_a_fifo_or_device_is_refused(tmp_path, make, kind):
    with deadline(20), pytest.raises(ConfigError, match=f"config.json: is a {kind}"):
        load_config(make(tmp_path / "config.json"))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "shard", "tokenizer.json"])
@pytest.mark.parametrize("make, kind", [(fifo, "FIFO"), (device, "device")])
def test_checkpoint_folder_with_a_fifo_or_device_is_refused(copy_of, name, make, kind):
    """What the CLI, the app's checkpoint-folder field and a session link naming the folder all call."""
    folder = copy_of()
    if name == "shard":
        name = sorted(folder.glob("*.safetensors"))[0].name
    make(folder / name)
    with deadline(30), pytest.raises(EngineError, match=f"{name}: is a {kind}"):
        load(folder)


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "shard", "config.json"])
def test_app_tally_of_a_folder_with_a_fifo_is_refused(copy_of, name):
    """The app's checkpoint-folder field (and a session link's folder) first draws the tally from headers."""
    from engine.tally import tally_from_checkpoint
    folder = copy_of()
    if name == "shard":
        name = sorted(folder.glob("*.safetensors"))[0].name
    fifo(folder / name)
    with deadline(30), pytest.raises((CheckpointError, ConfigError), match=f"{name}: is a FIFO"):
        tally_from_checkpoint(folder)
    with deadline(30):   # the field's config check reads config.json alone
        if name == "config.json":
            with pytest.raises(ConfigError, match="config.json: is a FIFO"):
                load_config(folder)
        else:
            assert load_config(folder).n_layers == tiny_config().n_layers


def test_app_tokenizer_of_a_folder_with_a_fifo_is_refused(tmp_path):
    from explorer import prompt as pr
    fifo(tmp_path / "tokenizer.json")
    with deadline(30), pytest.raises(TokenizerError, match="is a FIFO"):
        pr.tokenize("hello", str(tmp_path / "tokenizer.json"))


def test_shard_that_is_a_fifo_is_refused_by_inspect(copy_of, capsys):
    folder = copy_of()
    fifo(sorted(folder.glob("*.safetensors"))[0])
    with deadline(30):
        code = cli(["inspect", str(folder)])
    assert "is a FIFO" in one_line_error(capsys, code)


@pytest.mark.parametrize("make, kind", [(fifo, "FIFO"), (device, "device")])
def test_prompt_file_that_is_a_fifo_or_device_is_refused(tiny, tmp_path, capsys, make, kind):
    path = make(tmp_path / "prompt.txt")
    with deadline(30):
        code = cli(["run", "--checkpoint", str(tiny), "--prompt-file", str(path)])
    assert f"is a {kind}" in one_line_error(capsys, code)


def test_oversized_prompt_file_is_refused_before_reading(tiny, tmp_path, capsys):
    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:
        f.truncate(64 << 20)   # sparse: 64 MB apparent, nothing on disk
    code = cli(["run", "--checkpoint", str(tiny), "--prompt-file", str(path)])
    assert "more than a prompt file can be" in one_line_error(capsys, code)


# -- 2. counts without an upper bound ------------------------------------------------------------

def test_config_with_200000_layers_is_refused_quickly(tmp_path):
    cfg = release_config().to_dict()
    n = 200_000
    cfg.update(n_layers=n, compress_ratios=[4] * n + [0] * cfg["n_mtp_layers"], kv_source_layers=list(range(n)),
               index_source_layers=list(range(n)))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with deadline(20), pytest.raises(ConfigError, match="n_layers.*200,000.*at most 1,024"):
        load_config(path)


def test_generate_past_max_seq_len_is_refused(tiny):
    engine = load(tiny)
    ids = [0] + list(range(20, 55))          # 36 tokens of max_seq_len 40
    with deadline(60), pytest.raises(EngineError, match="run past max_seq_len.*generate at most 4"):
        engine.run(ids, layers=[0], generate=5)
    assert len(engine.run(ids, layers=[0], generate=4).generated_ids) == 4


def test_cli_generate_a_billion_is_refused_at_once(tiny, capsys):
    with deadline(60):
        code = cli(["run", "--checkpoint", str(tiny), "--ids", "0,20,21", "--generate", "1000000000"])
    assert "--generate must be" in one_line_error(capsys, code)


# -- 4. files that are damaged or not text -------------------------------------------------------

def test_non_utf8_prompt_file_is_one_clear_error(tiny, tmp_path, capsys):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    code = cli(["run", "--checkpoint", str(tiny), "--prompt-file", str(path)])
    assert "not UTF-8 text (byte 3 is invalid)" in one_line_error(capsys, code)


def test_truncated_tokenizer_json_is_one_clear_error(copy_of, capsys):
    folder = copy_of()
    text = (ROOT / "assets" / "tokenizer" / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(TokenizerError, match="not a readable tokenizer.json"):
        load_tokenizer(folder / "tokenizer.json")
    code = cli(["run", "--checkpoint", str(folder), "--ids", "0,20,21"])
    assert "not a readable tokenizer.json" in one_line_error(capsys, code)


def test_truncated_compressed_vocab_is_rebuilt_with_a_warning(tmp_path):
    shutil.copy(ROOT / "assets" / "tokenizer" / "tokenizer.json", tmp_path / "tokenizer.json")
    whole = (ROOT / "assets" / "tokenizer" / "compressed_vocab.json").read_text()
    (tmp_path / "compressed_vocab.json").write_text(whole[: len(whole) // 3])
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.warns(RuntimeWarning, match="compressed_vocab.json: not a compressed vocabulary"):
        lookup, size = tok.compressed_vocab()
    assert (lookup, size) == build_compressed_vocab(tok.backend)
    assert (lookup, size) == (json.loads(whole)["lookup"], json.loads(whole)["compressed_vocab_size"])


# -- 4. the Python API: wrong argument types -----------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[0, True, 21]), "token id True is not a whole number"),
    (dict(prompt=[0, 1.5, 21]), "token id 1.5 is not a whole number"),
    (dict(prompt=[0, 20], layers=[True]), "layer True is not a layer number"),
    (dict(prompt=[0, 20], layers=[1.0]), "layer 1.0 is not a layer number"),
    (dict(prompt=[0, 20], layers=3), "layers must be a list"),
    (dict(prompt=[0, 20], generate=True), "generate must be a whole number"),
    (dict(prompt=[0, 20], generate=1.5), "generate must be a whole number"),
    (dict(prompt=5), "the prompt must be text or a list of token ids"),
    (dict(prompt=[0, 20, 21], image_spans=[(0.5, 2)]), "an image span must be a \\(start, end\\) pair"),
    (dict(prompt=[0, 20, 21], image_spans=[(True, 2)]), "an image span must be a \\(start, end\\) pair"),
    (dict(prompt=[0, 20], probes="topk"), "probes must be a list of probe kinds"),
    (dict(prompt=[0, 20], detail_layers=2), "layers must be a list"),
])
def test_api_refuses_wrong_argument_types(tiny, kwargs, message):
    engine = load(tiny)
    with pytest.raises(EngineError, match=message):
        engine.run(**kwargs)


# -- 5. silent wrong results ---------------------------------------------------------------------

def test_load_refuses_a_path_that_is_not_a_path():
    with pytest.raises(EngineError, match="the checkpoint must be a folder path, got int"):
        load(5)


def test_nan_weights_warn_once_naming_the_tensor(tmp_path):
    cfg = tiny_config(engram_layer_ids=(), engram_num_embeddings=())
    weights = random_weights(cfg, 0)
    weights["layers.1.attn_norm.weight"] = torch.full_like(weights["layers.1.attn_norm.weight"], float("nan"))
    weights["layers.2.ffn_norm.weight"] = torch.full_like(weights["layers.2.ffn_norm.weight"], float("inf"))
    from engine.checkpoint.writer import write_checkpoint
    write_checkpoint(cfg, tmp_path, tensors=weights, n_shards=1)
    engine = load(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = engine.run([0] + list(range(20, 30)), layers=[1, 2])
    nan_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning) and "NaN" in str(w.message)]
    assert len(nan_warnings) == 1 and "layers.1.attn_norm.weight" in str(nan_warnings[0].message)
    assert engine.model.weights.reader.nonfinite == ["layers.1.attn_norm.weight", "layers.2.ffn_norm.weight"] \
        or set(engine.model.weights.reader.nonfinite) == {"layers.1.attn_norm.weight", "layers.2.ffn_norm.weight"}
    assert not torch.isfinite(result.layers[2].residual_norms).all()  # the results are NaN indeed


def _write_overlapping(folder: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "model-00001-of-00001.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}))


def test_tensors_sharing_bytes_are_refused(tmp_path, capsys):
    _write_overlapping(tmp_path)
    with pytest.raises(CheckpointError, match="tensors 'a' and 'b' share data bytes 4..8"):
        read_inventory(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    code = cli(["inspect", str(tmp_path)])
    assert "share data bytes" in one_line_error(capsys, code)
