"""Parity over a long horizon: LoRDO against low-rank DDP over 64 rounds, two seeds.

The measurement that decides the defaults (LoRDO-quality issue, section 5). Every run is the
reference trainer on `examples/reference/quality_cpu.yaml` (small preset, byte vocabulary, M = 4
workers, B = 16 x 64 tokens, K = 32, rank 16) for 2,048 steps per worker (64 rounds, 8.4 M
tokens), evaluated every 4 rounds on 64 validation batches, for two seeds (`seed` and
`data.seed`: model init, data order, projections). Variants (`VARIANTS`): DDP, low-rank DDP,
LoRDO-Global and LoRDO-Local with the paper's settings, and with the inner-optimizer options of
docs/algorithm.md ("Error feedback inside a round", "Two phases"); `--k-sweep` adds K = 8 and
K = 128 for the named variants.

Reported: the perplexity gap to low-rank DDP of the same seed at every evaluation (mean over the
seeds, and their spread), the final table, the loss curves. Runs are cached under --work (one
folder each), so the grid can run in pieces, in the background, several processes at once:

    python benchmarks/long_horizon.py --seeds 0 &  python benchmarks/long_horizon.py --seeds 1 &
    python benchmarks/long_horizon.py --variants global_ef_reset,local --k-sweep global_ef_reset
    python benchmarks/long_horizon.py            # collects whatever is cached, runs the rest
    python benchmarks/long_horizon.py --collect --k-sweep global_ef_decay   # only what is cached
    python benchmarks/long_horizon.py --quick    # tiny preset, a few steps (what the tests run)
Writes benchmarks/results/long_horizon.json and long_horizon.png.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

try:
    from benchmarks.common import make_parser, new_figure, png_path, result_header, write_json
    from benchmarks.quality import QUICK_OVERRIDES, ROOT, Run, compose, execute
except ImportError:  # run as `python benchmarks/long_horizon.py`
    from common import make_parser, new_figure, png_path, result_header, write_json
    from quality import QUICK_OVERRIDES, ROOT, Run, compose, execute

LONG = ("total_steps=2048", "eval_every=4", "eval_batches=64", "inner.rank=16", "threads=1")
"""On top of quality_cpu.yaml: 64 rounds of K = 32, a larger validation sample, one thread a run."""
LONG_QUICK = tuple(o for o in LONG if not o.startswith("inner.rank=")) + ("inner.rank=8",)
"""--quick: the tiny preset's matrices are too small for rank 16."""
SEEDS = (0, 1)
REFERENCE = "lowrank_ddp"
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ddp": ("ddp", ()),
    "lowrank_ddp": ("lowrank_ddp", ()),
    "global": ("lordo_global", ()),
    "local": ("lordo_local", ()),
    "global_fr_grad": ("lordo_global", ("inner.full_rank_term=gradient",)),
    "global_ef_reset": ("lordo_global", ("inner.ef_reset=true",)),
    "global_ef_decay": ("lordo_global", ("inner.ef_decay=0.9",)),
    "global_ef_sync": ("lordo_global", ("rounds.sync_ef=true",)),
    "local_ef_reset": ("lordo_local", ("inner.ef_reset=true",)),
    "global_two_phase": ("lordo_global", ("inner.switch_step=512",)),
}
"""Variant name -> (method, Hydra overrides). The paper's settings are `global` and `local`."""
K_SWEEP = (8, 128)


def runs_for(variants: list[str], seeds: list[int], k_sweep: list[str]) -> list[Run]:
    runs = [Run(f"{v}_s{s}", v, *VARIANTS[v][:1], (*VARIANTS[v][1], f"seed={s}", f"data.seed={s}"))
            for s in seeds for v in variants]
    runs += [Run(f"{v}_K{k}_s{s}", f"{v}_K{k}", VARIANTS[v][0],
                 (*VARIANTS[v][1], f"rounds.local_steps={k}", f"seed={s}", f"data.seed={s}"))
             for s in seeds for v in k_sweep for k in K_SWEEP]
    return runs


