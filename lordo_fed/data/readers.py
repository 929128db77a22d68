"""Corpus readers: the formats users keep pre-training text in, each read as *sources* (a file,
or a dataset saved to disk) of *documents*, streamed in batches so that a corpus larger than
memory is tokenised once into the token cache (lordo_fed.data.cache) without ever being held whole.

| format | recognised by | what is read | documents |
|---|---|---|---|
| text | `*.txt`, `*.md` | the file, UTF-8 | paragraphs (blank lines) |
| JSON Lines | `*.jsonl` | field `text_field` of every line | one per line |
| Parquet | `*.parquet` | column `text_field` (pyarrow, one row group at a time) | one per row |
| Hugging Face dataset | a directory written by `Dataset.save_to_disk` (`state.json`, `dataset_info.json`) | column `text_field` (`datasets.load_from_disk`, memory-mapped Arrow) | one per row |
| token bin | `*.bin` | a flat little-endian uint16 array of token ids, nanoGPT's `prepare.py` layout: already tokenised, taken as is (ids checked against the vocabulary) | one per file |

A corpus path is one such file or dataset directory, or a directory searched recursively (sorted)
for them. Parquet needs `pyarrow` and datasets saved to disk need `datasets`
(`pip install "lordo-fed[corpora]"`); a corpus of another kind never imports them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import numpy as np

TEXT_SUFFIXES = (".txt", ".md")
SUFFIX_KINDS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet", ".bin": "tokens"}
"""File suffix -> reader."""
HF_MARKERS = ("state.json", "dataset_info.json")
"""The files `datasets.Dataset.save_to_disk` writes next to its Arrow shards."""
TOKEN_BIN_DTYPE = np.dtype("<u2")
"""nanoGPT's token bins: uint16 ids (vocabularies up to 65,536, GPT-2's included)."""
DOCS_PER_BATCH = 1024
TOKENS_PER_CHUNK = 1 << 24
# A paragraph break: a newline followed by one or more blank (or whitespace-only) lines.
# The break stays attached to the paragraph before it, so documents concatenate back to the
# exact file text, and the next paragraph keeps its indentation.
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")
# What a user sets, in each entry point: the Flower app's run-config key (DataConfig's `setting`)
# and the reference trainer's Hydra path (lordo-train); an error names both.
SET_TEXT_FIELD = "set it with the run-config key text-field='...' (lordo-train: data.text_field=...)"
SET_TOKENIZER = ("set the tokenizer it was made with: the run-config key tokenizer='/path/to/tokenizer.json' "
                 "(lordo-train: data.tokenizer=/path/to/tokenizer.json)")


@dataclass(frozen=True)
class SourceFile:
    """One source of a corpus: a file, or a dataset directory, and how to read it."""

    path: Path
    kind: str
    """'text', 'jsonl', 'parquet', 'hf' or 'tokens'."""

    @property
    def tokenized(self) -> bool:
        return self.kind == "tokens"

    def files(self) -> list[Path]:
        """The files whose size and mtime the token cache's key covers."""
        if self.kind == "hf":
            return sorted(p for p in self.path.rglob("*") if p.is_file())
        return [self.path]

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())


def _missing(name: str, what: str) -> ImportError:
    return ImportError(f"reading {what} needs the '{name}' package: pip install \"lordo-fed[corpora]\" "
                       f"(or pip install {name})")


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and all((path / m).is_file() for m in HF_MARKERS)


def list_sources(path: Union[str, Path]) -> list[SourceFile]:
    """The sources of a corpus path, in a fixed (sorted) order."""
    path = Path(path).expanduser()
    kinds = "/".join(f"*{s}" for s in SUFFIX_KINDS) + " files or Hugging Face datasets saved to disk"
    if not path.exists():
        raise FileNotFoundError(f"corpus path not found: {str(path)!r}; expected a file or a directory of {kinds}")
    path = path.resolve()
    if path.is_file():
        kind = SUFFIX_KINDS.get(path.suffix.lower(), "text")  # any other single file is read as text
        return [SourceFile(path, kind)]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if is_hf_dataset(p))
        raise ValueError(f"{str(path)!r} is a saved Hugging Face DatasetDict: point the corpus path at one split, "
                         f"e.g. {str(path / (splits[0] if splits else 'train'))!r} (splits: {splits})")
    if is_hf_dataset(path):
        return [SourceFile(path, "hf")]
    datasets = sorted(p for p in path.rglob("*") if is_hf_dataset(p))
    found = [SourceFile(d, "hf") for d in datasets]
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.suffix.lower() in SUFFIX_KINDS and not any(d in p.parents for d in datasets):
            found.append(SourceFile(p, SUFFIX_KINDS[p.suffix.lower()]))
    if not found:
        raise ValueError(f"corpus directory {str(path)!r} contains no {kinds}")
    return sorted(found, key=lambda s: str(s.path))


# ----------------------------------------------------------------------------- text sources


