"""Data pipeline: cached tokenisation, train/val split, client partitions, batches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lordo_fed import data as D
from lordo_fed.data import (
    DEFAULT_CORPUS,
    DataConfig,
    TokenShard,
    load_corpus,
    load_dataset,
    split_documents,
    validation_batches,
)
from lordo_fed.data.tokenizer import ByteTokenizer


class CountingTokenizer(ByteTokenizer):
    """A byte tokenizer that counts encode() calls."""

    def __init__(self):
        self.calls = 0

    def encode(self, text: str) -> np.ndarray:
        self.calls += 1
        return super().encode(text)


def write_corpus_dir(root: Path, n_files: int = 3, n_paras: int = 60) -> Path:
    """A directory of n_files text files (one in a subfolder, one .md), each n_paras paragraphs."""
    root.mkdir(parents=True, exist_ok=True)
    names = ["a.txt", "b.md", "sub/c.txt", "d.txt", "e.txt"][:n_files]
    for k, name in enumerate(names):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        paras = [f"File {k} paragraph {i}.\n" + f"line {i} of file {k} " * (1 + i % 5)
                 for i in range(n_paras)]
        p.write_text("\n\n".join(paras) + "\n")
    (root / "ignored.json").write_text("{}")  # neither .txt nor .md: not part of the corpus
    return root


def cfg_for(path: Path, tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


# ----------------------------------------------------------------------------- corpus + cache


def test_split_documents_is_lossless():
    text = "\n\nFirst para\nstill first.\n\n\n  Indented second.\n \t\nThird\n\n"
    docs = split_documents(text)
    assert "".join(docs) == text
    assert len(docs) == 3
    assert docs[0].startswith("\n\nFirst") and docs[1].startswith("  Indented")
    assert split_documents("") == [] and split_documents("one") == ["one"]


def test_cache_written_once_and_reused(tmp_path: Path, monkeypatch):
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    cache = tmp_path / "cache"
    tok = CountingTokenizer()
    first = load_corpus(corpus_dir, tok, cache)
    assert tok.calls > 0
    files = sorted(p.name for p in cache.iterdir())
    assert [f.split(".", 1)[1] for f in files] == ["bin", "docs.npy", "json"]
    assert isinstance(first.tokens, np.memmap) and first.tokens.dtype == np.uint16

    meta = json.loads(next(cache.glob("*.json")).read_text())
    assert meta["tokenizer"] == "byte" and meta["dtype"] == "uint16"
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt", "b.md", "c.txt"]
    assert all(len(s.documents) == 60 for s in first.sources)
    assert meta["num_documents"] == 180 and [s["documents"] for s in meta["sources"]] == [[0, 60], [60, 120], [120, 180]]

    calls = tok.calls
    second = load_corpus(corpus_dir, tok, cache)
    assert tok.calls == calls  # cache hit: the tokenizer was not called again
    np.testing.assert_array_equal(first.tokens, second.tokens)

    # Same through the public entry point: a tokenizer that would fail is never called.
    def boom(self, text):
        raise AssertionError("tokenizer called despite a warm cache")

    monkeypatch.setattr(ByteTokenizer, "encode", boom)
    ds = load_dataset(cfg_for(corpus_dir, tmp_path), num_clients=2)
    assert ds.corpus.num_tokens == first.num_tokens


def test_changed_file_invalidates_cache(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    cache = tmp_path / "cache"
    tok = CountingTokenizer()
    before = load_corpus(corpus_dir, tok, cache)
    calls = tok.calls
    target = corpus_dir / "b.md"
    text = target.read_text()
    target.write_text(text.replace("File 1", "FILE 1"))  # same size: only the mtime changes
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    after = load_corpus(corpus_dir, tok, cache)
    assert tok.calls > calls  # rebuilt
    assert len(list(cache.glob("*.bin"))) == 2
    s = after.sources[1]
    assert ByteTokenizer().decode(after.tokens[s.start : s.end]).startswith("FILE 1")
    assert before.cache_path != after.cache_path


def test_content_round_trips_and_documents_tile_sources(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    corpus = load_corpus(corpus_dir, ByteTokenizer(), tmp_path / "cache")
    tok = ByteTokenizer()
    offset = 0
    for s in corpus.sources:
        assert s.start == offset
        assert tok.decode(corpus.tokens[s.start : s.end]) == Path(s.path).read_text()
        docs = s.documents
        assert docs[0, 0] == s.start and docs[-1, 1] == s.end
        assert np.all(docs[1:, 0] == docs[:-1, 1])  # contiguous, in file order
        assert tok.decode(corpus.tokens[docs[3, 0] : docs[3, 1]]).startswith("File")
        offset = s.end
    assert offset == corpus.num_tokens


def test_interrupted_build_leaves_no_cache(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    cache = tmp_path / "cache"

    class Crashing(ByteTokenizer):
        def encode(self, text):
            if "File 2" in text:  # dies part-way, after the first two files
                raise KeyboardInterrupt
            return super().encode(text)

    with pytest.raises(KeyboardInterrupt):
        load_corpus(corpus_dir, Crashing(), cache)
    assert list(cache.iterdir()) == []  # no half-written .bin, no temp file left behind
    tok = CountingTokenizer()
    load_corpus(corpus_dir, tok, cache)
    assert tok.calls > 0  # built from scratch

    # A truncated .bin next to its metadata is not trusted either.
    bin_path = next(cache.glob("*.bin"))
    bin_path.write_bytes(bin_path.read_bytes()[:-10])
    calls = tok.calls
    corpus = load_corpus(corpus_dir, tok, cache)
    assert tok.calls > calls and corpus.tokens.shape[0] * 2 == bin_path.stat().st_size


def test_token_dtype():
    assert D.token_dtype(256) == np.uint16 and D.token_dtype(65536) == np.uint16
    assert D.token_dtype(65537) == np.uint32


def test_missing_and_empty_corpus(tmp_path: Path):
    missing = tmp_path / "no_such_corpus.txt"
    with pytest.raises(FileNotFoundError, match="no_such_corpus.txt"):
        load_dataset(cfg_for(missing, tmp_path), 1)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_dataset(cfg_for(empty, tmp_path), 1)
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="no .*txt"):
        load_dataset(cfg_for(nothing, tmp_path), 1)


def test_default_corpus_loads(tmp_path: Path):
    assert DEFAULT_CORPUS.is_file()
    ds = load_dataset(DataConfig(cache_dir=str(tmp_path / "cache")), num_clients=2)
    assert ds.vocab_size == 256 and ds.corpus.num_tokens == DEFAULT_CORPUS.stat().st_size
    assert len(ds.train_shards) == 2 and len(ds.val_batches(max_batches=2)) == 2
    # eval_windows='spread': the last window of a one-batch pass lies in the split's last part, not its start
    spread = load_dataset(DataConfig(cache_dir=str(tmp_path / "cache"), eval_windows="spread"), num_clients=2)
    x = spread.val_batches(max_batches=1)[0][0]
    T = spread.config.seq_len
    start = (len(spread.val_tokens) - 1) // T * (len(x) - 1) // len(x) * T
    assert torch.equal(x[-1], torch.from_numpy(spread.val_tokens[start:start + T].astype(np.int64)))
    assert start > len(spread.val_tokens) // 2
    x, y = ds.train_shards[1].batch(0, 4, 32, seed=0)
    assert x.shape == (4, 32) and x.dtype == torch.long


# ----------------------------------------------------------------------------- split


@pytest.mark.parametrize("val_fraction", [0.0, 0.1, 0.25])
def test_split_fractions(tmp_path: Path, val_fraction: float):
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    ds = load_dataset(cfg_for(corpus_dir, tmp_path, val_fraction=val_fraction), 1)
    tails = []
    for s in ds.corpus.sources:
        n_val = s.end - D.split_point(s, val_fraction)
        assert n_val == round(s.num_tokens * val_fraction)  # every source has its own tail
        tails.append(ds.corpus.tokens[s.end - n_val : s.end])
    np.testing.assert_array_equal(ds.val_tokens, np.concatenate(tails))
    train = sum(s.num_tokens for s in ds.train_shards)
    assert train + len(ds.val_tokens) == ds.corpus.num_tokens
    assert abs(len(ds.val_tokens) / ds.corpus.num_tokens - val_fraction) < 0.01


def test_val_path_is_evaluated_instead_of_the_tail_split(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("Text that no run trains on.\n\n" * 200)
    ds = load_dataset(cfg_for(corpus_dir, tmp_path, val_fraction=0.25, val_path=str(held_out)), 2)
    # validation: the whole val_path corpus, tokenised like the train one
    np.testing.assert_array_equal(ds.val_tokens, ByteTokenizer().encode(held_out.read_text()))
    x, y = ds.val_batches(max_batches=1)[0]
    assert torch.equal(x[0], torch.from_numpy(ds.val_tokens[: ds.config.seq_len].astype(np.int64)))
    # training: the whole corpus (val_fraction does not apply)
    assert sum(s.num_tokens for s in ds.train_shards) == ds.corpus.num_tokens


def test_val_path_is_read_only_when_evaluating(tmp_path: Path):
    """A client builds its shard with the run's config but never evaluates: a val_path that only
    the server has must not stop it; the evaluation names the key and the missing path."""
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    missing = tmp_path / "not_here.txt"
    ds = load_dataset(cfg_for(corpus_dir, tmp_path, val_path=str(missing)), 2)
    assert ds.train_shards[1].num_tokens > 0
    with pytest.raises(FileNotFoundError, match=f"DataConfig.val_path={str(missing)!r}: corpus path not found"):
        ds.val_batches(1)
    with pytest.raises(ValueError, match=r"DataConfig.val_path=3: expected a string"):
        DataConfig(val_path=3).validate()


# ----------------------------------------------------------------------------- partitions


def test_iid_shards_contiguous_disjoint_cover(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus")
    ds = load_dataset(cfg_for(corpus_dir, tmp_path), num_clients=4)
    train = D.gather(ds.corpus.tokens, D.train_ranges(ds.corpus, 0.1))
    sizes = [s.num_tokens for s in ds.train_shards]
    assert max(sizes) - min(sizes) <= 1
    # In client order, the shards are consecutive pieces that rebuild the train stream exactly.
    np.testing.assert_array_equal(np.concatenate([s.tokens for s in ds.train_shards]), train)
    flat = np.concatenate(ds.client_ranges)
    assert np.all(flat[1:, 0] >= flat[:-1, 1])  # disjoint and in order

    # One source: every shard is a view of the memory-mapped corpus, not a copy.
    single = corpus_dir / "a.txt"
    ds1 = load_dataset(cfg_for(single, tmp_path), num_clients=3)
    for shard, r in zip(ds1.train_shards, ds1.client_ranges):
        assert len(r) == 1 and np.shares_memory(shard.tokens, ds1.corpus.tokens)


def test_by_source(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus", n_files=3)
    ds = load_dataset(cfg_for(corpus_dir, tmp_path, partition="by_source"), num_clients=3)
    for m, shard in enumerate(ds.train_shards):
        s = ds.corpus.sources[m]
        head = ds.corpus.tokens[s.start : D.split_point(s, 0.1)]
        np.testing.assert_array_equal(shard.tokens, head)
        text = ByteTokenizer().decode(shard.tokens)
        assert f"file {m}" in text and all(f"file {k}" not in text for k in range(3) if k != m)
    # Fewer clients than files: dealt round-robin in sorted order.
    ds2 = load_dataset(cfg_for(corpus_dir, tmp_path, partition="by_source"), num_clients=2)
    text0 = ByteTokenizer().decode(ds2.train_shards[0].tokens)
    assert "file 0" in text0 and "file 2" in text0 and "file 1" not in text0
    with pytest.raises(ValueError, match=r"3 source.*4 clients"):
        load_dataset(cfg_for(corpus_dir, tmp_path, partition="by_source"), num_clients=4)


def test_dirichlet_deterministic_and_covers_documents(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus", n_files=3, n_paras=80)

    def ranges(seed: int) -> list[np.ndarray]:
        cfg = cfg_for(corpus_dir, tmp_path, partition="dirichlet", dirichlet_alpha=0.5,
                      seed=seed, seq_len=16)
        return load_dataset(cfg, num_clients=4).client_ranges

    a, b, c = ranges(0), ranges(0), ranges(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))

    ds = load_dataset(cfg_for(corpus_dir, tmp_path, partition="dirichlet", seq_len=16), 4)
    expected = np.concatenate([D.train_documents(s, 0.1) for s in ds.corpus.sources])
    got = np.concatenate(ds.client_ranges)
    assert len(got) == len(expected)  # nothing duplicated ...
    got = got[np.argsort(got[:, 0])]
    np.testing.assert_array_equal(got, expected)  # ... and nothing missing
    for shard, r in zip(ds.train_shards, ds.client_ranges):
        np.testing.assert_array_equal(shard.tokens, D.gather(ds.corpus.tokens, r))
    # No train document reaches into validation.
    for s in ds.corpus.sources:
        assert D.train_documents(s, 0.1)[:, 1].max() <= D.split_point(s, 0.1)


def test_dirichlet_skew_is_a_function_of_alpha():
    docs = [np.stack([np.arange(0, 1000, 10), np.arange(10, 1010, 10)], 1)]  # 100 docs
    flat = D.partition_dirichlet(docs, 4, alpha=1000.0, seed=0)
    assert all(20 <= len(r) <= 30 for r in flat)  # large alpha: ~equal shares
    skewed = D.partition_dirichlet(docs, 4, alpha=0.01, seed=0)
    assert max(len(r) for r in skewed) >= 50  # tiny alpha: one client takes most


def test_dirichlet_starved_client_raises(tmp_path: Path):
    corpus_dir = write_corpus_dir(tmp_path / "corpus", n_files=1, n_paras=20)
    cfg = cfg_for(corpus_dir, tmp_path, partition="dirichlet", dirichlet_alpha=0.01, seq_len=64)
    with pytest.raises(ValueError, match=r"client \d+ of 8 .*seq_len\+1=65.*dirichlet_alpha"):
        load_dataset(cfg, num_clients=8)


# ----------------------------------------------------------------------------- batches


def test_batch_deterministic_and_shifted():
    tokens = np.arange(1000, dtype=np.uint16)  # token value == position: windows are visible
    shard = TokenShard(tokens, shard_id=2)
    x, y = shard.batch(5, batch_size=8, seq_len=16, seed=3)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)  # contiguous windows
    assert int(y.max()) < 1000
    x2, y2 = shard.batch(5, batch_size=8, seq_len=16, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # pure function of (seed, shard, i)
    assert not torch.equal(x, shard.batch(6, 8, 16, seed=3)[0])
    assert not torch.equal(x, shard.batch(5, 8, 16, seed=4)[0])
    assert not torch.equal(x, TokenShard(tokens, shard_id=1).batch(5, 8, 16, seed=3)[0])
    assert shard.num_tokens == 1000


def test_batch_errors():
    shard = TokenShard(np.arange(10), shard_id=0)
    shard.batch(0, 2, seq_len=9, seed=0)  # exactly seq_len+1 tokens is enough
    with pytest.raises(ValueError, match=r"10 tokens.*seq_len\+1=11"):
        shard.batch(0, 2, seq_len=10, seed=0)
    with pytest.raises(ValueError, match="index"):
        shard.batch(-1, 2, 4, seed=0)


def test_validation_batches_sequential():
    tokens = np.arange(100, dtype=np.uint16)
    batches = validation_batches(tokens, batch_size=2, seq_len=10, max_batches=None)
    assert [b[0].shape[0] for b in batches] == [2, 2, 2, 2, 1]  # 9 windows of 10 (+1) tokens
    xs = torch.cat([x for x, _ in batches])
    assert torch.equal(xs.flatten(), torch.arange(90))  # non-overlapping, in order
    assert all(torch.equal(y, x + 1) for x, y in batches)
    again = validation_batches(tokens, 2, 10, max_batches=2)
    assert len(again) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(again, batches))
    assert validation_batches(tokens[:5], 2, 10) == []


def test_spread_validation_windows_sample_the_whole_split():
    """`spread`: a capped pass reads windows evenly spaced over the split (4 of 9 windows: 0, 2, 4, 6),
    each the window the uncapped pass reads there; uncapped, it reads every window, as `first` does."""
    tokens = np.arange(100, dtype=np.uint16)
    every = [x for b in validation_batches(tokens, 2, 10) for x in zip(*b)]
    spread = validation_batches(tokens, 2, 10, max_batches=2, spread=True)
    got = [x for b in spread for x in zip(*b)]
    assert [b[0].shape[0] for b in spread] == [2, 2] and len(got) == 4
    for (x, y), j in zip(got, (0, 2, 4, 6)):
        assert torch.equal(x, every[j][0]) and torch.equal(y, every[j][1])
    assert [x[0].item() for x, _ in got] == [0, 20, 40, 60]
    whole = validation_batches(tokens, 2, 10, spread=True)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole, validation_batches(tokens, 2, 10)))
    with pytest.raises(ValueError, match=r"DataConfig.eval_windows='middle': expected one of \('first', 'spread'\)"):
        DataConfig(eval_windows="middle").validate()


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value",
    [
        ("val_fraction", 1.0),
        ("val_fraction", -0.1),
        ("seq_len", 0),
        ("seq_len", 12.5),
        ("batch_size", 0),
        ("partition", "random"),
        ("dirichlet_alpha", 0.0),
        ("dirichlet_alpha", float("inf")),
        ("seed", -1),
        ("tokenizer", ""),
    ],
)
def test_bad_config_names_field(field: str, value, tmp_path: Path):
    cfg = DataConfig(cache_dir=str(tmp_path), **{field: value})
    with pytest.raises(ValueError) as e:
        load_dataset(cfg, num_clients=1)
    msg = str(e.value)
    assert f"DataConfig.{field}={value!r}" in msg and "expected" in msg


def test_partition_error_lists_choices():
    with pytest.raises(ValueError, match=r"partition='random'.*'iid', 'by_source', 'dirichlet'"):
        DataConfig(partition="random").validate()
    assert DataConfig().validate() == DataConfig()


def test_bad_num_clients(tmp_path: Path):
    with pytest.raises(ValueError, match="num_clients=0"):
        load_dataset(DataConfig(cache_dir=str(tmp_path)), num_clients=0)


def test_every_config_field_has_a_docstring():
    import ast
    import dataclasses
    import inspect

    tree = ast.parse(inspect.getsource(DataConfig))
    body = tree.body[0].body
    documented = {
        stmt.target.id
        for stmt, nxt in zip(body, body[1:])
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(nxt, ast.Expr)
        and isinstance(nxt.value, ast.Constant)
        and isinstance(nxt.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(DataConfig)}


def test_hf_tokenizer_corpus(tmp_path: Path):
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    corpus_dir = write_corpus_dir(tmp_path / "corpus", n_files=2)
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([p.read_text() for p in corpus_dir.rglob("*.txt")], trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))

    cfg = cfg_for(corpus_dir, tmp_path, tokenizer=str(tmp_path), seq_len=16)
    ds = load_dataset(cfg, num_clients=2)
    assert ds.vocab_size == tok.get_vocab_size() and ds.corpus.tokenizer_name.startswith("hf:")
    s = ds.corpus.sources[0]
    assert ds.tokenizer.decode(ds.corpus.tokens[s.start : s.end]) == Path(s.path).read_text()
    assert ds.corpus.num_tokens < sum(Path(s.path).stat().st_size for s in ds.corpus.sources)
    # A different tokenizer on the same files is a different cache entry.
    load_dataset(cfg_for(corpus_dir, tmp_path), num_clients=2)
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2
