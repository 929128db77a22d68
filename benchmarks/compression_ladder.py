"""The compression ladder (issue 30): each SparseLoCo step added in turn to LoRDO-Global's top-k
payload, every rung against fp32 at the same seed, on the compression benchmark's quality setting
(`benchmarks/compression.py`: small preset, M = 4, rank 16, K = 8, 32 rounds, LoRDO's default
error feedback `inner.ef_decay=0.9`).

| rung | payload | what it adds |
|---|---|---|
| 1 grid | topk2bit, the fixed 2-bit grid | (measured at the fix's commit: results/compression_fix2bit_ef09.json) |
| 2 sign | topk2bit | 2-bit values as sign + two magnitudes per chunk (bin means) |
| 2 lut | topk2bit-lut | SparseLoCo's 4-entry table instead |
| 3 β | topk2bit, wire-ef-decay 0.95 | e ← 0.95·e + Δ on the worker |
| 4 mean | + sparse-mean contributors | each index averaged over the workers that sent it |
| 4 lr 0.7 | + outer lr 0.7 | the outer average damped |
| lowrank-mean | lowrank+topk2bit, β 0.95, contributor mean | low-rank Δ with the same wire |
| 5-6 both | topk2bit-both, β 0.95 | every tensor top-k 2-bit, θ down re-sparsified by the server |
| 7 lean | + DCT bases, no moments on the wire | nothing dense left (`compression.py --states lean`: the bytes) |
| wide | topk2bit-both-wide, β 0.95 | the downlink at 12% of each chunk: room for the union of the workers' supports |
| wide-mean | + contributor mean | |
| wide-nomoments, wide-dct, wide-lean | wide + no moments / DCT bases / both | which part of the lean state costs quality |
| wide-clientfit | wide-nomoments, the bases fitted by each worker to the downlink's change (`bases-from=downlink`) | SVD-quality bases with nothing on the wire |
| relay-clientfit | topk2bit-relay, β 0.95, no moments, bases from the downlink | the M replies down: θ exact on every worker |
| relay-1bit-lrs-clientfit | the same with topk1bit-relay and `wire-ef-lr-scale` | issue 30's recipe (results.md section 12, part twenty-five) |
| wide-d64, wide-tiles | wide at 1/64 up (4/64 down); wide with 64×64 tiles | density and the cut |
| lowrank-wide(-nomoments) | lowrank+topk2bit-wide, β 0.95 (no moments) | low-rank Δ with nothing dense but the coordinates and the bases |

    python benchmarks/compression_ladder.py                  # two seeds (~20 min on 2 cores, nothing beside it)
    python benchmarks/compression_ladder.py --rungs sign,beta --seeds 0
    python benchmarks/compression_ladder.py --method diloco --rounds 64 --local-steps 32   # the codec on its own (AdamW)
    python benchmarks/compression_ladder.py --method diloco --baseline fp32-average --rungs avg-wide --set diloco_outer.lr=1.3
    python benchmarks/compression_ladder.py --method lordo_local --rounds 64 --local-steps 32 --work outputs/ladder
                                                             # hours: run again with the same --work after a stop
    python benchmarks/compression_ladder.py --gains-only     # the decoders' gains on Gaussian and Student-t(3) values
    python benchmarks/compression_ladder.py --quick          # tiny runs (seconds): the structure
Each row keeps the wire's per-round metrics (`compression.WIRE_METRICS`: ‖e‖/‖Δ‖, the support shared
across workers, the share of a worker's indices re-selected). Writes benchmarks/results/compression_ladder.json and .png.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

try:
    from benchmarks.common import (host_of, machine_info, make_parser, new_figure, png_path, require_host,
                                   result_header, stop_children_on_sigterm, write_json)
    from benchmarks.compression import quality_run
except ImportError:  # run as `python benchmarks/compression_ladder.py`
    from common import (host_of, machine_info, make_parser, new_figure, png_path, require_host, result_header,
                        stop_children_on_sigterm, write_json)
    from compression import quality_run

BASE = ("inner.ef_decay=0.9",)
"""LoRDO's default error feedback, where the low-rank and top-k presets did best (results.md section 12)."""
LEAN = ("inner.proj_method=dct", "rounds.sync_exp_avg_every=0", "rounds.sync_exp_avg_sq_every=0")
"""Nothing dense on the wire: the bases as DCT column indices, no moments (each worker keeps its own)."""
RUNGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sign": ("topk2bit", ()),
    "lut": ("topk2bit-lut", ()),
    "beta": ("topk2bit", ("rounds.wire_ef_decay=0.95",)),
    "mean": ("topk2bit", ("rounds.wire_ef_decay=0.95", "rounds.sparse_mean=contributors")),
    "lr07": ("topk2bit", ("rounds.wire_ef_decay=0.95", "rounds.sparse_mean=contributors", "outer.lr=0.7")),
    "lowrank-mean": ("lowrank+topk2bit", ("rounds.wire_ef_decay=0.95", "rounds.sparse_mean=contributors")),
    "both": ("topk2bit-both", ("rounds.wire_ef_decay=0.95",)),
    "lean": ("topk2bit-both", ("rounds.wire_ef_decay=0.95", *LEAN)),
    "wide": ("topk2bit-both-wide", ("rounds.wire_ef_decay=0.95",)),
    "wide-mean": ("topk2bit-both-wide", ("rounds.wire_ef_decay=0.95", "rounds.sparse_mean=contributors")),
    "wide-nomoments": ("topk2bit-both-wide", ("rounds.wire_ef_decay=0.95", *LEAN[1:])),
    "wide-dct": ("topk2bit-both-wide", ("rounds.wire_ef_decay=0.95", LEAN[0])),
    "wide-lean": ("topk2bit-both-wide", ("rounds.wire_ef_decay=0.95", *LEAN)),
    "wide-clientfit": ("topk2bit-both-wide", ("rounds.wire_ef_decay=0.95", *LEAN[1:], "rounds.bases_from=downlink")),
    "relay-clientfit": ("topk2bit-relay", ("rounds.wire_ef_decay=0.95", *LEAN[1:], "rounds.bases_from=downlink")),
    "relay-1bit-lrs-clientfit": ("topk1bit-relay", ("rounds.wire_ef_decay=0.95", *LEAN[1:], "rounds.bases_from=downlink",
                                                    "rounds.wire_ef_lr_scale=true")),
    "wide-d64": ("topk2bit-both-wide-d64", ("rounds.wire_ef_decay=0.95",)),
    "wide-tiles": ("topk2bit-both-wide-tiles", ("rounds.wire_ef_decay=0.95",)),
    "lowrank-wide": ("lowrank+topk2bit-wide", ("rounds.wire_ef_decay=0.95",)),
    "lowrank-wide-nomoments": ("lowrank+topk2bit-wide", ("rounds.wire_ef_decay=0.95", *LEAN[1:])),
}
"""rung -> (payload preset, trainer overrides on top of `BASE`)."""
SPARSELOCO = ("rounds.wire_ef_decay=0.95", "rounds.sparse_mean=contributors", "diloco_outer.name=average",
              "diloco_outer.lr=1.0")
