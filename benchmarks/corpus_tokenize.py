"""Tokenising a corpus into the token cache, per format and tokenizer (lordo_fed.data.readers).

The same documents (the shipped corpus's paragraphs, repeated with a counter until the corpus
reaches `--mb` MB of text) are written as a text file, JSON Lines, Parquet and a Hugging Face
dataset saved to disk, then each is tokenised by `lordo_fed.data.load_corpus` into a fresh cache
(one process per tokenizer setting, the readers imported before the clock starts): with the byte
tokenizer, and with a BPE tokenizer (vocabulary 8192, trained here with `tokenizers` on the shipped
corpus and saved to a local tokenizer.json: nothing is downloaded) on all cores and on one (`RAYON_NUM_THREADS=1`), the parallelism that HF tokenizers'
`encode_batch` brings to each batch of documents. MB/s counts the documents' UTF-8 bytes; a
tokenizer must give the same tokens from JSON Lines, Parquet and the HF dataset (checked: sha256
of the cached tokens; the text file also holds the blank lines between its paragraphs).

    python benchmarks/corpus_tokenize.py            # 64 MB of text per format (~3 min on 2 cores)
    python benchmarks/corpus_tokenize.py --quick    # 0.5 MB
Writes benchmarks/results/corpus_tokenize.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import make_parser, print_rows, result_header, write_json  # noqa: E402
from harness.processes import checkout_env  # noqa: E402

FORMATS = ("text", "jsonl", "parquet", "hf")


def documents(target_bytes: int) -> list[str]:
    from lordo_fed.data import DEFAULT_CORPUS, split_documents

    base = [d.strip() for d in split_documents(DEFAULT_CORPUS.read_text()) if d.strip() and "\n\n" not in d.strip()]
    docs, size, i = [], 0, 0
    while size < target_bytes:
        doc = f"[{i}] {base[i % len(base)]}"
        docs.append(doc)
        size += len(doc.encode()) + 2
        i += 1
    return docs


def write_formats(docs: list[str], folder: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = {"text": folder / "corpus.txt", "jsonl": folder / "corpus.jsonl", "parquet": folder / "corpus.parquet",
             "hf": folder / "corpus_hf"}
    paths["text"].write_text("\n\n".join(docs) + "\n\n")  # blank lines: one paragraph per document
    with open(paths["jsonl"], "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    pq.write_table(pa.table({"text": docs}), paths["parquet"], row_group_size=8192)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(paths["hf"]))
    return paths


def train_bpe(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from lordo_fed.data import DEFAULT_CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(DEFAULT_CORPUS)], trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def child(specs: list[dict]) -> list[dict]:
    """Each spec's load_corpus into its own fresh cache, timed, in this process: one process per
    tokenizer setting (RAYON_NUM_THREADS is read once, when tokenizers starts its pool). The readers'
    libraries are imported before the first clock starts, so no format's figure includes an import."""
    import datasets  # noqa: F401  (the HF reader's)
    import pyarrow.parquet  # noqa: F401

    from lordo_fed.data import load_corpus
    from lordo_fed.data.tokenizer import load_tokenizer

    rows = []
    for spec in specs:
        tokenizer = load_tokenizer(spec["tokenizer"])
        started = time.perf_counter()
        corpus = load_corpus(spec["path"], tokenizer, spec["cache"])
        seconds = time.perf_counter() - started
        tokens = corpus.tokens
        rows.append({"seconds": seconds, "tokens": int(tokens.shape[0]),
                     "documents": int(sum(len(s.documents) for s in corpus.sources)),
                     "tokens_sha256": hashlib.sha256(memoryview(tokens)).hexdigest()})
    return rows


def run(specs: list[dict], env: dict) -> list[dict]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(specs)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"{specs}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = make_parser("corpus_tokenize", __doc__, "0.5 MB of text per format")
    parser.add_argument("--mb", type=float, default=None, help="MB of text per format (default 64; --quick 0.5)")
    args = parser.parse_args()
    mb = args.mb or (0.5 if args.quick else 64.0)
    env = checkout_env()
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="corpus_tokenize_") as tmp:
        tmp = Path(tmp)
        docs = documents(int(mb * 1e6))
        text_bytes = sum(len(d.encode()) for d in docs)
        paths = write_formats(docs, tmp / "corpus")
        bpe = train_bpe(tmp / "bpe.json")
        cases = [("byte", "byte", {})] + [("bpe-8192, all cores", str(bpe), {}),
                                          ("bpe-8192, 1 thread", str(bpe), {"RAYON_NUM_THREADS": "1"})]
        for label, tok, extra in cases:
            specs = [{"path": str(paths[fmt]), "tokenizer": tok, "cache": str(tmp / f"cache-{label}-{fmt}")}
                     for fmt in FORMATS]
            for fmt, row in zip(FORMATS, run(specs, {**env, **extra})):
                row.update(format=fmt, tokenizer=label, text_mb=text_bytes / 1e6,
                           mb_per_s=text_bytes / 1e6 / row["seconds"], tokens_per_s=row["tokens"] / row["seconds"])
                rows.append(row)
                print(f"[corpus_tokenize] {fmt:8s} {label:20s} {row['seconds']:7.2f} s  {row['mb_per_s']:6.1f} MB/s  "
                      f"{row['tokens'] / 1e6:.1f} M tokens", flush=True)
        rows.sort(key=lambda r: (FORMATS.index(r["format"]), [c[0] for c in cases].index(r["tokenizer"])))
    for label, *_ in cases:  # the record formats hold the same documents: the same tokens
        digests = {r["tokens_sha256"] for r in rows
                   if r["tokenizer"].split(",")[0] == label.split(",")[0] and r["format"] != "text"}
        if len(digests) != 1:
            raise AssertionError(f"{label}: JSON Lines, Parquet and the HF dataset gave different tokens")
    result = result_header("corpus_tokenize", args.quick, {"text_mb": text_bytes / 1e6, "documents": len(docs),
                                                            "formats": list(FORMATS), "cpu_count": os.cpu_count()})
    result["seconds"] = time.perf_counter() - started
    result["rows"] = rows
    out = write_json(result, args.out)
    print_rows(f"{'format':8} {'tokenizer':20} {'MB/s':>7} {'M tokens/s':>10}",
               (f"{r['format']:8} {r['tokenizer']:20} {r['mb_per_s']:7.1f} {r['tokens_per_s'] / 1e6:10.2f}" for r in rows))
    print(f"written {out}")


if __name__ == "__main__":
    main()
