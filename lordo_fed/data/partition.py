"""Which corpus tokens are validation, and which train tokens each client gets.

Split: the last `val_fraction` of every source's tokens is validation, so every source is
represented in validation; the rest is train (none is held out when a separate `val_path` is
evaluated instead). Partition the train part among M clients: "iid" (contiguous equal shards of
the train stream), "by_source" (whole files, round-robin) or "dirichlet" (per-source Dirichlet
proportions over documents: the usual non-IID federated benchmark). Everything is a pure
function of the corpus, M and the config's seed, and works on half-open [start, end) token
ranges into the corpus token array.
"""

from __future__ import annotations

import numpy as np

from lordo_fed.data.cache import Corpus, Source
from lordo_fed.data.config import PARTITIONS, DataConfig


# ----------------------------------------------------------------------------- validation split


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


def check_num_clients(num_clients: int) -> None:
    """Raise ValueError unless `num_clients` is an int >= 1 (bool is not a count)."""
    if not isinstance(num_clients, (int, np.integer)) or isinstance(num_clients, bool) or (
        num_clients < 1
    ):
        raise ValueError(f"num_clients={num_clients!r}: expected an int >= 1")


def partition_iid(ranges: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Cut the stream made of `ranges` (in order) into num_clients contiguous pieces.

    Piece sizes differ by at most one token and together cover the stream exactly. Returns,
    per client, the [k, 2] ranges its piece is made of (k > 1 only where it spans sources).
    """
    check_num_clients(num_clients)
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
    check_num_clients(num_clients)
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
    check_num_clients(num_clients)
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

