"""Text corpus -> cached token array -> train/validation split -> per-client shards.

The pipeline, in order:
  1. Corpus: a file or a directory (read recursively, sorted) of text (*.txt, *.md: blank
     lines separate *documents*), JSON Lines, Parquet, Hugging Face datasets saved to disk (one
     document per record) or pre-tokenised token bins (lordo_fed.data.readers). Each file or
     dataset is a *source*.
  2. Tokenise once, streaming, into `<cache_dir>/<key>.bin` (a flat uint16/uint32 array,
     memory-mapped on later loads), `<key>.docs.npy` (document token ranges) and `<key>.json`
     (sources, dtype, tokenizer). HF tokenizers encode each batch of documents in parallel
     (Rust threads); a progress bar shows the input consumed when run in a terminal. The key
     hashes the tokenizer identity, the text field and each file's path, size and mtime, so
     editing a file or switching tokenizer rebuilds the cache.
  3. Split: the last `val_fraction` of every source's tokens is validation, so every source
     is represented in validation; the rest is train.
  4. Partition the train part among M clients: "iid" (contiguous equal shards of the train
     stream), "by_source" (whole files, round-robin) or "dirichlet" (per-source Dirichlet
     proportions over documents: the usual non-IID federated benchmark).
  5. TokenShard.batch(i, ...) draws random windows from a client's tokens with an rng seeded
     by (seed, shard, i): batch i is a pure function of i, so the data "cursor" that a
     checkpoint has to save is a single integer.

Token ranges are half-open [start, end) offsets into the corpus token array throughout.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch

from lordo_fed.config import setting
from lordo_fed.data.readers import SourceFile, list_sources, read_documents, read_token_bin
from lordo_fed.data.tokenizer import Tokenizer, load_tokenizer

DEFAULT_CORPUS: Path = Path(__file__).resolve().parents[1] / "corpora" / "tinyshakespeare.txt"
DEFAULT_CACHE_DIR: Path = Path("~/.cache/lordo_fed/tokens")
PARTITIONS = ("iid", "by_source", "dirichlet")
# Bump when the on-disk format or the document splitting changes: old caches then miss.
_CACHE_VERSION = 2
# A paragraph break: a newline followed by one or more blank (or whitespace-only) lines.
# The break stays attached to the paragraph before it, so documents concatenate back to the
# exact file text, and the next paragraph keeps its indentation.
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")

Batch = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- config


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenised, split, partitioned and batched."""

    path: str = setting("data-path", "")
    """A corpus file or directory (text, JSON Lines, Parquet, HF dataset on disk, token bins); "" = DEFAULT_CORPUS."""
    text_field: str = setting("text-field", "text")
    """The field (JSON Lines) or column (Parquet, HF datasets) that holds each document's text."""
    tokenizer: str = "byte"
    """'byte' (UTF-8 bytes, vocab 256), or a local tokenizer.json or a directory holding one."""
    cache_dir: str = ""
    """Where tokenised corpora are cached; "" = ~/.cache/lordo_fed/tokens."""
    val_fraction: float = 0.1
    """Fraction of each source's tokens (its tail) held out for validation, in [0, 1); unused with val_path."""
    val_path: str = setting("val-path", "")
    """A separate evaluation corpus (file or directory, same tokenizer) evaluated instead of the tail
    split, so quality is measured on text no run trained on; the train corpus is then used whole."""
    seq_len: int = setting("seq-len", 128)
    """Tokens per training sequence (the model's context length)."""
    batch_size: int = setting("batch-size", 16)
    """Sequences per batch, per worker."""
    partition: str = "iid"
    """How train tokens are split among clients: "iid", "by_source" or "dirichlet"."""
    dirichlet_alpha: float = 0.5
    """Concentration of the per-source Dirichlet (partition="dirichlet"); smaller = more skewed."""
    seed: int = 0
    """Seeds the Dirichlet partition and the batch sampling."""

    def validate(self) -> "DataConfig":
        """Raise ValueError naming the first bad field, its value and what was expected."""

        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"DataConfig.{name}={getattr(self, name)!r}: expected {expected}")

        def is_int(v: object) -> bool:  # bool is an int subclass; True is not a length
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)

        if not isinstance(self.path, str):
            raise bad("path", 'a string (a file, a directory, or "" for the default corpus)')
        if not isinstance(self.text_field, str) or not self.text_field:
            raise bad("text_field", "the name of the field or column holding the text (e.g. 'text')")
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise bad("tokenizer", "'byte' or a path to a local tokenizer.json")
        if not isinstance(self.val_path, str):
            raise bad("val_path", 'a string (a file, a directory, or "" for the tail split of the corpus)')
        if not isinstance(self.cache_dir, str):
            raise bad("cache_dir", 'a string (a directory, or "" for ~/.cache/lordo_fed/tokens)')
        if not is_real(self.val_fraction) or not 0.0 <= self.val_fraction < 1.0:
            raise bad("val_fraction", "a number in [0, 1)")
        if not is_int(self.seq_len) or self.seq_len < 1:
            raise bad("seq_len", "an int >= 1")
        if not is_int(self.batch_size) or self.batch_size < 1:
            raise bad("batch_size", "an int >= 1")
        if self.partition not in PARTITIONS:
            raise bad("partition", f"one of {PARTITIONS}")
        if (
            not is_real(self.dirichlet_alpha)
            or not math.isfinite(self.dirichlet_alpha)
            or self.dirichlet_alpha <= 0
        ):
            raise bad("dirichlet_alpha", "a finite number > 0")
        if not is_int(self.seed) or self.seed < 0:
            # numpy's SeedSequence only takes non-negative integers.
            raise bad("seed", "an int >= 0")
        return self