"""SparseLoCo's server (Sarfi et al. 2025): the decaying error feedback in place of outer momentum, the
contributor mean, plain averaging at lr 1."""
AVERAGE = ("rounds.wire_ef_decay=0.9", "rounds.sparse_mean=all", "diloco_outer.name=average", "diloco_outer.lr=1.0")
"""SparseLoCo's wire and outer step with the plain token-weighted mean over all workers in place of the
contributor mean (an index one of M workers sent counts 1/M, as in fp32 averaging), β = 0.9."""
DILOCO_RUNGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sparseloco": ("topk2bit-both", SPARSELOCO),
    "sparseloco-up": ("topk2bit", SPARSELOCO),
    "sparseloco-nesterov": ("topk2bit-both", SPARSELOCO[:2]),
    "sparseloco-all": ("topk2bit-all", SPARSELOCO),
    "sparseloco-wide": ("topk2bit-both-wide", SPARSELOCO),
    "fp32-average": ("fp32", SPARSELOCO[2:]),
    "sparseloco-clip": ("topk2bit-both-wide", (*SPARSELOCO, "rounds.clip_median=true")),
    "avg-wide": ("topk2bit-both-wide", AVERAGE),
    "avg-wide-lr13": ("topk2bit-both-wide", (*AVERAGE, "diloco_outer.lr=1.3")),
    "avg-wide-d64": ("topk2bit-both-wide-d64", AVERAGE),
    "avg-up": ("topk2bit-all", AVERAGE),
    "avg-relay": ("topk2bit-relay", AVERAGE),
    "avg-relay-1bit": ("topk1bit-relay", AVERAGE),
    "avg-relay-1bit-lrs": ("topk1bit-relay", (*AVERAGE, "rounds.wire_ef_lr_scale=true")),
    "avg-sign": ("topk2bit", AVERAGE),
    "avg-lut": ("topk2bit-lut", AVERAGE),
}
"""`--method diloco`, the codec on its own (AdamW inner, against fp32 DiLoCo with its Nesterov outer step):
SparseLoCo's recipe with our sparse downlink (every tensor top-k 2-bit both ways); with the uplink only
top-k (embedding and norms int8, θ down int8: the aggregate arrives almost whole); with DiLoCo's
Nesterov outer step kept; every tensor top-k up and θ down int8; every tensor top-k up and θ down
top-k at 4x the density (room for the union of the 4 workers' supports); fp32 with SparseLoCo's outer
step (plain averaging at lr 1) in place of DiLoCo's Nesterov; SparseLoCo's with median clipping (its
production server); `AVERAGE` (the mean over all workers, β 0.9) with the wide downlink (also at outer lr 1.3), at 1/64,
and with θ down int8, and relayed (`avg-relay`: every worker replays the round, θ exact; `avg-relay-1bit` with 1-bit values,
`avg-relay-1bit-lrs` also with the residual scaled by the lr's fall, `rounds.wire_ef_lr_scale`); the 2-bit values as sign x chunk scale against SparseLoCo's bin-mean table (`lut`), the
blocks' matrices top-k (the embedding and norms int8, θ down int8)."""
LOCAL_RUNGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "wide": ("topk2bit-both-wide", ("rounds.wire_ef_decay=0.95",)),
    "wide-d64": ("topk2bit-both-wide-d64", ("rounds.wire_ef_decay=0.95",)),
    "relay": ("topk2bit-relay", ("rounds.wire_ef_decay=0.95",)),
    "relay-1bit-lrs": ("topk1bit-relay", ("rounds.wire_ef_decay=0.95", "rounds.wire_ef_lr_scale=true")),
}
"""`--method lordo_local`: LoRDO with each worker's own bases and moments is lean by construction (no
bases, no moments on the wire): the wide downlink at 3% and 1/64 up, and the relay (the M replies down,
θ exact), and the relay with issue 30's recipe (1-bit values, the residual scaled by the lr's fall)."""


