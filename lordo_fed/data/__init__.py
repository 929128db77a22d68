"""Text corpus -> cached token array -> train/validation split -> per-client shards.

The pipeline, in order, and the module of each step:
  1. Corpus (`readers`): a file or a directory (read recursively, sorted) of text (*.txt, *.md:
     blank lines separate *documents*), JSON Lines, Parquet, Hugging Face datasets saved to
     disk (one document per record) or pre-tokenised token bins. Each file or dataset is a
     *source*.
  2. Tokenise once, streaming, into a memory-mapped token array cached on disk, keyed by the
     tokenizer and the files' paths, sizes and mtimes (`cache`: `load_corpus`, `token_dtype`;
     the tokenizers are in `tokenizer`).
  3. Split (`partition`): the last `val_fraction` of every source's tokens is validation, so
     every source is represented in validation; the rest is train.
  4. Partition the train part among M clients (`partition`): "iid", "by_source" or "dirichlet".
  5. Batches (`dataset`): `TokenShard.batch(i, ...)` draws random windows from a client's tokens
     with an rng seeded by (seed, shard, i), so a checkpoint's data cursor is one integer;
     `load_dataset(cfg, M)` runs steps 1-4 and returns the `Dataset`.

The settings of every step are `DataConfig`'s (`config`). Token ranges are half-open
[start, end) offsets into the corpus token array throughout. The names callers use are
re-exported here: `from lordo_fed.data import DataConfig, load_dataset, TokenShard, ...`.
"""

from lordo_fed.data.cache import DEFAULT_CACHE_DIR, Corpus, Source, cache_key, load_corpus, token_dtype
from lordo_fed.data.config import DEFAULT_CORPUS, PARTITIONS, DataConfig
from lordo_fed.data.dataset import Batch, Dataset, TokenShard, load_dataset, validation_batches
from lordo_fed.data.partition import (check_num_clients, client_ranges, gather, held_out_fraction, partition_by_source,
                                      partition_dirichlet, partition_iid, split_point, train_documents, train_ranges,
                                      val_ranges)
from lordo_fed.data.readers import split_documents

__all__ = [
    "DEFAULT_CACHE_DIR", "DEFAULT_CORPUS", "PARTITIONS", "Batch", "Corpus", "DataConfig", "Dataset", "Source",
    "TokenShard", "cache_key", "check_num_clients", "client_ranges", "gather", "held_out_fraction", "load_corpus",
    "load_dataset", "partition_by_source", "partition_dirichlet", "partition_iid", "split_documents", "split_point",
    "token_dtype", "train_documents", "train_ranges", "val_ranges", "validation_batches",
]