# ----------------------------------------------------------------------------- corpus


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


def split_documents(text: str) -> list[str]:
    """Split text into paragraphs on blank lines, losslessly: "".join(docs) == text.

    Each document keeps the blank lines that follow it, so that concatenated documents read
    exactly like the file. Leading blank lines are glued to the first paragraph rather than
    making a whitespace-only document.
    """
    docs: list[str] = []
    start = 0
    for m in _PARAGRAPH_BREAK.finditer(text):
        if text[start : m.end()].strip():  # don't cut off a whitespace-only chunk
            docs.append(text[start : m.end()])
            start = m.end()
    tail = text[start:]
    if tail:
        if docs and not tail.strip():
            docs[-1] += tail  # trailing whitespace belongs to the last paragraph
        else:
            docs.append(tail)
    return docs


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


# ----------------------------------------------------------------------------- split


def split_point(source: Source, val_fraction: float) -> int:
    """Token offset where a source's train part ends and its validation tail starts."""
    n_val = int(round(source.num_tokens * val_fraction))
    return source.end - n_val


def train_ranges(corpus: Corpus, val_fraction: float) -> np.ndarray:
    """[n_sources, 2] token ranges of every source's train part (the head)."""
    return np.array(
        [[s.start, split_point(s, val_fraction)] for s in corpus.sources], dtype=np.int64
    )


def val_ranges(corpus: Corpus, val_fraction: float) -> np.ndarray:
    """[n_sources, 2] token ranges of every source's validation part (the tail)."""
    return np.array(
        [[split_point(s, val_fraction), s.end] for s in corpus.sources], dtype=np.int64
    )


def train_documents(source: Source, val_fraction: float) -> np.ndarray:
    """[n, 2] ranges of a source's documents clipped to its train part.

    The document that straddles the split point keeps only its train-side head.
    """
    cut = split_point(source, val_fraction)
    docs = source.documents[source.documents[:, 0] < cut].copy()
    docs[:, 1] = np.minimum(docs[:, 1], cut)
    return docs