def decoder_gains(seeds: int = 10) -> list[dict]:
    """Gain ⟨x̂, x⟩/⟨x, x⟩ and relative error ‖x̂ − x‖/‖x‖ of each top-k value codec on the kept
    values of 16 chunks of 4096 (3%), Gaussian and Student-t(3), over `seeds` draws: min and max."""
    import torch

    from lordo_fed.wire.compress import CodecSpec, decode, encode

    specs = {"fp32": CodecSpec("topk", chunk=4096, density=0.03),
             "int8": CodecSpec("topk", bits=8, chunk=4096, density=0.03),
             "int4": CodecSpec("topk", bits=4, chunk=4096, density=0.03),
             "2-bit sign": CodecSpec("topk", bits=2, chunk=4096, density=0.03, levels="sign"),
             "2-bit lut": CodecSpec("topk", bits=2, chunk=4096, density=0.03, levels="lut")}
    rows = []
    for kind in ("gauss", "t3"):
        for name, spec in specs.items():
            gains, errors = [], []
            for seed in range(seeds):
                g = torch.Generator().manual_seed(seed)
                z = torch.randn(4, 16 * 4096, generator=g)
                x = z[0] if kind == "gauss" else z[0] / (z[1:].square().sum(0) / 3).sqrt()
                kept = decode(encode(x, CodecSpec("topk", chunk=4096, density=0.03))) != 0
                y = decode(encode(x, spec))
                gains.append(float((x[kept] * y[kept]).sum() / x[kept].square().sum()))
                errors.append(float((y[kept] - x[kept]).norm() / x[kept].norm()))
            rows.append({"values": kind, "codec": name, "gain_min": min(gains), "gain_max": max(gains),
                         "rel_error_min": min(errors), "rel_error_max": max(errors)})
    return rows


