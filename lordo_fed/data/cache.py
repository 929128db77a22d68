"""Tokenise a corpus once, streaming, into a cached memory-mapped token array.

`load_corpus(path, tokenizer)` reads the corpus's sources (lordo_fed.data.readers) and writes
`<cache_dir>/<key>.bin` (a flat uint16/uint32 array, `token_dtype`, memory-mapped on later
loads), `<key>.docs.npy` (document token ranges) and `<key>.json` (sources, dtype, tokenizer),
each atomically, the metadata last: its presence marks a complete entry. HF tokenizers encode
each batch of documents in parallel (Rust threads); a progress bar shows the input consumed
when run in a terminal. The key (`cache_key`) hashes the tokenizer identity, the text field and
each file's path, size and mtime, so editing a file or switching tokenizer rebuilds the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np

from lordo_fed.data.readers import SourceFile, list_sources, read_documents, read_token_bin
from lordo_fed.data.tokenizer import Tokenizer

DEFAULT_CACHE_DIR: Path = Path("~/.cache/lordo_fed/tokens")
"""Where tokenised corpora are cached when `DataConfig.cache_dir` is empty."""
# Bump when the on-disk format or the document splitting (readers.split_documents) changes: old
# caches then miss.
_CACHE_VERSION = 2


@dataclass(frozen=True, eq=False)
class Source:
    """One file of the corpus and where its tokens sit in the corpus token array."""

    path: str
    """Absolute path of the file."""
    start: int
    """First token of this file in the corpus array."""
    end: int
    """One past the last token of this file."""
    documents: np.ndarray = field(repr=False)
    """[n_docs, 2] int64 token ranges of the paragraphs, in file order, tiling [start, end)."""

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Corpus:
    """A tokenised corpus: one flat (memory-mapped) token array plus its sources."""

    tokens: np.ndarray
    """All tokens, sources back to back in sorted path order (np.memmap, read-only)."""
    sources: list[Source]
    """The files, in the order their tokens appear in `tokens`."""
    tokenizer_name: str
    """Name of the tokenizer that produced the tokens."""
    cache_path: Path
    """The .bin file behind `tokens`."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 halves the cache size."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cache_key(tokenizer_name: str, sources: list[SourceFile], text_field: str = "text") -> str:
    """sha256 of the tokenizer identity, the text field, and each source's kind and files'
    absolute paths, sizes and mtime_ns.

    Size and mtime (not content) keep the check O(1) per file; any edit changes the mtime.
    """
    h = hashlib.sha256()
    h.update(f"lordo_fed.data v{_CACHE_VERSION}\0{tokenizer_name}\0{text_field}\0".encode())
    for source in sources:
        h.update(f"{source.kind}\0".encode())
        for f in source.files():
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _encode_documents(tokenizer: Tokenizer, docs: list[str]) -> list[np.ndarray]:
    # HF tokenizers can encode a batch in parallel in Rust; others go one by one.
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if callable(encode_batch) and docs:
        return list(encode_batch(docs))
    return [tokenizer.encode(d) for d in docs]