def gap_curves(results: dict[str, dict]) -> dict[str, dict]:
    """Per group (variant, or variant at another K): the perplexity gap to low-rank DDP of the same
    seed at every evaluation both runs have (same tokens), per seed and its mean, min and max."""
    import math

    out: dict[str, dict] = {}
    for group in sorted({r["group"] for r in results.values()}):
        per_seed = {}
        for r in (r for r in results.values() if r["group"] == group):
            ref = next((x for x in results.values() if x["group"] == REFERENCE and x["seed"] == r["seed"]), None)
            if ref is None:
                continue
            ref_loss = dict(zip(ref["curve"]["tokens"], ref["curve"]["val_loss"]))
            pts = [(t, math.exp(loss - ref_loss[t]) - 1) for t, loss in zip(r["curve"]["tokens"], r["curve"]["val_loss"])
                   if t in ref_loss and t > 0]
            per_seed[r["seed"]] = pts
        if not per_seed:
            continue
        common = sorted(set.intersection(*(set(t for t, _ in pts) for pts in per_seed.values())))
        table = {s: dict(pts) for s, pts in per_seed.items()}
        out[group] = {
            "tokens": common,
            "gap_mean": [statistics.fmean(table[s][t] for s in table) for t in common],
            "gap_min": [min(table[s][t] for s in table) for t in common],
            "gap_max": [max(table[s][t] for s in table) for t in common],
            "per_seed": {str(s): [table[s][t] for t in common] for s in table},
        }
    return out


def summary(results: dict[str, dict], gaps: dict[str, dict]) -> dict[str, dict]:
    """Per group: final perplexity (mean, per seed), final gap (mean, spread), bytes per step."""
    out = {}
    for group in sorted({r["group"] for r in results.values()}, key=lambda g: (g not in VARIANTS, g)):
        rs = sorted((r for r in results.values() if r["group"] == group), key=lambda r: r["seed"])
        g = gaps.get(group)
        out[group] = {
            "method": rs[0]["method"], "K": rs[0]["K"], "seeds": [r["seed"] for r in rs],
            "val_ppl": [r["val_ppl"] for r in rs], "val_ppl_mean": statistics.fmean(r["val_ppl"] for r in rs),
            "bytes_sent_per_worker_per_step": rs[0]["bytes_sent_per_worker_per_step"],
            **({"final_gap_mean": g["gap_mean"][-1], "final_gap_min": g["gap_min"][-1],
                "final_gap_max": g["gap_max"][-1]} if g and g["tokens"] else {}),
        }
    return out