def gather(tokens: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """The concatenation of tokens[start:end] over ranges; a view (no copy) for one range."""
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    if len(ranges) == 0:
        return tokens[:0]
    if len(ranges) == 1:
        return tokens[ranges[0, 0] : ranges[0, 1]]
    return np.concatenate([tokens[a:b] for a, b in ranges])


# ----------------------------------------------------------------------------- partitions


def _check_num_clients(num_clients: int) -> None:
    if not isinstance(num_clients, (int, np.integer)) or isinstance(num_clients, bool) or (
        num_clients < 1
    ):
        raise ValueError(f"num_clients={num_clients!r}: expected an int >= 1")


def partition_iid(ranges: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Cut the stream made of `ranges` (in order) into num_clients contiguous pieces.

    Piece sizes differ by at most one token and together cover the stream exactly. Returns,
    per client, the [k, 2] ranges its piece is made of (k > 1 only where it spans sources).
    """
    _check_num_clients(num_clients)
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    lengths = ranges[:, 1] - ranges[:, 0]
    stream_start = np.concatenate([[0], np.cumsum(lengths)])  # stream offset of each range
    total = int(stream_start[-1])
    cuts = [m * total // num_clients for m in range(num_clients + 1)]
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        pieces = []
        for (a, b), s0 in zip(ranges, stream_start[:-1]):
            # Intersect [lo, hi) with this range's stream interval [s0, s0 + b - a).
            x, y = max(lo, s0), min(hi, s0 + (b - a))
            if x < y:
                pieces.append([a + (x - s0), a + (y - s0)])
        out.append(np.array(pieces, dtype=np.int64).reshape(-1, 2))
    return out


def partition_by_source(num_sources: int, num_clients: int) -> list[list[int]]:
    """Source indices per client: sources dealt round-robin (client m gets m, m+M, ...)."""
    _check_num_clients(num_clients)
    if num_sources < num_clients:
        raise ValueError(
            f"partition='by_source' needs at least as many sources as clients: "
            f"got {num_sources} source file(s) for {num_clients} clients"
        )
    return [list(range(m, num_sources, num_clients)) for m in range(num_clients)]


def partition_dirichlet(
    docs_per_source: list[np.ndarray], num_clients: int, alpha: float, seed: int
) -> list[np.ndarray]:
    """Document ranges per client: each source's documents split by Dirichlet proportions.

    For each source in order: q ~ Dirichlet(alpha * 1_M), its documents are shuffled, and
    client m takes the next ~q_m fraction of them. One rng (default_rng(seed)) drives all
    draws, so the partition is a pure function of (documents, M, alpha, seed). Each client's
    documents are returned in corpus order (sorted), so its text reads naturally.
    """
    _check_num_clients(num_clients)
    rng = np.random.default_rng(seed)
    assigned: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for docs in docs_per_source:
        q = rng.dirichlet(np.full(num_clients, float(alpha)))
        order = rng.permutation(len(docs))
        # Cumulative cuts: client m gets documents [cuts[m], cuts[m+1]) of the shuffle.
        cuts = np.round(np.concatenate([[0.0], np.cumsum(q)]) * len(docs)).astype(np.int64)
        cuts[-1] = len(docs)  # guard against cumsum(q) summing to 1 - eps
        for m in range(num_clients):
            assigned[m].append(docs[order[cuts[m] : cuts[m + 1]]])
    out = []
    for parts in assigned:
        ranges = np.concatenate(parts).reshape(-1, 2) if parts else np.zeros((0, 2), np.int64)
        out.append(ranges[np.argsort(ranges[:, 0], kind="stable")])
    return out


# ----------------------------------------------------------------------------- batches


class TokenShard:
    """One client's training tokens, and deterministic random batches drawn from them."""

    def __init__(self, tokens: np.ndarray, shard_id: int = 0):
        if np.asarray(tokens).ndim != 1:
            raise ValueError(f"TokenShard expects a 1-D token array, got shape {tokens.shape}")
        if shard_id < 0:
            raise ValueError(f"shard_id={shard_id!r}: expected an int >= 0")
        self.tokens = tokens
        self.shard_id = int(shard_id)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def batch(self, index: int, batch_size: int, seq_len: int, seed: int = 0) -> Batch:
        """Batch number `index`: batch_size random windows, as torch.long (x, y) of [B, T].

        y is x shifted left by one token. The windows come from
        np.random.default_rng([seed, shard_id, index]), so the batch depends on nothing but
        those three integers: resuming at step i just means asking for batch i.
        """
        checks = (("index", index, 0), ("seed", seed, 0), ("batch_size", batch_size, 1),
                  ("seq_len", seq_len, 1))
        for name, value, lo in checks:
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
                raise ValueError(f"TokenShard.batch: {name}={value!r}: expected an int >= {lo}")
        n = self.num_tokens
        if n < seq_len + 1:
            raise ValueError(
                f"shard {self.shard_id} has {n} tokens, fewer than seq_len+1={seq_len + 1}: "
                f"use a shorter seq_len, fewer clients or a larger corpus"
            )
        rng = np.random.default_rng([int(seed), self.shard_id, int(index)])
        starts = rng.integers(0, n - seq_len, size=batch_size)  # last start: n - seq_len - 1
        windows = self.tokens[starts[:, None] + np.arange(seq_len + 1)]
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __repr__(self) -> str:
        return f"TokenShard(shard_id={self.shard_id}, num_tokens={self.num_tokens})"


def validation_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: Optional[int] = None
) -> list[Batch]:
    """Fixed evaluation batches: consecutive non-overlapping windows from the start.

    Window j is x = tokens[j*T : (j+1)*T], y = tokens[j*T+1 : (j+1)*T+1]. Windows are grouped
    into batches of batch_size in order; only the last batch may be smaller. Deterministic,
    so validation loss is comparable across runs and rounds. Returns [] if there are fewer
    than seq_len+1 tokens.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"validation_batches: batch_size={batch_size!r}, seq_len={seq_len!r}: "
            f"expected ints >= 1"
        )
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"validation_batches: max_batches={max_batches!r}: expected None or >= 0")
    n_windows = max(0, (len(tokens) - 1) // seq_len)
    if max_batches is not None:
        n_windows = min(n_windows, max_batches * batch_size)
    out = []
    for first in range(0, n_windows, batch_size):
        count = min(batch_size, n_windows - first)
        # One contiguous read per batch: windows overlap their neighbour by the y token.
        chunk = np.asarray(tokens[first * seq_len : (first + count) * seq_len + 1], dtype=np.int64)
        idx = np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)
        w = torch.from_numpy(chunk[idx])
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


# ----------------------------------------------------------------------------- dataset


@dataclass
class Dataset:
    """Everything a run needs from the data side, for a given number of clients."""

    config: DataConfig
    """The (validated) config this dataset was built from."""
    tokenizer: Tokenizer
    """The tokenizer that produced the tokens (decode samples with it)."""
    corpus: Corpus
    """The whole tokenised corpus (memory-mapped)."""
    client_ranges: list[np.ndarray]
    """Per client, the [k, 2] corpus token ranges its shard is made of (in order)."""
    train_shards: list[TokenShard]
    """One shard per client; shard m has shard_id m."""

    @cached_property
    def val_tokens(self) -> np.ndarray:
        """The validation tokens: the tails of all sources concatenated in source order, or the
        whole `val_path` corpus (tokenised and cached on first use: a client never needs it)."""
        cfg = self.config
        if not cfg.val_path:
            return gather(self.corpus.tokens, val_ranges(self.corpus, cfg.val_fraction))
        try:
            return load_corpus(cfg.val_path, self.tokenizer, cfg.cache_dir, cfg.text_field).tokens
        except FileNotFoundError as err:
            raise FileNotFoundError(f"DataConfig.val_path={cfg.val_path!r}: {err}") from err
        except ValueError as err:
            raise ValueError(f"DataConfig.val_path={cfg.val_path!r}: {err}") from err

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def num_clients(self) -> int:
        return len(self.train_shards)

    def val_batches(self, max_batches: Optional[int] = None) -> list[Batch]:
        """validation_batches(val_tokens) at the config's batch_size and seq_len."""
        cfg = self.config
        batches = validation_batches(self.val_tokens, cfg.batch_size, cfg.seq_len, max_batches)
        if not batches and (cfg.val_fraction > 0 or cfg.val_path) and max_batches != 0:
            source = f"val_path {cfg.val_path!r}" if cfg.val_path else "validation split"
            remedy = "use a longer evaluation corpus" if cfg.val_path else "raise DataConfig.val_fraction"
            raise ValueError(
                f"{source} has {len(self.val_tokens)} tokens, fewer than "
                f"seq_len+1={cfg.seq_len + 1}: {remedy} or lower seq_len"
            )
        return batches


def held_out_fraction(cfg: DataConfig) -> float:
    """The share of each source kept out of training: val_fraction, or none with a val_path."""
    return 0.0 if cfg.val_path else cfg.val_fraction


def client_ranges(cfg: DataConfig, corpus: Corpus, num_clients: int) -> list[np.ndarray]:
    """Per client, the corpus token ranges of its train data under cfg.partition."""
    held_out = held_out_fraction(cfg)
    if cfg.partition == "iid":
        return partition_iid(train_ranges(corpus, held_out), num_clients)
    if cfg.partition == "by_source":
        train = train_ranges(corpus, held_out)
        return [train[idx] for idx in partition_by_source(len(corpus.sources), num_clients)]
    if cfg.partition == "dirichlet":
        docs = [train_documents(s, held_out) for s in corpus.sources]
        return partition_dirichlet(docs, num_clients, cfg.dirichlet_alpha, cfg.seed)
    raise ValueError(f"DataConfig.partition={cfg.partition!r}: expected one of {PARTITIONS}")


def load_dataset(cfg: DataConfig, num_clients: int) -> Dataset:
    """Tokenise (or load from cache), split and partition the corpus for num_clients."""
    cfg.validate()
    _check_num_clients(num_clients)
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = load_corpus(cfg.path or DEFAULT_CORPUS, tokenizer, cfg.cache_dir, cfg.text_field)
    ranges = client_ranges(cfg, corpus, num_clients)
    shards = [TokenShard(gather(corpus.tokens, r), shard_id=m) for m, r in enumerate(ranges)]
    for shard in shards:
        if shard.num_tokens < cfg.seq_len + 1:
            hint = (
                f" (dirichlet_alpha={cfg.dirichlet_alpha}, seed={cfg.seed}: try a larger alpha)"
                if cfg.partition == "dirichlet"
                else ""
            )
            raise ValueError(
                f"partition={cfg.partition!r} gave client {shard.shard_id} of {num_clients} "
                f"only {shard.num_tokens} train tokens; each client needs at least "
                f"seq_len+1={cfg.seq_len + 1}{hint}. Use fewer clients, a shorter seq_len "
                f"or a larger corpus."
            )
    return Dataset(cfg, tokenizer, corpus, ranges, shards)
