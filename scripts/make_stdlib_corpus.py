"""Make a corpus of Python code large enough that 64 rounds of the `small_cpu` setting read it less than
once: every UTF-8 `.py` file of the installed CPython's standard library (its tests included, not
site-packages), less the modules the shipped `python_stdlib.txt` holds, in an order shuffled with a fixed
seed so that the held-out tail (`data.val_fraction`) is a random sample of files, not the last packages
of the alphabet. Each file follows a `# ---- Lib/<path> ----` line, as in the shipped corpus.

    python scripts/make_stdlib_corpus.py /tmp/stdlib_large.txt
    python benchmarks/corpora_quality.py --corpus code-large=/tmp/stdlib_large.txt --corpora code-large ...

It is made, not shipped: CPython 3.11.7 gives about 30 MB (the shipped corpora are about 1.1 MB, and
64 rounds of M = 4 workers read 16.8 M tokens, 16.8 passes over them: docs/results.md, section 17,
part eight). Another Python version gives other text; the script prints the size and sha256 to cite.
Python is distributed under the PSF License Agreement (lordo_fed/corpora/LICENSE-PSF.txt)."""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import sys
import sysconfig
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "lordo_fed" / "corpora" / "python_stdlib.txt"


def shipped_modules(path: Path = SHIPPED) -> set[str]:
    """The `Lib/...` paths the shipped code corpus holds (its `# ---- Lib/<name> (CPython x) ----` lines)."""
    return set(re.findall(r"^# ---- (Lib/\S+)", path.read_text(encoding="utf-8"), flags=re.M))


def stdlib_files(lib: Path) -> list[tuple[str, str]]:
    """(`Lib/<path>`, text) of every `.py` file under `lib` that decodes as UTF-8, sorted, without
    site-packages and the shipped corpus's modules."""
    skip = shipped_modules()
    out = []
    for f in sorted(lib.rglob("*.py")):
        rel = f.relative_to(lib)
        name = f"Lib/{rel.as_posix()}"
        if rel.parts[0] == "site-packages" or name in skip:
            continue
        try:
            out.append((name, f.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):  # a few tests keep deliberately bad encodings
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the text file to write")
    parser.add_argument("--lib", default=sysconfig.get_paths()["stdlib"], help="the standard library's folder "
                        "(default: this Python's)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the files")
    parser.add_argument("--min-mb", type=float, default=20.0, help="refuse to write less (MB of UTF-8)")
    args = parser.parse_args()
    lib = Path(args.lib)
    if not (lib / "os.py").is_file():
        parser.error(f"--lib {args.lib!r}: expected a CPython standard library folder (with os.py)")
    files = stdlib_files(lib)
    random.Random(args.seed).shuffle(files)
    text = "".join(f"# ---- {name} ----\n{body.rstrip()}\n\n" for name, body in files)
    data = text.encode("utf-8")
    if len(data) < args.min_mb * 1e6:
        parser.error(f"{lib} gives {len(data) / 1e6:.1f} MB of code, expected at least --min-mb {args.min_mb}")
    Path(args.out).write_bytes(data)
    print(f"{args.out}: {len(files)} files, {len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}, "
          f"Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
