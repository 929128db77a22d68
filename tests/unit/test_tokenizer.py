"""Tokenizers: byte-level and local HuggingFace tokenizer.json."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lordo_fed.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TEXT = "To be, or not to be: that is the question.\n\nCafé — naïve façade, 日本語 🙂!"


def build_bpe_json(path: Path, sentences: list[str]) -> Path:
    """A tiny byte-level BPE tokenizer.json trained on a few sentences (lossless round-trip)."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(sentences, trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture
def bpe_json(tmp_path: Path) -> Path:
    return build_bpe_json(tmp_path / "tokenizer.json", [TEXT, "the question is to be or not"] * 5)


def test_byte_round_trip_non_ascii():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert tok.name == "byte" and tok.vocab_size == 256
    assert ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)
    assert len(ids) == len(TEXT.encode("utf-8"))  # one id per byte, not per character
    assert ids.min() >= 0 and ids.max() < 256
    assert tok.decode(ids) == TEXT
    # decode takes lists and torch tensors too (model outputs).
    assert tok.decode(ids.tolist()) == TEXT
    assert tok.decode(torch.from_numpy(ids)) == TEXT
    assert tok.decode([]) == "" and len(tok.encode("")) == 0


def test_byte_decode_partial_utf8_and_bad_ids():
    tok = ByteTokenizer()
    ids = tok.encode("é")  # two bytes
    assert tok.decode(ids[:1]) == "\ufffd"  # a window cut mid-character does not crash
    with pytest.raises(ValueError, match="256|255"):
        tok.decode([65, 300])


def test_byte_encode_is_vectorised_on_a_megabyte():
    text = "abcdéfgh\n" * 120_000  # ~1.2 MB
    ids = ByteTokenizer().encode(text)
    assert len(ids) == len(text.encode("utf-8"))


def test_hf_round_trip_and_identity(bpe_json: Path, tmp_path: Path):
    tok = HFTokenizer(bpe_json)
    assert isinstance(tok, Tokenizer)
    assert tok.name.startswith("hf:") and 256 <= tok.vocab_size <= 300
    ids = tok.encode(TEXT)
    assert ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)
    assert len(ids) < len(TEXT.encode("utf-8"))  # merges were learned
    assert tok.decode(ids) == TEXT
    assert tok.decode(torch.from_numpy(ids)) == TEXT
    # The name hashes the content: a copy elsewhere has the same name, a different file not.
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(bpe_json, copy)
    assert HFTokenizer(copy).name == tok.name
    other = build_bpe_json(tmp_path / "other.json", ["completely different words here"] * 5)
    assert HFTokenizer(other).name != tok.name


def test_load_tokenizer_specs(bpe_json: Path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    by_file = load_tokenizer(str(bpe_json))
    by_dir = load_tokenizer(str(bpe_json.parent))  # a directory holding tokenizer.json
    assert isinstance(by_file, HFTokenizer) and by_file.name == by_dir.name


def test_hf_missing_file_names_path(tmp_path: Path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError) as e:
        HFTokenizer(missing)
    assert str(missing) in str(e.value) and "local tokenizer.json" in str(e.value)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(tmp_path / "nope"))  # directory without tokenizer.json


def test_hf_malformed_file(tmp_path: Path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer(bad)


@pytest.mark.parametrize("spec", ["", "   "])
def test_load_tokenizer_empty_spec(spec: str):
    with pytest.raises(ValueError, match="byte"):
        load_tokenizer(spec)
