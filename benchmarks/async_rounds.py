"""Asynchronous rounds under heterogeneity on the virtual clock (issue 13): synchronous DiLoCo,
async DiLoCo, async momentum look-ahead, HeLoCo, synchronous LoRDO-Global and async LoRDO without
and with HeLoCo's correction; the same tokens; IID and non-IID data.

Runs the reference trainer with `examples/reference/async_cpu.yaml` (small preset, 4 workers of
which worker 3 is 4x slower, K = 16, arrivals weighted by ρ = 1/√4; every method trains on the same
tokens) on two data settings:
- iid: the shipped tiny Shakespeare, split IID;
- non_iid: tiny Shakespeare and the shipped Python standard-library text, each cut in two files,
  partitioned `by_source`: workers 0 and 1 see only verse, workers 2 and 3 (3 the slow one) only
  Python code; the validation split holds both.
It reads each method's records: validation loss against tokens and against virtual time (a
synchronous round waits for the slowest worker, K · 4 virtual seconds; an asynchronous method runs
until it has trained the same tokens), the staleness of the pushes, pushes per worker, bytes. The
schedule is deterministic (lordo_fed.rounds.async_rounds.VirtualClock): the figures do not depend on this
machine's speed.

    python benchmarks/async_rounds.py            # small preset, 128 steps per worker (~33 min on 2 cores)
    python benchmarks/async_rounds.py --quick    # tiny preset, a few pushes (seconds)
    python benchmarks/async_rounds.py --settings non_iid --methods async_lookahead,async_lordo,heloco_lordo \
        --set async_rounds.staleness_exponent=0.5 --out benchmarks/results/async_rounds_staleness0.5.json
Writes benchmarks/results/async_rounds.json and async_rounds.png (or --out).

    python benchmarks/async_rounds.py --merge A.json B.json ... --out benchmarks/results/X.json
                                                 # no run: several results in one file, every
                                                 # run's curves against tokens in one figure
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from benchmarks.common import make_parser, new_figure, png_path, result_header, write_json
except ImportError:  # run as `python benchmarks/async_rounds.py`
    from common import make_parser, new_figure, png_path, result_header, write_json

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("diloco", "async_diloco", "async_lookahead", "heloco", "lordo_global", "async_lordo", "heloco_lordo")
SYNC = ("diloco", "lordo_global")
CORPORA = ROOT / "lordo_fed" / "corpora"
QUICK = ["model.preset=tiny", "total_steps=8", "rounds.local_steps=2", "data.seq_len=32", "data.batch_size=4",
         "eval_batches=2", "inner.warmup_steps=2"]


def non_iid_corpus(directory: Path) -> Path:
    """Four sources, two per language, in the order `by_source` deals them (worker m gets file m):
    the first and second half (by lines) of tiny Shakespeare, then of the Python text."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("tinyshakespeare.txt", "python_stdlib.txt")):
        lines = (CORPORA / name).read_text(encoding="utf-8").splitlines(keepends=True)
        half = len(lines) // 2
        for j, part in enumerate((lines[:half], lines[half:])):
            (directory / f"{2 * i + j}_{Path(name).stem}.txt").write_text("".join(part), encoding="utf-8")
    return directory


