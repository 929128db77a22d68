"""Corpus formats (lordo_fed.data.readers): JSON Lines, Parquet, Hugging Face datasets saved to
disk and nanoGPT token bins give the tokens and documents their records hold, streamed in
batches into the same token cache as text files; bad input names the file, record and field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lordo_fed import data as D
from lordo_fed.data import DataConfig, load_corpus, load_dataset
from lordo_fed.data.readers import list_sources
from lordo_fed.data.tokenizer import ByteTokenizer

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 5) for i in range(200)]


def write_jsonl(path: Path, docs, field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs, field: str = "text") -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=37)
    return path


def write_hf(path: Path, docs, field: str = "text") -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"id": list(range(len(docs))), field: docs}).save_to_disk(str(path))
    return path


class BatchCountingTokenizer(ByteTokenizer):
    """A byte tokenizer with encode_batch (as HF tokenizers have), counting its batches."""

    def __init__(self):
        self.batches = []

    def encode_batch(self, texts):
        self.batches.append(len(texts))
        return [self.encode(t) for t in texts]


def expected_tokens(docs) -> np.ndarray:
    return np.concatenate([ByteTokenizer().encode(d) for d in docs]).astype(np.uint16)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_record_formats_give_one_document_per_record(tmp_path, fmt, monkeypatch):
    monkeypatch.setattr("lordo_fed.data.readers.DOCS_PER_BATCH", 64)  # several batches: streamed
    write = {"jsonl": lambda p: write_jsonl(p / "c.jsonl", DOCS), "parquet": lambda p: write_parquet(p / "c.parquet", DOCS),
             "hf": lambda p: write_hf(p / "ds", DOCS)}[fmt]
    path = write(tmp_path / "corpus")
    tok = BatchCountingTokenizer()
    corpus = load_corpus(path, tok, tmp_path / "cache")
    np.testing.assert_array_equal(corpus.tokens, expected_tokens(DOCS))
    (source,) = corpus.sources
    lengths = [len(d.encode()) for d in DOCS]
    ends = np.cumsum(lengths)
    np.testing.assert_array_equal(source.documents, np.stack([ends - lengths, ends], axis=1))
    assert len(tok.batches) >= 3 and max(tok.batches) <= 64 and sum(tok.batches) == len(DOCS)
    # a second load is a cache hit
    again = BatchCountingTokenizer()
    load_corpus(path, again, tmp_path / "cache")
    assert again.batches == []


def test_a_custom_text_field(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", DOCS[:10], field="content")
    corpus = load_corpus(path, ByteTokenizer(), tmp_path / "cache", text_field="content")
    np.testing.assert_array_equal(corpus.tokens, expected_tokens(DOCS[:10]))
    with pytest.raises(ValueError, match=r"line 1: no field 'text' \(has \['content', 'id'\]\)"):
        load_corpus(path, ByteTokenizer(), tmp_path / "cache2")
    with pytest.raises(ValueError, match="DataConfig.text_field=''"):
        DataConfig(text_field="").validate()


def test_token_bins_in_nanogpts_layout(tmp_path, monkeypatch):
    monkeypatch.setattr("lordo_fed.data.readers.TOKENS_PER_CHUNK", 1000)  # memory-mapped, read in chunks
    ids = np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")  # what nanoGPT's prepare.py writes
    corpus = load_corpus(tmp_path / "train.bin", ByteTokenizer(), tmp_path / "cache")
    np.testing.assert_array_equal(corpus.tokens, ids)
    assert corpus.sources[0].documents.tolist() == [[0, 5000]]
    # ids from a larger vocabulary than the configured tokenizer's: refused, naming file and id
    np.array([1, 2, 300], dtype=np.uint16).tofile(tmp_path / "gpt2.bin")
    with pytest.raises(ValueError, match=r"gpt2\.bin.*id 300 .*outside the tokenizer's vocabulary \[0, 256\)"):
        load_corpus(tmp_path / "gpt2.bin", ByteTokenizer(), tmp_path / "cache")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="3 bytes is not a whole number of uint16"):
        load_corpus(tmp_path / "odd.bin", ByteTokenizer(), tmp_path / "cache")


def test_errors_name_the_setting_of_each_entry_point(tmp_path):
    """A token bin from another tokenizer, or a JSON Lines file without the text field: the error
    names what the user can really set, in the Flower app (a run-config key) and in lordo-train
    (a Hydra path), and both exist."""
    from lordo_fed.app.config import FLAT_KEYS
    from lordo_fed.trainer.config import TrainConfig

    np.array([1, 2, 50_000], dtype=np.uint16).tofile(tmp_path / "gpt2.bin")  # GPT-2 ids, read as bytes
    with pytest.raises(ValueError) as err:
        load_corpus(tmp_path / "gpt2.bin", ByteTokenizer(), tmp_path / "cache")
    message = str(err.value)
    assert "id 50000 at or after token 0 is outside the tokenizer's vocabulary [0, 256)" in message
    assert "run-config key tokenizer='/path/to/tokenizer.json'" in message
    assert "lordo-train: data.tokenizer=/path/to/tokenizer.json" in message
    assert FLAT_KEYS["tokenizer"] == "data.tokenizer" and TrainConfig().data.tokenizer == "byte"

    path = write_jsonl(tmp_path / "c.jsonl", DOCS[:2], field="content")
    with pytest.raises(ValueError, match=r"run-config key text-field='\.\.\.' \(lordo-train: data\.text_field=\.\.\.\)"):
        load_corpus(path, ByteTokenizer(), tmp_path / "cache")
    assert FLAT_KEYS["text-field"] == "data.text_field"


def test_a_directory_mixes_formats_in_sorted_order(tmp_path):
    root = tmp_path / "corpus"
    write_jsonl(root / "b.jsonl", DOCS[:5])
    write_hf(root / "c_ds", DOCS[5:9])
    (root / "a.txt").write_text("first paragraph\n\nsecond paragraph\n")
    np.frombuffer(b"tokens!", dtype=np.uint8).astype(np.uint16).tofile(root / "d.bin")
    (root / "notes.csv").write_text("ignored")
    sources = list_sources(root)
    assert [(s.path.name, s.kind) for s in sources] == [("a.txt", "text"), ("b.jsonl", "jsonl"), ("c_ds", "hf"),
                                                          ("d.bin", "tokens")]
    corpus = load_corpus(root, ByteTokenizer(), tmp_path / "cache")
    want = np.concatenate([ByteTokenizer().encode("first paragraph\n\nsecond paragraph\n").astype(np.uint16),
                           expected_tokens(DOCS[:9]), np.frombuffer(b"tokens!", dtype=np.uint8).astype(np.uint16)])
    np.testing.assert_array_equal(corpus.tokens, want)
    assert [len(s.documents) for s in corpus.sources] == [2, 5, 4, 1]


def test_bad_corpora_are_named(tmp_path):
    write_jsonl(tmp_path / "ok.jsonl", DOCS[:2])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl', line 2: not a JSON object"):
        load_corpus(tmp_path / "bad.jsonl", ByteTokenizer(), tmp_path / "cache")
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match=r"num\.jsonl', line 1: field 'text' is int, expected a string"):
        load_corpus(tmp_path / "num.jsonl", ByteTokenizer(), tmp_path / "cache")
    write_parquet(tmp_path / "p.parquet", DOCS[:3], field="body")
    with pytest.raises(ValueError, match=r"p\.parquet': no column 'text' \(columns \['id', 'body'\]\)"):
        load_corpus(tmp_path / "p.parquet", ByteTokenizer(), tmp_path / "cache")
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:3]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict: point the corpus path at one split.*'train'"):
        load_corpus(tmp_path / "dd", ByteTokenizer(), tmp_path / "cache")
    assert load_corpus(tmp_path / "dd" / "train", ByteTokenizer(), tmp_path / "cache").num_tokens > 0
    with pytest.raises(FileNotFoundError, match="corpus path not found"):
        load_corpus(tmp_path / "missing", ByteTokenizer(), tmp_path / "cache")


def test_a_parquet_corpus_trains_through_load_dataset(tmp_path):
    """The whole data pipeline on a Parquet corpus: split, Dirichlet partition over its
    documents (one per row), batches of the configured shape."""
    path = write_parquet(tmp_path / "corpus.parquet", DOCS)
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), seq_len=16, batch_size=4,
                     partition="dirichlet", dirichlet_alpha=5.0)
    ds = load_dataset(cfg, num_clients=3)
    assert ds.corpus.num_tokens == len(expected_tokens(DOCS))
    train_docs = D.train_documents(ds.corpus.sources[0], cfg.val_fraction)
    assert len(train_docs) > 150  # one document per row, most of them train
    assert sum(s.num_tokens for s in ds.train_shards) == int((train_docs[:, 1] - train_docs[:, 0]).sum())
    x, y = ds.train_shards[0].batch(0, 4, 16)
    assert x.shape == y.shape == (4, 16)
    assert ds.val_batches(1)[0][0].shape == (4, 16)


def test_a_tokenizer_producing_ids_beyond_its_vocabulary_is_refused(tmp_path):
    class Narrow(ByteTokenizer):
        name, vocab_size = "narrow", 100  # claims 100 ids, encodes bytes up to 255

    path = write_jsonl(tmp_path / "c.jsonl", ["plain ascii ~~~ {|}"])
    with pytest.raises(ValueError, match=r"tokenizer 'narrow' produced ids outside \[0, 100\) for .*c\.jsonl"):
        load_corpus(path, Narrow(), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.bin")), "a refused corpus left a cache entry"


def test_the_stdlib_corpus_holds_every_file_once_less_the_shipped_modules(tmp_path):
    """scripts/make_stdlib_corpus.py: every UTF-8 `.py` file of the library folder comes back whole, once, after
    its header; site-packages, the shipped corpus's modules and files that are not UTF-8 are left out; the order is
    shuffled by the seed alone; too little text is refused."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    lib = tmp_path / "lib"
    files = {"os.py": "import sys\n", "json/__init__.py": "'''json'''\n\ndef dumps(x):\n    return x\n",
             "test/test_os.py": "# a test\nassert True\n", **{f"m{i}.py": f"x = {i}\n" * (i + 1) for i in range(20)}}
    left_out = {"site-packages/pkg.py": "pkg = 1\n", "argparse.py": "# shipped\n"}
    for name, text in {**files, **left_out}.items():
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_text(text, encoding="utf-8")
    (lib / "latin1.py").write_bytes("# caf\u00e9\n".encode("latin-1"))

    def make(out: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(root / "scripts" / "make_stdlib_corpus.py"), str(out), "--lib",
                               str(lib), "--min-mb", "0", *args], capture_output=True, text=True, timeout=60)

    assert make(tmp_path / "a.txt").returncode == 0
    text = (tmp_path / "a.txt").read_text(encoding="utf-8")
    pieces = text.split("# ---- Lib/")[1:]
    got = {p.split(" ----\n", 1)[0]: p.split(" ----\n", 1)[1] for p in pieces}
    assert {k: v.rstrip() for k, v in got.items()} == {k: v.rstrip() for k, v in files.items()}
    order = [p.split(" ----\n", 1)[0] for p in pieces]
    assert order != sorted(order)  # shuffled: the held-out tail is not the alphabet's last files
    make(tmp_path / "b.txt")
    assert (tmp_path / "b.txt").read_bytes() == text.encode()  # the seed alone fixes the order
    make(tmp_path / "c.txt", "--seed", "1")
    assert (tmp_path / "c.txt").read_bytes() != text.encode()
    small = subprocess.run([sys.executable, str(root / "scripts" / "make_stdlib_corpus.py"), str(tmp_path / "d.txt"),
                            "--lib", str(lib)], capture_output=True, text=True, timeout=60)
    assert small.returncode == 2 and "expected at least --min-mb 20.0" in small.stderr and not (tmp_path / "d.txt").exists()
    bad = make(tmp_path / "e.txt", "--lib", str(tmp_path))
    assert bad.returncode == 2 and "expected a CPython standard library folder" in bad.stderr