def _atomic_write(path: Path, write) -> None:
    """Call write(file_object) on a temp file in path's directory, then rename it to path.

    os.replace is atomic on POSIX: readers see either no file or a complete one, never half.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _source_tokens(source: SourceFile, tokenizer: Tokenizer, text_field: str,
                   progress) -> Iterator[list[np.ndarray]]:
    """Batches of encoded documents of one source (a token bin is one document, in chunks)."""
    if source.tokenized:
        for part in read_token_bin(source.path, tokenizer.vocab_size):
            progress.update(part.nbytes)
            yield [part]
        return
    for docs, consumed in read_documents(source, text_field):
        progress.update(consumed)
        yield _encode_documents(tokenizer, docs)


def _build_cache(sources: list[SourceFile], tokenizer: Tokenizer, bin_path: Path, meta_path: Path,
                 text_field: str = "text") -> None:
    """Tokenise every source into bin_path, streaming (one batch of documents in memory at a
    time), its document ranges into <key>.docs.npy, and the metadata to meta_path (last)."""
    from tqdm.auto import tqdm

    dtype = token_dtype(tokenizer.vocab_size)
    meta_sources: list[dict] = []
    doc_ranges: list[np.ndarray] = []
    offset, n_docs = 0, 0
    total = sum(s.nbytes() for s in sources)

    def write_tokens(f) -> None:
        nonlocal offset, n_docs
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing ({tokenizer.name})", disable=None,
                  leave=False) as progress:
            for source in sources:
                start, first_doc = offset, n_docs
                joined_tokens = source.tokenized  # a token bin's chunks are one document
                for encoded in _source_tokens(source, tokenizer, text_field, progress):
                    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
                    if joined_tokens and n_docs > first_doc:
                        doc_ranges[-1][-1, 1] += int(lengths.sum())
                    else:
                        kept = lengths[lengths > 0]  # a document may encode to nothing
                        ends = offset + np.cumsum(kept)
                        doc_ranges.append(np.stack([ends - kept, ends], axis=1))
                        n_docs += len(kept)
                    if lengths.sum():
                        ids = np.concatenate(encoded)
                        # token bins were checked by their reader; a tokenizer's output once per batch
                        if not source.tokenized and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                            raise ValueError(f"tokenizer {tokenizer.name!r} produced ids outside "
                                             f"[0, {tokenizer.vocab_size}) for {str(source.path)!r}")
                        f.write(ids.astype(dtype, copy=False).tobytes())
                    offset += int(lengths.sum())
                meta_sources.append({"path": str(source.path), "kind": source.kind, "start": start, "end": offset,
                                     "documents": [first_doc, n_docs]})

    bin_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(bin_path, write_tokens)
    if offset == 0:
        bin_path.unlink(missing_ok=True)
        raise ValueError(
            f"corpus is empty: {len(sources)} source(s) ({str(sources[0].path)!r}...) gave no tokens"
        )
    docs = np.concatenate(doc_ranges) if doc_ranges else np.zeros((0, 2), dtype=np.int64)
    _atomic_write(_docs_path(meta_path), lambda f: np.save(f, docs.astype(np.int64), allow_pickle=False))
    meta = {
        "version": _CACHE_VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "num_tokens": offset,
        "num_documents": int(len(docs)),
        "sources": meta_sources,
    }
    # The metadata is written after the tokens: its presence marks a complete cache entry.
    _atomic_write(meta_path, lambda f: f.write(json.dumps(meta).encode()))


def _docs_path(meta_path: Path) -> Path:
    return meta_path.with_suffix(".docs.npy")


def _load_cache(bin_path: Path, meta_path: Path) -> Optional[Corpus]:
    """The cached corpus, or None if the entry is missing or incomplete."""
    docs_path = _docs_path(meta_path)
    if not (meta_path.is_file() and bin_path.is_file() and docs_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        n = int(meta["num_tokens"])
        docs = np.load(docs_path, mmap_mode="r", allow_pickle=False)
    except (ValueError, KeyError, TypeError, OSError):
        return None  # unreadable entry: rebuild rather than fail
    if (meta.get("version") != _CACHE_VERSION or bin_path.stat().st_size != n * dtype.itemsize
            or docs.shape != (int(meta.get("num_documents", -1)), 2)):
        return None
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))
    sources = [
        Source(
            path=s["path"],
            start=int(s["start"]),
            end=int(s["end"]),
            documents=np.asarray(docs[s["documents"][0]:s["documents"][1]], dtype=np.int64).reshape(-1, 2),
        )
        for s in meta["sources"]
    ]
    return Corpus(tokens, sources, meta["tokenizer"], bin_path)


def load_corpus(
    path: Union[str, Path], tokenizer: Tokenizer, cache_dir: Union[str, Path] = "", text_field: str = "text"
) -> Corpus:
    """Tokenise a corpus path (file, dataset or directory), or load it from the cache if present."""
    sources = list_sources(path)
    cache = Path(cache_dir).expanduser() if str(cache_dir) else DEFAULT_CACHE_DIR.expanduser()
    key = cache_key(tokenizer.name, sources, text_field)
    bin_path, meta_path = cache / f"{key}.bin", cache / f"{key}.json"
    corpus = _load_cache(bin_path, meta_path)
    if corpus is None:
        _build_cache(sources, tokenizer, bin_path, meta_path, text_field)
        corpus = _load_cache(bin_path, meta_path)
        assert corpus is not None, f"cache entry {str(meta_path)!r} unreadable right after writing"
    return corpus