def run(quick: bool, out_dir: Path, data: list[str], methods: tuple[str, ...] = METHODS,
        extra: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """Run the trainer once for `methods` on one data setting (`extra`: more trainer overrides);
    each method's records."""
    cmd = [sys.executable, "-m", "lordo_fed.trainer.cli", "--config-dir", str(ROOT / "examples" / "reference"),
           "--config-name", "async_cpu", f"out_dir={out_dir}", "progress=false",
           f"methods=[{','.join(methods)}]", *data, *(QUICK if quick else []), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"lordo-train failed:\n{proc.stderr[-3000:]}")
    return {m: [json.loads(line) for line in (out_dir / f"{m}.jsonl").read_text().splitlines()] for m in methods}


def summarise(records: dict[str, list[dict]]) -> dict[str, dict]:
    """Per method: its final loss, and every method's loss at the virtual time the first
    asynchronous method finished (the last evaluation at or before it)."""
    curves = {m: [(r["virtual_time"], r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
              for m, rows in records.items()}
    t_async = min(c[-1][0] for m, c in curves.items() if m not in SYNC)
    out = {}
    for m, rows in records.items():
        pushes = [r for r in rows if "staleness" in r]
        staleness: dict[str, int] = {}
        for r in pushes:
            for s, n in r["staleness"].items():
                staleness[s] = staleness.get(s, 0) + n
        by_worker = [sum(r["pushes_by_worker"][w] for r in pushes) for w in range(len(pushes[0]["pushes_by_worker"]))] \
            if pushes else None
        at_t = [v for t, _, v in curves[m] if t <= t_async]
        out[m] = {
            "final_val_loss": curves[m][-1][2], "final_tokens": curves[m][-1][1], "final_virtual_time": curves[m][-1][0],
            "val_loss_at_async_end": at_t[-1], "staleness": staleness, "pushes_by_worker": by_worker,
            "dropped": sum(r.get("dropped", 0) for r in pushes),
            "bytes_per_worker": rows[-1]["cum_bytes_sent_per_worker"] + rows[-1]["cum_bytes_received_per_worker"],
            "curve": [{"virtual_time": t, "tokens": k, "val_loss": v} for t, k, v in curves[m]],
        }
    return {"async_end_virtual_time": t_async, "methods": out}


def plot(result: dict, path: Path) -> None:
    """Per data setting (rows): validation loss against tokens, against virtual time, and the
    staleness histogram of the asynchronous methods (they share one schedule)."""
    settings = result["settings"]
    fig = new_figure(16, 4.5 * len(settings))
    for row, (name, summary) in enumerate(settings.items()):
        ax1, ax2, ax3 = (fig.add_subplot(len(settings), 3, 3 * row + i) for i in (1, 2, 3))
        for m, s in summary["methods"].items():
            style = "--" if m in SYNC else "-"
            ys = [min(p["val_loss"], 8.0) for p in s["curve"]]  # a diverged run is clipped, not dropped
            ax1.plot([p["tokens"] / 1e6 for p in s["curve"]], ys, style, marker=".", label=m)
            ax2.plot([p["virtual_time"] for p in s["curve"]], ys, style, marker=".", label=m)
        ax1.set(xlabel="tokens (M)", ylabel="validation loss (clipped at 8)", title=f"{name}: same tokens")
        ax2.set(xlabel="virtual seconds (worker 3 4x slower)", title=f"{name}: same clock")
        ax2.axvline(summary["async_end_virtual_time"], color="grey", lw=0.8, ls="--")
        hist = next(s for m, s in summary["methods"].items() if m not in SYNC)["staleness"]  # one schedule
        ax3.bar([int(k) for k in hist], list(hist.values()))
        ax3.set(xlabel="staleness (outer steps between pull and push)", ylabel="pushes",
                title=f"{name}: staleness of the asynchronous pushes")
        ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def merge(paths: list[str], out: str) -> Path:
    """`--merge`: results of several invocations (each with its own command and overrides) in one file
    keyed by file stem, and one figure: each data setting's validation loss against tokens, a panel per
    file, every method of that file in it."""
    runs = {Path(p).stem: json.loads(Path(p).read_text(encoding="utf-8")) for p in paths}
    result = {**result_header("async_rounds", False, {"merged": list(runs)}), "runs": runs}
    written = write_json(result, out)
    panels = [(stem, name, summary) for stem, r in runs.items() for name, summary in r["settings"].items()]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = new_figure(5.5 * cols, 4.0 * rows)
    for i, (stem, name, summary) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for m, s in summary["methods"].items():
            ys = [min(p["val_loss"], 8.0) for p in s["curve"]]
            ax.plot([p["tokens"] / 1e6 for p in s["curve"]], ys, "--" if m in SYNC else "-", marker=".",
                    label=f"{m} {s['final_val_loss']:.3f}")
        ax.set(xlabel="tokens (M)", ylabel="validation loss (clipped at 8)", title=f"{stem}: {name}", ylim=(2.0, 4.0))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path(written))
    return written


def main() -> None:
    parser = make_parser("async_rounds", __doc__, "tiny preset, a few pushes (seconds)")
    parser.add_argument("--merge", nargs="+", default=[], metavar="RESULT",
                        help="no run: merge these result files into --out, with one figure of every run's curves")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    parser.add_argument("--settings", default="iid,non_iid", help="comma-separated data settings: iid, non_iid")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer override for every method, e.g. async_rounds.staleness_exponent=0.5 (repeatable)")
    args = parser.parse_args()
    if args.merge:
        print(f"wrote {merge(args.merge, args.out)}")
        return
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    bad = sorted(set(methods) - set(METHODS)) + sorted(set(names) - {"iid", "non_iid"})
    if bad or not methods or not names or all(m in SYNC for m in methods):
        parser.error(f"--methods {args.methods!r} / --settings {args.settings!r}: expected methods of {METHODS} "
                     "(one asynchronous at least) and settings of ('iid', 'non_iid')")
    started = time.perf_counter()
    settings = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = non_iid_corpus(Path(tmp) / "non_iid_corpus")
        data = {"iid": [], "non_iid": [f"data.path={corpus}", "data.partition=by_source"]}
        for name in names:
            settings[name] = summarise(run(args.quick, Path(tmp) / name, data[name], methods, tuple(args.set)))
    cfg = {"config": "examples/reference/async_cpu.yaml", "methods": list(methods),
           "overrides": [*(QUICK if args.quick else []), *args.set],
           "non_iid": "tinyshakespeare.txt and python_stdlib.txt cut in two each, partition by_source: workers 0, 1 "
                      "verse; 2, 3 Python (3 is the slow one)"}
    result = {**result_header("async_rounds", args.quick, cfg), "seconds": time.perf_counter() - started,
              "settings": settings}
    out = write_json(result, args.out)
    plot(result, png_path(out))
    for name, summary in settings.items():
        print(f"{name}: the first asynchronous method finished at t={summary['async_end_virtual_time']:.0f}")
        for m, s in summary["methods"].items():
            print(f"  {m:16s} final val loss {s['final_val_loss']:8.3f} at t={s['final_virtual_time']:6.0f}; at "
                  f"t={summary['async_end_virtual_time']:.0f}: {s['val_loss_at_async_end']:.3f}; staleness "
                  f"{s['staleness']}, pushes by worker {s['pushes_by_worker']}, {s['bytes_per_worker'] / 1e6:.1f} MB")
    print(f"wrote {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
