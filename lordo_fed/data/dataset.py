"""What a run gets from the data side: `load_dataset(cfg, M)` -> `Dataset` of M `TokenShard`s.

`TokenShard.batch(i, ...)` draws random windows from a client's tokens with an rng seeded by
(seed, shard, i): batch i is a pure function of i, so the data "cursor" that a checkpoint has to
save is a single integer. Validation batches (`validation_batches`) are fixed consecutive
windows, so validation loss is comparable across runs and rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import numpy as np
import torch

from lordo_fed.data.cache import Corpus, load_corpus
from lordo_fed.data.config import DEFAULT_CORPUS, DataConfig
from lordo_fed.data.partition import check_num_clients, client_ranges, gather, val_ranges
from lordo_fed.data.tokenizer import Tokenizer, load_tokenizer

Batch = tuple[torch.Tensor, torch.Tensor]
"""(x, y) token ids of [B, T], y being x shifted left by one token."""


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
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: Optional[int] = None, spread: bool = False
) -> list[Batch]:
    """Fixed evaluation batches of consecutive non-overlapping windows.

    Window j is x = tokens[j*T : (j+1)*T], y = tokens[j*T+1 : (j+1)*T+1]. With `max_batches` only
    max_batches * batch_size windows are read: the first ones, or with `spread` windows evenly spaced
    over the whole split (j = i * W // n of W windows), so that a capped pass samples all of the
    held-out text rather than its first files. Windows are grouped into batches of batch_size in
    order; only the last batch may be smaller. Deterministic, so validation loss is comparable across
    runs and rounds. Returns [] if there are fewer than seq_len+1 tokens.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"validation_batches: batch_size={batch_size!r}, seq_len={seq_len!r}: "
            f"expected ints >= 1"
        )
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"validation_batches: max_batches={max_batches!r}: expected None or >= 0")
    total = max(0, (len(tokens) - 1) // seq_len)
    n = total if max_batches is None else min(total, max_batches * batch_size)
    windows = np.arange(n) * total // n if spread and n else np.arange(n)
    out = []
    for first in range(0, n, batch_size):
        rows = [np.asarray(tokens[j * seq_len : (j + 1) * seq_len + 1], dtype=np.int64)
                for j in windows[first : first + batch_size]]
        w = torch.from_numpy(np.stack(rows))
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


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
        batches = validation_batches(self.val_tokens, cfg.batch_size, cfg.seq_len, max_batches,
                                     spread=cfg.eval_windows == "spread")
        if not batches and (cfg.val_fraction > 0 or cfg.val_path) and max_batches != 0:
            source = f"val_path {cfg.val_path!r}" if cfg.val_path else "validation split"
            remedy = "use a longer evaluation corpus" if cfg.val_path else "raise DataConfig.val_fraction"
            raise ValueError(
                f"{source} has {len(self.val_tokens)} tokens, fewer than "
                f"seq_len+1={cfg.seq_len + 1}: {remedy} or lower seq_len"
            )
        return batches


def load_dataset(cfg: DataConfig, num_clients: int) -> Dataset:
    """Tokenise (or load from cache), split and partition the corpus for num_clients."""
    cfg.validate()
    check_num_clients(num_clients)
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

