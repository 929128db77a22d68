"""Overlapped rounds against synchronous LoRDO-Global at equal tokens: perplexity, two seeds.

With `rounds.overlap_delay` = τ a worker trains the first τ steps of round r+1 from its own θ
while round r's global state is on its way, and merges it after τ steps (docs/algorithm.md,
"Overlapping rounds"): the link hides behind computation, and the first τ steps of every round
see a model that misses the other workers' last round. This measures what that costs. Every run
is the reference trainer (the Worker and Aggregator code the Flower app runs; the merge is
tested bit-identical between them) on `examples/reference/quality_cpu.yaml`: small preset, byte
vocabulary, M = 4 workers, B = 16 x 64 tokens, K = 32, rank 16, 512 steps per worker (16 rounds,
2.1 M tokens), for τ in `TAUS` and two seeds (`seed`, `data.seed`).

Reported: final validation perplexity per τ and seed, its gap to τ = 0 of the same seed (the
goal: within 1%), the loss curves. Runs are cached under --work (one folder each).

    python benchmarks/overlap_quality.py --seeds 0 & python benchmarks/overlap_quality.py --seeds 1 &
    python benchmarks/overlap_quality.py             # collects what is cached, runs the rest
    python benchmarks/overlap_quality.py --quick     # tiny preset, a few steps (what the tests run)
Writes benchmarks/results/overlap_quality.json and .png.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

try:
    from benchmarks.common import make_parser, new_figure, png_path, result_header, write_json
    from benchmarks.quality import ROOT, Run, execute
except ImportError:  # run as `python benchmarks/overlap_quality.py`
    from common import make_parser, new_figure, png_path, result_header, write_json
    from quality import ROOT, Run, execute

TAUS = (0, 1, 2, 4, 16, 31)
"""Overlap delays: synchronous, 1, 2, 4 (1/8), 16 (1/2) and all but one of K = 32 steps."""
BASE = ("total_steps=512", "eval_every=2", "eval_batches=32", "inner.rank=16", "threads=1", "diagnostics=false")
QUICK_TAUS = (0, 2)
QUICK_BASE = ("model.preset=tiny", "total_steps=12", "rounds.local_steps=4", "data.seq_len=32", "data.batch_size=4",
              "eval_every=1", "eval_batches=2", "inner.warmup_steps=2", "inner.rank=8", "threads=1",
              "diagnostics=false")


def runs_for(taus: tuple[int, ...], seeds: list[int]) -> list[Run]:
    return [Run(f"tau{t}_s{s}", f"tau{t}", "lordo_global",
                (f"rounds.overlap_delay={t}", f"seed={s}", f"data.seed={s}")) for s in seeds for t in taus]


def summarize(results: dict[str, dict], taus: tuple[int, ...]) -> dict[str, dict]:
    """Per τ: final val perplexity per seed and its gap to τ = 0 of the same seed."""
    sync = {r["seed"]: r for r in results.values() if r["group"] == "tau0"}
    out = {}
    for t in taus:
        rs = sorted((r for r in results.values() if r["group"] == f"tau{t}"), key=lambda r: r["seed"])
        if not rs:
            continue
        gaps = [r["val_ppl"] / sync[r["seed"]]["val_ppl"] - 1 for r in rs if r["seed"] in sync]
        out[f"tau{t}"] = {"overlap_delay": t, "seeds": [r["seed"] for r in rs], "val_ppl": [r["val_ppl"] for r in rs],
                          "val_ppl_mean": statistics.fmean(r["val_ppl"] for r in rs), "gap_to_sync": gaps,
                          "gap_to_sync_mean": statistics.fmean(gaps) if gaps else None,
                          "tokens": rs[0]["curve"]["tokens"][-1]}
    return out


def plot(results: dict[str, dict], path: Path) -> None:
    fig = new_figure(7, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for group in sorted({r["group"] for r in results.values()}, key=lambda g: int(g[3:])):
        rs = [r for r in results.values() if r["group"] == group]
        tokens = rs[0]["curve"]["tokens"]
        mean = [statistics.fmean(r["curve"]["val_loss"][i] for r in rs) for i in range(len(tokens))]
        ax.plot(tokens, mean, label=f"τ = {group[3:]}" + (" (synchronous)" if group == "tau0" else ""))
    ax.set(xlabel="tokens", ylabel="validation loss (mean over seeds)",
           title="LoRDO-Global: overlapped rounds against synchronous")
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("overlap_quality", __doc__, "tiny preset, a few steps")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--work", default=str(ROOT / "outputs" / "bench_overlap_quality"),
                        help="run cache (a folder per run)")
    parser.add_argument("--fresh", action="store_true", help="rerun cached runs")
    args = parser.parse_args(argv)
    taus, base = (QUICK_TAUS, QUICK_BASE) if args.quick else (TAUS, BASE)
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    work = Path(args.work) / ("quick" if args.quick else "full")
    started = time.perf_counter()
    results = {}
    for run in runs_for(taus, seeds):
        results[run.label] = execute(run, False, work, args.fresh, base)
        print(f"{run.label}: val ppl {results[run.label]['val_ppl']:.3f}", flush=True)
    rows = summarize(results, taus)
    result = result_header("overlap_quality", args.quick, {"base": list(base), "taus": list(taus), "seeds": seeds})
    result.update({"rows": rows, "runs": results, "wall_seconds": time.perf_counter() - started})
    out = write_json(result, args.out)
    plot(results, png_path(out))
    print("| τ | val ppl (per seed) | mean | gap to τ = 0 (per seed) |\n|---|---|---|---|")
    for row in rows.values():
        gaps = ", ".join(f"{100 * g:+.2f}%" for g in row["gap_to_sync"])
        print(f"| {row['overlap_delay']} | {', '.join(f'{p:.3f}' for p in row['val_ppl'])} | "
              f"{row['val_ppl_mean']:.3f} | {gaps} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
