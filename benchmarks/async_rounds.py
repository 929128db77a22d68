"""Asynchronous rounds under heterogeneity on the virtual clock (issue 13, first comparison):
synchronous DiLoCo, async DiLoCo, async momentum look-ahead and HeLoCo, same tokens.

Runs the reference trainer with `examples/reference/async_cpu.yaml` (small preset, 4 workers of
which one is 4x slower, K = 16, arrivals weighted by ρ = 1/√4; every method trains on the same
tokens) and reads its per-method records: validation loss against tokens and against virtual
time (a synchronous round waits for the slowest worker: K · 4 virtual seconds; an asynchronous
method runs until it has made the same number of pushes), staleness of the pushes, pushes per
worker. The schedule is deterministic (lordo_fed.async_rounds.VirtualClock), so the figures do
not depend on this machine's speed.

    python benchmarks/async_rounds.py            # small preset, 128 steps per worker (~4 min on 2 cores)
    python benchmarks/async_rounds.py --quick    # tiny preset, a few pushes (seconds)
Writes benchmarks/results/async_rounds.json and async_rounds.png.
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
METHODS = ("diloco", "async_diloco", "async_lookahead", "heloco")
QUICK = ["model.preset=tiny", "total_steps=8", "rounds.local_steps=2", "data.seq_len=32", "data.batch_size=4",
         "eval_batches=2", "inner.warmup_steps=2"]


def run(quick: bool, out_dir: Path) -> dict[str, list[dict]]:
    """Run the trainer once for all METHODS; each method's records."""
    cmd = [sys.executable, "-m", "lordo_fed.trainer.cli", "--config-dir", str(ROOT / "examples" / "reference"),
           "--config-name", "async_cpu", f"out_dir={out_dir}", "progress=false",
           f"methods=[{','.join(METHODS)}]", *(QUICK if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"lordo-train failed:\n{proc.stderr[-3000:]}")
    return {m: [json.loads(line) for line in (out_dir / f"{m}.jsonl").read_text().splitlines()] for m in METHODS}


def summarise(records: dict[str, list[dict]]) -> dict[str, dict]:
    """Per method: its final loss, and every method's loss at the virtual time the first
    asynchronous method finished (the last evaluation at or before it)."""
    curves = {m: [(r["virtual_time"], r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
              for m, rows in records.items()}
    t_async = min(c[-1][0] for m, c in curves.items() if m != "diloco")
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
            "curve": [{"virtual_time": t, "tokens": k, "val_loss": v} for t, k, v in curves[m]],
        }
    return {"async_end_virtual_time": t_async, "methods": out}


def plot(result: dict, path: Path) -> None:
    fig = new_figure(12, 4.5)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for m, s in result["summary"]["methods"].items():
        xs_tokens = [p["tokens"] / 1e6 for p in s["curve"]]
        xs_time = [p["virtual_time"] for p in s["curve"]]
        ys = [min(p["val_loss"], 8.0) for p in s["curve"]]  # a diverged run is clipped, not dropped
        ax1.plot(xs_tokens, ys, marker=".", label=m)
        ax2.plot(xs_time, ys, marker=".", label=m)
    ax1.set(xlabel="tokens (M)", ylabel="validation loss (clipped at 8)", title="same tokens")
    ax2.set(xlabel="virtual seconds (one worker 4x slower)", title="same clock")
    ax2.axvline(result["summary"]["async_end_virtual_time"], color="grey", lw=0.8, ls="--")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    args = make_parser("async_rounds", __doc__, "tiny preset, a few pushes (seconds)").parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        records = run(args.quick, Path(tmp) / "out")
    cfg = {"config": "examples/reference/async_cpu.yaml", "methods": list(METHODS),
           "overrides": QUICK if args.quick else []}
    result = {**result_header("async_rounds", args.quick, cfg), "seconds": time.perf_counter() - started,
              "summary": summarise(records)}
    out = write_json(result, args.out)
    plot(result, png_path(out))
    for m, s in result["summary"]["methods"].items():
        print(f"{m:16s} final val loss {s['final_val_loss']:8.3f} at t={s['final_virtual_time']:6.0f}; "
              f"at t={result['summary']['async_end_virtual_time']:.0f}: {s['val_loss_at_async_end']:.3f}; "
              f"staleness {s['staleness']}, pushes by worker {s['pushes_by_worker']}")
    print(f"wrote {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
