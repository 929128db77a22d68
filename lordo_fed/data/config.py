"""`DataConfig`: where the text comes from, how it is tokenised, split, partitioned and batched.

Its fields are the data settings of every entry point (the reference trainer's CLI, the Flower
apps' run config): `lordo_fed.config.setting` names the run-config key of those that have one.
`validate()` refuses a bad value before anything is read or tokenised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lordo_fed.config import setting

DEFAULT_CORPUS: Path = Path(__file__).resolve().parents[1] / "corpora" / "tinyshakespeare.txt"
"""The corpus of an empty `DataConfig.path` (shipped with the package)."""
PARTITIONS = ("iid", "by_source", "dirichlet")
"""The ways to split the train tokens among clients (lordo_fed.data.partition)."""
EVAL_WINDOWS = ("first", "spread")
"""Which windows of the held-out split a capped validation pass reads (lordo_fed.data.dataset.validation_batches)."""


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenised, split, partitioned and batched."""

    path: str = setting("data-path", "")
    """A corpus file or directory (text, JSON Lines, Parquet, HF dataset on disk, token bins); "" = DEFAULT_CORPUS."""
    text_field: str = setting("text-field", "text")
    """The field (JSON Lines) or column (Parquet, HF datasets) that holds each document's text."""
    tokenizer: str = setting("tokenizer", "byte")
    """'byte' (UTF-8 bytes, vocab 256), or a local tokenizer.json or a directory holding one (the same
    file at this path on the server and every node; token bins must have been made with it)."""
    cache_dir: str = ""
    """Where tokenised corpora are cached; "" = ~/.cache/lordo_fed/tokens."""
    val_fraction: float = 0.1
    """Fraction of each source's tokens (its tail) held out for validation, in [0, 1); unused with val_path."""
    val_path: str = setting("val-path", "")
    """A separate evaluation corpus (file or directory, same tokenizer) evaluated instead of the tail
    split, so quality is measured on text no run trained on; the train corpus is then used whole."""
    eval_windows: str = "first"
    """Which windows of the held-out split a validation pass capped at `eval_batches` reads: "first" (its
    start, as the figures in docs/results.md were measured) or "spread" (evenly spaced over all of it)."""
    seq_len: int = setting("seq-len", 128)
    """Tokens per training sequence (the model's context length)."""
    batch_size: int = setting("batch-size", 16)
    """Sequences per batch, per worker."""
    partition: str = setting("partition", "iid")
    """How train tokens are split among clients: "iid" (M contiguous pieces of the train stream), "by_source"
    or "dirichlet" (with a large alpha: a random share of every source's paragraphs)."""
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
        if self.eval_windows not in EVAL_WINDOWS:
            raise bad("eval_windows", f"one of {EVAL_WINDOWS}")
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