def main() -> None:
    parser = make_parser("compression_ladder", __doc__, "tiny runs of every rung, one seed (seconds)")
    parser.add_argument("--method", default="lordo_global", choices=("lordo_global", "diloco", "lordo_local"),
                        help="lordo_global: the ladder (`RUNGS`); diloco: the codec on its own (`DILOCO_RUNGS`); "
                        "lordo_local: `LOCAL_RUNGS`")
    parser.add_argument("--rungs", default="", help=f"comma-separated (default: all of the method's), of "
                        f"{', '.join(RUNGS)} or {', '.join(DILOCO_RUNGS)}")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--rounds", type=int, default=32, help="rounds of each run")
    parser.add_argument("--local-steps", type=int, default=8, help="K, the local steps of a round")
    parser.add_argument("--workers", type=int, default=4, help="M, the workers (each its own batch of 16)")
    parser.add_argument("--gains-only", action="store_true", help="only the decoders' gains (seconds)")
    parser.add_argument("--set", default="", help="comma-separated trainer overrides added to every rung (not to "
                        "fp32), e.g. 'diloco_outer.lr=1.3,rounds.wire_ef_decay=0.8'")
    parser.add_argument("--baseline", default="", help="a rung of the method (e.g. fp32-average) that every other rung "
                        "is compared against in place of fp32 with the method's own outer step, which then is not run")
    parser.add_argument("--work", default=None, help="folder of the runs, kept: a ladder stopped part way continues "
                        "from its finished runs when given the same folder (default: a temporary one)")
    parser.add_argument("--reference", default="", help="an earlier result of the same method, horizon and M: its "
                        "fp32 rows (with --baseline, its rows of that rung) stand in for this run's (the runs are "
                        "deterministic), no rerun")
    args = parser.parse_args()
    stop_children_on_sigterm()  # a killed run stops its trainer too
    table, base = {"lordo_global": (RUNGS, BASE), "diloco": (DILOCO_RUNGS, ()),
                   "lordo_local": (LOCAL_RUNGS, BASE)}[args.method]
    rungs = args.rungs.split(",") if args.rungs else list(table)
    unknown = [r for r in rungs if r not in table]
    if unknown:
        parser.error(f"--rungs: unknown {unknown} for --method {args.method}; expected some of {list(table)}")
    if args.baseline and args.baseline not in table:
        parser.error(f"--baseline {args.baseline!r}: expected a rung of --method {args.method}: {list(table)}")
    if args.baseline:
        rungs = [args.baseline, *(r for r in rungs if r != args.baseline)]
    if min(args.rounds, args.local_steps, args.workers) < 1:
        parser.error(f"--rounds {args.rounds} --local-steps {args.local_steps} --workers {args.workers}: expected each >= 1")
    base = (*base, f"workers={args.workers}") if args.workers != 4 else base
    added = tuple(o for o in args.set.split(",") if o)
    horizon = (args.rounds, args.local_steps)
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    started = time.perf_counter()
    result = result_header("compression_ladder", args.quick, {"method": args.method, "rungs": rungs, "seeds": seeds,
                                                              "base": list(base), "rounds": args.rounds,
                                                              "local_steps": args.local_steps, "workers": args.workers,
                                                              "set": list(added), "baseline": args.baseline or "fp32"})
    result["decoder_gains"] = decoder_gains(2 if args.quick else 10)
    for g in result["decoder_gains"]:
        print(f"{g['values']:5} {g['codec']:10} gain {g['gain_min']:.3f}-{g['gain_max']:.3f}, "
              f"relative error {g['rel_error_min']:.3f}-{g['rel_error_max']:.3f}", flush=True)
    if args.gains_only:
        write_json({**result, "seconds": time.perf_counter() - started}, args.out)
        return
    rows = []
    earlier = _references(args.reference, result["config"], args.baseline or "fp32") if args.reference else {}
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            ref = None
            if not args.baseline:
                ref = earlier.get(seed) or quality_run("fp32", 1, seed, args.quick, Path(tmp), base, method=args.method,
                                                       horizon=horizon)
                rows.append({"rung": "fp32", **ref})
            for rung in rungs:
                payload, extra = table[rung]
                # the baseline is run as it is defined, without --set
                overrides = (*base, *extra, *(() if rung == args.baseline else added))
                if rung == args.baseline and seed in earlier:
                    row = earlier[seed]
                    if row["payload"] != payload or row["overrides"] != list(overrides):
                        raise SystemExit(f"--reference {args.reference}: its {rung} row of seed {seed} ran "
                                         f"{row['payload']} with {row['overrides']}, expected {payload} with "
                                         f"{list(overrides)}")
                    row = {**row, "cached": True}
                else:
                    row = quality_run(payload, 1, seed, args.quick, Path(tmp), overrides, tag=f"_{rung}",
                                      method=args.method, horizon=horizon)
                ref = ref or row
                row.update(rung=rung, ppl_vs_fp32=row["val_ppl"] / ref["val_ppl"] - 1.0,
                           bytes_vs_fp32=ref["bytes_per_worker"] / row["bytes_per_worker"])
                rows.append(row)
                last = row["round_metrics"][-1] if row["round_metrics"] else {}
                print(f"seed {seed} {rung:13} {payload:17} val ppl {row['val_ppl']:.3f} ({row['ppl_vs_fp32']:+.2%} vs "
                      f"{args.baseline or 'fp32'} {ref['val_ppl']:.3f}), {row['bytes_vs_fp32']:.2f}x fewer bytes; last round "
                      + ", ".join(f"{k} {v:.3f}" for k, v in last.items() if k != "round"), flush=True)
                write_json({**result, "rows": rows, "seconds": time.perf_counter() - started}, args.out)
    result.update(rows=rows, seconds=time.perf_counter() - started)
    out = write_json(result, args.out)
    plot(rows, png_path(out))
    print(f"wrote {out} and {png_path(out)}")