def table(rows: dict[str, dict]) -> str:
    lines = ["| variant | method | K | val ppl (per seed) | mean | gap to low-rank DDP (mean, [min, max]) | "
             "bytes sent / worker / step |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        gap = (f"{100 * r['final_gap_mean']:+.2f}% [{100 * r['final_gap_min']:+.2f}, {100 * r['final_gap_max']:+.2f}]"
               if "final_gap_mean" in r else "-")
        ppl = ", ".join(f"{p:.3f}" for p in r["val_ppl"])
        lines.append(f"| {name} | {r['method']} | {r['K']} | {ppl} | {r['val_ppl_mean']:.3f} | {gap} | "
                     f"{r['bytes_sent_per_worker_per_step']:,.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], gaps: dict[str, dict], path: Path) -> None:
    fig = new_figure(14, 5.5)
    ax_gap, ax_loss = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for group, g in gaps.items():
        if group == REFERENCE or not g["tokens"]:
            continue
        line, = ax_gap.plot(g["tokens"], [100 * x for x in g["gap_mean"]], label=group)
        ax_gap.fill_between(g["tokens"], [100 * x for x in g["gap_min"]], [100 * x for x in g["gap_max"]],
                            color=line.get_color(), alpha=0.15)
    ax_gap.axhline(0, color="k", lw=0.8)
    ax_gap.axhline(1, color="k", lw=0.8, ls=":", label="1% (the paper's claim)")
    ax_gap.set(xlabel="tokens", ylabel="perplexity gap to low-rank DDP, % (mean; band: seeds)",
               title="Gap to low-rank DDP against training")
    lowest = min((100 * x for g in gaps.values() for x in g["gap_min"]), default=0.0)
    ax_gap.set_ylim(min(-10.0, lowest - 2), 40)
    ax_gap.legend(fontsize=7, ncol=2)
    for group in sorted({r["group"] for r in results.values()}):
        r = min((r for r in results.values() if r["group"] == group), key=lambda r: r["seed"])
        ax_loss.plot(r["curve"]["tokens"][1:], r["curve"]["val_loss"][1:], label=f"{group} (seed {r['seed']})")
    ax_loss.set(xlabel="tokens", ylabel="validation loss", title="Validation loss (first seed)")
    ax_loss.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = make_parser("long_horizon", __doc__, "tiny preset, a few steps, two seeds (~1 min)")
    parser.add_argument("--work", default=None,
                        help="folder of the per-run outputs (default: outputs/long_horizon, or a temporary one with --quick)")
    parser.add_argument("--variants", default="", help=f"comma-separated variants (default: all of {list(VARIANTS)})")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds (default: %(default)s)")
    parser.add_argument("--k-sweep", default="", help=f"variants also run at K in {K_SWEEP}")
    parser.add_argument("--fresh", action="store_true", help="rerun runs that already have a result in --work")
    parser.add_argument("--collect", action="store_true",
                        help="train nothing: report the runs of the grid that already have a result in --work")
    args = parser.parse_args()
    import logging
    import tempfile

    logging.basicConfig(level=logging.WARNING)
    quick_variants = ["lowrank_ddp", "global", "local"]
    variants = args.variants.split(",") if args.variants else (quick_variants if args.quick else list(VARIANTS))
    k_sweep = [v for v in args.k_sweep.split(",") if v]
    unknown = set(variants + k_sweep) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; expected any of {list(VARIANTS)}")
    if REFERENCE not in variants:
        variants.insert(0, REFERENCE)  # every gap is measured against it
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = runs_for(variants, seeds, k_sweep)
    work = Path(args.work) if args.work else (Path(tempfile.mkdtemp(prefix="long-")) if args.quick
                                              else ROOT / "outputs" / "long_horizon")
    base = LONG_QUICK if args.quick else LONG
    started = time.perf_counter()
    results: dict[str, dict] = {}
    if args.collect:
        runs = [r for r in runs if (work / r.label / "result.json").exists()]
        if not runs:
            parser.error(f"--collect: no run of this grid has a result under {work}")
    for i, run in enumerate(runs, 1):
        results[run.label] = execute(run, args.quick, work, args.fresh, base)
        r = results[run.label]
        print(f"[{i}/{len(runs)}] {run.label}: val ppl {r['val_ppl']:.3f} ({r['wall_seconds']:.0f} s)", flush=True)
    gaps = gap_curves(results)
    rows = summary(results, gaps)
    config = compose(runs[0], args.quick, work / "_", base)
    header = result_header("long_horizon", args.quick, {
        "base": "examples/reference/quality_cpu.yaml + " + " ".join(base)
                + (" + " + " ".join(QUICK_OVERRIDES) if args.quick else ""),
        "preset": config.model.preset, "workers": config.workers, "batch_size": config.data.batch_size,
        "seq_len": config.data.seq_len, "total_steps": config.total_steps, "K": config.rounds.local_steps,
        "rank": config.inner.rank, "lr": config.inner.lr, "omega": config.inner.omega, "seeds": seeds,
        "tokens_per_run": config.workers * config.data.batch_size * config.data.seq_len * config.total_steps,
        "variants": {v: {"method": VARIANTS[v][0], "overrides": list(VARIANTS[v][1])} for v in variants + k_sweep},
    })
    out = write_json({**header, "seconds": time.perf_counter() - started, "summary": rows, "gaps": gaps,
                      "runs": results}, args.out)
    plot(results, gaps, png_path(out))
    print(table(rows))
    print(f"wrote {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