def read_documents(source: SourceFile, text_field: str = "text",
                   batch: int | None = None) -> Iterator[tuple[list[str], int]]:
    """Batches of documents of a text source, each with the bytes of input it consumed (for a
    progress bar). A missing field or a value that is not a string is an error naming the
    source, the record and the field."""
    readers = {"text": _read_text_file, "jsonl": _read_jsonl, "parquet": _read_parquet, "hf": _read_hf}
    if source.kind not in readers:
        raise ValueError(f"{str(source.path)!r} holds token ids ({source.kind}), not text")
    yield from readers[source.kind](source.path, text_field, batch or DOCS_PER_BATCH)


def split_documents(text: str) -> list[str]:
    """Split text into paragraphs on blank lines, losslessly: "".join(docs) == text.

    Each document keeps the blank lines that follow it, so that concatenated documents read
    exactly like the file. Leading blank lines are glued to the first paragraph rather than
    making a whitespace-only document. Changing the rule changes every text corpus's documents:
    bump the token cache's version (lordo_fed.data.cache) with it.
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


def _read_text_file(path: Path, text_field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {str(path)!r} is not valid UTF-8: {e}") from e
    docs = split_documents(text)
    size = path.stat().st_size
    for i in range(0, max(len(docs), 1), batch):
        yield docs[i:i + batch], size if i + batch >= len(docs) else 0


def _text_value(value, path: Path, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{str(path)!r}, {where}: field {text_field!r} is {type(value).__name__}, expected a string")
    return value


def _read_jsonl(path: Path, text_field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    docs, consumed = [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            consumed += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{str(path)!r}, line {lineno}: not a JSON object ({e})") from e
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{str(path)!r}, line {lineno}: no field {text_field!r} (has {keys}); the text field: "
                                 + SET_TEXT_FIELD)
            docs.append(_text_value(record[text_field], path, f"line {lineno}", text_field))
            if len(docs) == batch:
                yield docs, consumed
                docs, consumed = [], 0
    yield docs, consumed


def _read_parquet(path: Path, text_field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise _missing("pyarrow", "Parquet") from e
    f = pq.ParquetFile(path)
    if text_field not in f.schema_arrow.names:
        raise ValueError(f"{str(path)!r}: no column {text_field!r} (columns {f.schema_arrow.names}); the text column: "
                         + SET_TEXT_FIELD)
    size, rows = path.stat().st_size, max(f.metadata.num_rows, 1)
    for record_batch in f.iter_batches(batch_size=batch, columns=[text_field]):
        column = record_batch.column(0)
        if column.null_count:
            raise ValueError(f"{str(path)!r}: column {text_field!r} has null values, expected strings")
        docs = column.to_pylist()
        if docs and not isinstance(docs[0], str):
            _text_value(docs[0], path, f"column {text_field!r}", text_field)
        yield docs, size * len(docs) // rows


def _read_hf(path: Path, text_field: str, batch: int) -> Iterator[tuple[list[str], int]]:
    try:
        import datasets
    except ImportError as e:
        raise _missing("datasets", "a Hugging Face dataset saved to disk") from e
    ds = datasets.load_from_disk(str(path))
    if text_field not in ds.column_names:
        raise ValueError(f"{str(path)!r}: no column {text_field!r} (columns {ds.column_names}); the text column: "
                         + SET_TEXT_FIELD)
    size, rows = SourceFile(path, "hf").nbytes(), max(len(ds), 1)
    column = ds.select_columns([text_field]).with_format("arrow")
    for start in range(0, len(ds), batch):
        docs = column[start:start + batch][text_field].to_pylist()
        if any(not isinstance(d, str) for d in docs):
            bad = next(d for d in docs if not isinstance(d, str))
            _text_value(bad, path, f"rows {start}..{start + len(docs) - 1}", text_field)
        yield docs, size * len(docs) // rows


# ----------------------------------------------------------------------------- token sources


def read_token_bin(path: Path, vocab_size: int, chunk: int | None = None) -> Iterator[np.ndarray]:
    """Chunks of a token bin (memory-mapped, never loaded whole), each checked to hold ids below
    `vocab_size`: a bin made with another tokenizer fails here instead of training on garbage."""
    size = path.stat().st_size
    if size % TOKEN_BIN_DTYPE.itemsize:
        raise ValueError(f"token bin {str(path)!r}: {size} bytes is not a whole number of uint16 token ids "
                         "(nanoGPT's layout)")
    if size == 0:
        return
    tokens = np.memmap(path, dtype=TOKEN_BIN_DTYPE, mode="r")
    chunk = chunk or TOKENS_PER_CHUNK
    for start in range(0, len(tokens), chunk):
        part = np.asarray(tokens[start:start + chunk])
        top = int(part.max())
        if top >= vocab_size:
            raise ValueError(f"token bin {str(path)!r}: id {top} at or after token {start} is outside the tokenizer's "
                             f"vocabulary [0, {vocab_size}); it was made with another tokenizer: {SET_TOKENIZER}")
        yield part