def _references(path: str, config: dict, rung: str = "fp32") -> dict[int, dict]:
    """seed -> the `rung` row of an earlier result whose method, base overrides, horizon and M are `config`'s,
    measured on this host (`require_host`) with this process's torch thread count."""
    import json

    earlier = json.loads(Path(path).read_text())
    keys = ("method", "base", "rounds", "local_steps", "workers")
    mismatch = [k for k in keys if earlier["config"].get(k, {"workers": 4, "method": "lordo_global"}.get(k)) != config[k]]
    if mismatch:
        raise SystemExit(f"--reference {path}: its {', '.join(mismatch)} differ from this run's")
    try:  # another kernel set rounds otherwise, and a top-k run drifts by the seeds' spread
        require_host(host_of(earlier.get("machine", {})), host_of(machine_info()), f"--reference {path}",
                     "run the baseline here")
    except ValueError as err:
        raise SystemExit(str(err)) from None
    # the trainer runs with this process's thread count (quality_run sets none), and LAPACK's SVD and QR round
    # differently on another one: LoRDO's bases, so its runs (docs/results.md section 12, part twenty-seven)
    theirs, mine = earlier.get("machine", {}).get("torch_threads"), machine_info()["torch_threads"]
    if theirs != mine:
        raise SystemExit(f"--reference {path}: its runs had {theirs} torch threads, this one has {mine}, and "
                         f"another thread count rounds SVD and QR differently: run with OMP_NUM_THREADS={theirs}, "
                         "or run the baseline here")
    return {r["seed"]: r for r in earlier["rows"] if r["rung"] == rung}


def plot(rows: list[dict], path: Path) -> None:
    """Validation loss against tokens, and the wire's per-round metrics (‖e‖/‖Δ‖; the support shared
    across workers and re-selected by a worker), every rung of the first seed."""
    fig = new_figure(15, 4.5)
    ax, ax_e, ax_s = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    for row in rows:
        if row["seed"] != rows[0]["seed"]:
            continue
        line = ax.plot([c["tokens"] for c in row["curve"]], [c["val_loss"] for c in row["curve"]], label=row["rung"])[0]
        wire = row.get("round_metrics", [])
        if wire:
            ax_e.plot([m["round"] for m in wire], [m["wire_ef_ratio"] for m in wire], color=line.get_color(),
                      label=row["rung"])
        for key, style in (("sparse_support_shared", "-"), ("sparse_reselected", ":")):
            pts = [(m["round"], m[key]) for m in wire if key in m]
            if pts:
                ax_s.plot(*zip(*pts), ls=style, color=line.get_color())
    ax.set(xlabel="tokens per worker", ylabel="validation loss",
           title=f"{rows[0].get('method', 'lordo_global')}, compression ladder (seed {rows[0]['seed']})")
    ax_e.set(xlabel="round", ylabel="‖e‖ / ‖Δ‖ after the send", yscale="log", title="the wire's residual")
    ax_s.set(xlabel="round", ylabel="share of the sent indices",
             title="sent by more than one worker (—), re-selected by the worker (···)")
    ax.legend(fontsize=8)
    if ax_e.lines:
        ax_e.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
