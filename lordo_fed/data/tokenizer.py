"""Tokenizers: text <-> integer token ids.

Two kinds, behind one small Protocol so the data pipeline does not care which:
  - ByteTokenizer: the UTF-8 bytes themselves (vocab 256). Needs no files, never fails to
    encode, and is the default for the tiny CPU runs.
  - HFTokenizer: a local HuggingFace `tokenizer.json` (BPE, WordPiece, ...). We only ever
    read a file from disk; nothing is downloaded at run time.

`name` is a stable identity of the tokenizer and goes into the token-cache key, so two
different tokenizers can never share a cache entry.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Protocol, Union, runtime_checkable

import numpy as np

# What decode() accepts: a list of ints, a 1-D numpy array, or a 1-D torch tensor (on CPU).
TokenIds = Union[Iterable[int], np.ndarray]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    """Stable identity (e.g. "byte", "hf:<content hash>"); part of the token-cache key."""
    vocab_size: int
    """Number of distinct ids; every id returned by encode() is in [0, vocab_size)."""

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as a 1-D integer array (no special tokens added)."""
        ...

    def decode(self, ids: TokenIds) -> str:
        """The text of a sequence of token ids."""
        ...


def _as_int_array(ids: TokenIds) -> np.ndarray:
    """Any 1-D sequence of ids (list, numpy, torch) as a 1-D int64 numpy array."""
    if hasattr(ids, "detach"):  # torch tensor: avoid importing torch here
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"decode expects a 1-D sequence of token ids, got shape {arr.shape}")
    return arr


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, lossless, no files needed."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        # np.frombuffer views the bytes without a Python-level loop: ~1 ms per MB.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: TokenIds) -> str:
        arr = _as_int_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(
                f"ByteTokenizer.decode: ids must be in [0, 255], got range "
                f"[{arr.min()}, {arr.max()}]"
            )
        # A window cut from the middle of a multi-byte character is not valid UTF-8;
        # show a replacement character rather than failing (matters for sampling).
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A HuggingFace `tokenizers` tokenizer read from a local tokenizer.json."""

    def __init__(self, path: Union[str, Path]):
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file not found: {str(path)!r}; expected a local tokenizer.json "
                f"(lordo-fed never downloads tokenizers at run time)"
            )
        # Imported here so that byte-level runs do not pay for loading the Rust extension.
        from tokenizers import Tokenizer as _HFTokenizer

        self.path = path
        # Hash the content, not the path: the same file copied elsewhere reuses the cache,
        # and an edited file (new merges) gets a new cache entry.
        self.name = f"hf:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            raise ValueError(f"could not read tokenizer file {str(path)!r}: {e}") from e
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """encode() for many texts at once; the Rust side runs them in parallel."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: TokenIds) -> str:
        return self._tok.decode(_as_int_array(ids).tolist(), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer from a config string.

    spec: "byte", a path to a tokenizer.json, or a directory containing tokenizer.json.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"tokenizer={spec!r}: expected 'byte' or a path to a local tokenizer.json"
        )
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    return HFTokenizer(path)
