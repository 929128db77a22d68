"""Quality, paper style: the 16M ablation shape at a size a 2-core CPU finishes.

Every run is the reference trainer (`lordo_fed.trainer`: the same Worker and Aggregator code the
Flower app runs) on `examples/reference/quality_cpu.yaml`: M = 4 workers, global batch 64 = M x B,
K = 32, the same tokens for every method. The grid (`GRID`):

- methods at rank r in {8, 16, 32, 64}: low-rank DDP, LoRDO-Global, LoRDO-Local and LoRDO-Global
  with ω = 1 (no quasi-hyperbolic term: the paper's stagnation pathology); full-rank DDP, DiLoCo
  and Local Adam once (they have no rank);
- the stable rank of the averaged pseudo-gradient Δ̄ per round, and the share of ||Δ̄||² inside
  the round's shared subspace, for Global with and without the QH term (`diagnostics=true`);
- K in {8, 16, 32, 64, 128} and M x B in {2 x 32, 4 x 16, 8 x 8} (global batch 64) for Global and
  Local at rank 16;
- the projection refresh method (svd, rsvd, dct) for Global at rank 16 (see step_cost.py).
- how often Global averages the moments of parameters that are not low-rank (embedding, norms):
  every F rounds for F in {1, 2, 4} and never (`rounds.dense_sync_factor`; F = 1 is the paper).

Reported: validation perplexity, the gap to low-rank DDP at the same rank (the paper: under 1%),
loss-against-tokens curves. Runs are cached under --work (one folder per run, the trainer's own
JSONL and summary), so an interrupted benchmark continues where it stopped; --fresh reruns.

    python benchmarks/quality.py            # the grid above (~45 min on 2 idle cores)
    python benchmarks/quality.py --quick    # tiny preset, a few steps, one run of each kind
    python benchmarks/quality.py --only rank16_lordo_global,rank16_lowrank_ddp
Writes benchmarks/results/quality.json and quality.png.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lordo_fed.device import pick_device
from lordo_fed.optim.config import resolved_proj_method
from lordo_fed.checkpoint import list_checkpoints
from lordo_fed.rounds.methods import METHODS, resolve_method

try:
    from benchmarks.common import (code_info, host_of, machine_info, make_parser, new_figure, png_path, require_host,
                                   result_header, write_json)
except ImportError:  # run as `python benchmarks/quality.py`
    from common import (code_info, host_of, machine_info, make_parser, new_figure, png_path, require_host,
                        result_header, write_json)

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "examples" / "reference"

RANK_GRID = (8, 16, 32, 64)
LOWRANK_METHODS = ("lowrank_ddp", "lordo_global", "lordo_local", "lordo_global_omega1")
FULL_METHODS = ("ddp", "diloco", "local_adam")
K_SWEEP = (8, 128, 16, 64)  # K = 32 is the rank-16 run; 16 and 64 run last
MB_SWEEP = ((2, 32), (8, 8))  # (M, B) with M x B = 64; 4 x 16 is the rank-16 run
PROJ_METHODS = ("rsvd", "dct")  # svd is the rank-16 run
DENSE_SYNC_FACTORS = (2, 4, 0)  # F = 1 is the rank-16 run; 0 = the dense moments never leave a worker
EF_OPTIONS = {
    "fr_grad": ("inner.full_rank_term=gradient",),
    "ef_reset": ("inner.ef_reset=true",),
    "ef_decay0.9": ("inner.ef_decay=0.9",),
    "ef_sync": ("rounds.sync_ef=true",),
    "no_ef": ("inner.error_feedback=false",),
    "two_phase": ("inner.switch_step=64",),
    "ef_bf16": ("inner.ef_decay=0.9", "inner.ef_dtype=bf16"),
    "ef_topk32": ("inner.ef_decay=0.9", "inner.ef_density=0.03125"),
    "ef_topk8": ("inner.ef_decay=0.9", "inner.ef_density=0.125"),
    "ef_topk4": ("inner.ef_decay=0.9", "inner.ef_density=0.25"),
}
"""Options of the inner step (docs/algorithm.md, "Error feedback inside a round", "Two phases"), run
for LoRDO-Global and LoRDO-Local at rank 16; the paper's settings are the rank-16 runs. ef_bf16 and
ef_topkN are the memory options (E in bf16; E compressed to its top 1/N entries, int8), against
ef_decay0.9, the default they modify."""
BEST_EF = "ef_decay0.9"
"""The option the projection methods are re-measured with (chosen from the "error feedback" runs)."""
DIAGNOSTICS = ("delta_stable_rank", "delta_in_subspace", "update_out_in_ratio", "update_out_in_ratio_last",
               "ef_norm", "delta_retention")
"""Per-round diagnostics kept in a run's result (those the trainer logged with `diagnostics=true`)."""


@dataclass(frozen=True)
class Run:
    """One trainer invocation: a method plus Hydra overrides of quality_cpu.yaml."""

    label: str
    group: str
    method: str
    overrides: tuple[str, ...] = ()


def grid(quick: bool) -> list[Run]:
    """The runs, most important first (rank 16, then the other ranks, then the sweeps)."""
    ranks = (8,) if quick else (16, *(r for r in RANK_GRID if r != 16))
    runs: list[Run] = []
    for r in ranks:
        if r == ranks[0]:
            runs += [Run(m, "baseline", m) for m in FULL_METHODS]
        for m in LOWRANK_METHODS:
            method, extra = (("lordo_global", ("inner.omega=1.0",)) if m == "lordo_global_omega1" else (m, ()))
            runs.append(Run(f"rank{r}_{m}", "rank", method, (f"inner.rank={r}", *extra)))
    base = ranks[0]
    k_runs = [Run(f"K{k}_{m}", "K", m, (f"inner.rank={base}", f"rounds.local_steps={k}"))
              for k in ((2,) if quick else K_SWEEP) for m in ("lordo_global", "lordo_local")]
    runs += k_runs[:4]
    for workers, batch in (((2, 8),) if quick else MB_SWEEP):
        for m in ("lordo_global", "lordo_local"):
            runs.append(Run(f"M{workers}xB{batch}_{m}", "MxB", m,
                            (f"inner.rank={base}", f"workers={workers}", f"data.batch_size={batch}")))
    for pm in (("dct",) if quick else PROJ_METHODS):
        runs.append(Run(f"proj_{pm}_lordo_global", "projection", "lordo_global",
                        (f"inner.rank={base}", f"inner.proj_method={pm}")))
    for name, extra in (list(EF_OPTIONS.items())[:1] if quick else EF_OPTIONS.items()):
        for m in (("lordo_global",) if quick else ("lordo_global", "lordo_local")):
            if m == "lordo_local" and name == "ef_sync":
                continue  # Local's bases differ across workers: its E is not averaged
            runs.append(Run(f"{name}_{m}", "error feedback", m, (f"inner.rank={base}", *extra)))
    for pm in (() if quick else ("svd", *PROJ_METHODS)):  # the projections again, with the best EF option
        runs.append(Run(f"proj_{pm}_{BEST_EF}_lordo_global", "projection", "lordo_global",
                        (f"inner.rank={base}", f"inner.proj_method={pm}", *EF_OPTIONS[BEST_EF])))
    for f in (() if quick else DENSE_SYNC_FACTORS):
        runs.append(Run(f"dense{f}_lordo_global", "dense sync", "lordo_global",
                        (f"inner.rank={base}", f"rounds.dense_sync_factor={f}")))
    return runs + k_runs[4:]


QUICK_OVERRIDES = ("model.preset=tiny", "total_steps=8", "rounds.local_steps=4", "data.seq_len=32",
                   "data.batch_size=4", "eval_every=1", "eval_batches=2", "inner.warmup_steps=2")


def compose(run: Run, quick: bool, out_dir: Path, base: tuple[str, ...] = (), config: str = "quality_cpu"):
    """The run's TrainConfig: examples/reference/`config`.yaml + `base` + the run's overrides (+ the quick ones)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from lordo_fed.config import register_resolvers
    from lordo_fed.trainer.config import TrainConfig

    register_resolvers()
    ConfigStore.instance().store(name="reference", node=TrainConfig)
    overrides = [f"methods=[{run.method}]", f"out_dir={out_dir}", "progress=false", *base,
                 *(QUICK_OVERRIDES if quick else ()), *run.overrides]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = hydra_compose(config_name=config, overrides=overrides)
    return OmegaConf.to_object(raw)


def torch_device_name(device) -> str:
    """"cpu", or a CUDA device's name (a run's roundings depend on the GPU model as on the CPU's kernels)."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


CHECKPOINT_EVERY = 8
"""Rounds between the checkpoints of a benchmark's run (`checkpoint_every`; asynchronous methods: records): a run
killed part-way continues from its newest one when the benchmark is started again, and ends as it would have
(lordo_fed.trainer.checkpoints); they are deleted once the run's result is written."""


def execute(run: Run, quick: bool, work: Path, fresh: bool, base: tuple[str, ...] = (),
            config: str = "quality_cpu") -> dict:
    """Train one run (or load its cached result, or continue it from its checkpoint); returns its summary and
    curves (validation loss against rounds, tokens and the bytes a worker sent and received so far).
    `resumed_from_round`: the round a killed run continued from (0: trained in one go); `wall_seconds`: the
    method's training, a killed run's part before its kill included (the trainer's summary `seconds`).
    Each result records the commit it was trained at (`code`) and its host (`host_of` and the device it trained
    on: "cpu" or the GPU's name); a cached result trained
    on another host is refused, naming both, since its figures would not be this machine's (results that predate
    the record are read as they are)."""
    from lordo_fed.trainer.cli import train

    out_dir = work / run.label
    done = out_dir / "result.json"
    cfg = compose(run, quick, out_dir, base, config)
    device = pick_device(cfg.device)
    host = {**host_of(machine_info()), "device": torch_device_name(device)}
    if done.exists() and not fresh:
        cached = json.loads(done.read_text())
        require_host(cached.get("host", host), host, str(done), "train it here (--fresh, or another --work)",
                     verb="trained")
        return cached
    checkpoints = out_dir / "checkpoints"
    if fresh:
        shutil.rmtree(checkpoints, ignore_errors=True)
    cfg.checkpoint_every = CHECKPOINT_EVERY
    mine = checkpoints / run.method
    resumed = max((r for r, _ in list_checkpoints(mine)), default=0) if cfg.checkpoint_every and mine.is_dir() else 0
    method = resolve_method(run.method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps)
    summary = train(cfg)[run.method]
    history = [json.loads(line) for line in (out_dir / f"{run.method}.jsonl").read_text().splitlines()]
    evals = [r for r in history if "val_loss" in r]
    rounds = [r for r in history if "delta_norm" in r or "train_loss" in r]
    result = {
        "label": run.label, "group": run.group, "method": run.method, "overrides": list(run.overrides),
        "rank": cfg.inner.rank, "omega": cfg.inner.omega, "K": cfg.rounds.local_steps, "M": cfg.workers,
        **{k: getattr(method.inner, k) for k in ("lr", "ef_decay")},  # the method's own where the run left them
        "B": cfg.data.batch_size, "proj_method": resolved_proj_method(cfg.inner, device),
        "seed": cfg.seed, **summary,
        "wall_seconds": summary["seconds"], "resumed_from_round": resumed,
        "code": {k: v for k, v in code_info().items() if k != "package"}, "host": host,
        "curve": {"round": [r["round"] for r in evals], "tokens": [r["tokens"] for r in evals],
                  "val_loss": [r["val_loss"] for r in evals],
                  "bytes": [r.get("cum_bytes_sent_per_worker", 0) + r.get("cum_bytes_received_per_worker", 0)
                            for r in evals]},
        "diagnostics": {
            "round": [r["round"] for r in rounds if "delta_stable_rank" in r],
            **{key: [r[key] for r in rounds if "delta_stable_rank" in r and key in r] for key in DIAGNOSTICS},
        },
    }
    done.write_text(json.dumps(result, indent=1))
    shutil.rmtree(checkpoints, ignore_errors=True)  # the result is the run's now
    return result


def gaps(results: dict[str, dict]) -> None:
    """Add `gap_to_lowrank_ddp`: ppl / ppl(low-rank DDP at the same rank) - 1, in place."""
    for res in results.values():
        ref = results.get(f"rank{res['rank']}_lowrank_ddp")
        if ref and res["method"] != "ddp":
            res["gap_to_lowrank_ddp"] = res["val_ppl"] / ref["val_ppl"] - 1


def plot(results: dict[str, dict], path: Path, base_rank: int, base_k: int) -> None:
    fig = new_figure(13, 9.5)
    ax_curve, ax_rank, ax_sr, ax_sweep = (fig.add_subplot(2, 2, i) for i in range(1, 5))
    for label in [*FULL_METHODS, *(f"rank{base_rank}_{m}" for m in LOWRANK_METHODS)]:
        if label in results:
            c = results[label]["curve"]
            ax_curve.plot(c["tokens"], c["val_loss"], label=label.replace(f"rank{base_rank}_", ""))
    ax_curve.set(xlabel="tokens", ylabel="validation loss", title=f"Validation loss, rank {base_rank}")
    ax_curve.legend(fontsize=8)
    for m in LOWRANK_METHODS:
        pts = sorted((r["rank"], r["val_ppl"]) for r in results.values() if r["group"] == "rank"
                     and r["label"].endswith("_" + m) and r["label"].startswith("rank"))
        if pts:
            ax_rank.plot(*zip(*pts), marker="o", label=m)
    for m in FULL_METHODS:
        if m in results:
            ax_rank.axhline(results[m]["val_ppl"], ls="--", lw=1, label=m, color={"ddp": "k", "diloco": "gray",
                                                                                      "local_adam": "tab:brown"}[m])
    ax_rank.set(xscale="log", xlabel="rank r", ylabel="validation perplexity", title="Perplexity against rank")
    ax_rank.set_xticks(list(RANK_GRID), [str(r) for r in RANK_GRID])
    ax_rank.set_xticks([], minor=True)
    ax_rank.legend(fontsize=8)
    for label, style in ((f"rank{base_rank}_lordo_global", "-"), (f"rank{base_rank}_lordo_global_omega1", "--")):
        if label in results:
            d = results[label]["diagnostics"]
            name = "ω = 1" if "omega1" in label else f"ω = {results[label]['omega']}"
            ax_sr.plot(d["round"], d["delta_stable_rank"], style, color="tab:blue", label=f"stable rank of Δ̄, {name}")
            ax_sr2 = getattr(ax_sr, "_twin", None) or ax_sr.twinx()
            ax_sr._twin = ax_sr2
            ax_sr2.plot(d["round"], d["delta_in_subspace"], style, color="tab:red", label=f"share in subspace, {name}")
            ax_sr2.set(ylabel="share of ||Δ̄||² in the shared subspace", ylim=(0, 1.05))
            ax_sr2.legend(fontsize=8, loc="lower right")
    ax_sr.set(xlabel="round", ylabel="stable rank of Δ̄ (mean over low-rank W)",
              title=f"LoRDO-Global, rank {base_rank}: with and without the QH term")
    ax_sr.legend(fontsize=8, loc="upper right")
    base_m = next((r["M"] for r in results.values() if r["group"] == "rank"), 4)
    for m, color in (("lordo_global", "tab:blue"), ("lordo_local", "tab:orange")):
        ks = sorted((r["K"], r["val_ppl"]) for r in results.values() if r["method"] == m and r["M"] == base_m
                    and r["rank"] == base_rank and r["omega"] < 1 and r["proj_method"] == "svd"
                    and r["group"] in ("K", "rank"))
        if ks:
            ax_sweep.plot(*zip(*ks), marker="o", color=color, label=f"{m}: K (M = {base_m})")
    ax_sweep.set(xscale="log", xlabel="K (local steps per round)", ylabel="validation perplexity",
                 title=f"K sweep (M = {base_m}); M x B sweep at a fixed global batch (top axis)")
    ax_mb = ax_sweep.twiny()
    for m, color in (("lordo_global", "tab:blue"), ("lordo_local", "tab:orange")):
        mb = sorted((r["M"], r["val_ppl"]) for r in results.values() if r["method"] == m and r["K"] == base_k
                    and r["rank"] == base_rank and r["omega"] < 1 and r["proj_method"] == "svd"
                    and r["group"] in ("MxB", "rank"))
        if mb:
            ax_mb.plot(*zip(*mb), marker="s", ls=":", color=color, label=f"{m}: M (B = 64 / M)")
    ax_mb.set(xscale="log", xlabel="M workers")
    for ax, ticks in ((ax_sweep, sorted({r["K"] for r in results.values()})),
                      (ax_mb, sorted({r["M"] for r in results.values()}))):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xticks([], minor=True)
    ax_sweep.legend(fontsize=8, loc="upper left")
    ax_mb.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)


def table(results: dict[str, dict]) -> str:
    lines = ["| run | method | rank | K | M x B | val ppl | gap to low-rank DDP | bytes sent / worker / step | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results.values():
        gap = f"{100 * r['gap_to_lowrank_ddp']:+.1f}%" if "gap_to_lowrank_ddp" in r else "-"
        rank = r["rank"] if r["method"] not in FULL_METHODS else "-"
        lines.append(f"| {r['label']} | {r['method']}{' ω=1' if r['omega'] == 1 else ''} | {rank} | {r['K']} | "
                     f"{r['M']} x {r['B']} | {r['val_ppl']:.3f} | {gap} | "
                     f"{r['bytes_sent_per_worker_per_step']:,.0f} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = make_parser("quality", __doc__, "tiny preset, 8 steps, one run of each kind (~1 min)")
    parser.add_argument("--work", default=None,
                        help="folder of the per-run outputs (default: outputs/quality_cpu, or a temporary one with --quick)")
    parser.add_argument("--only", default="", help="comma-separated run labels to run (default: the whole grid)")
    parser.add_argument("--fresh", action="store_true", help="rerun runs that already have a result in --work")
    args = parser.parse_args()
    import logging
    import tempfile

    logging.basicConfig(level=logging.WARNING)
    runs = grid(args.quick)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r.label for r in runs}
        if unknown:
            parser.error(f"--only: unknown run labels {sorted(unknown)}; expected any of {[r.label for r in runs]}")
        runs = [r for r in runs if r.label in wanted]
    work = Path(args.work) if args.work else (Path(tempfile.mkdtemp(prefix="quality-")) if args.quick
                                              else ROOT / "outputs" / "quality_cpu")
    started = time.perf_counter()
    results: dict[str, dict] = {}
    for i, run in enumerate(runs, 1):
        results[run.label] = execute(run, args.quick, work, args.fresh)
        r = results[run.label]
        print(f"[{i}/{len(runs)}] {run.label}: val ppl {r['val_ppl']:.3f} ({r['wall_seconds']:.0f} s)", flush=True)
    gaps(results)
    base_rank = 8 if args.quick else 16
    config = compose(runs[0], args.quick, work / "_")
    header = result_header("quality", args.quick, {
        "base": "examples/reference/quality_cpu.yaml" + (" + " + " ".join(QUICK_OVERRIDES) if args.quick else ""),
        "preset": config.model.preset, "workers": config.workers, "batch_size": config.data.batch_size,
        "seq_len": config.data.seq_len, "total_steps": config.total_steps, "K": config.rounds.local_steps,
        "lr": config.inner.lr, "omega": config.inner.omega, "seed": config.seed,
        "tokens_per_run": config.workers * config.data.batch_size * config.data.seq_len * config.total_steps,
        "runs": [{"label": r.label, "method": r.method, "overrides": list(r.overrides)} for r in runs],
    })
    # runs cached by an earlier invocation keep the wall time they took then
    out = write_json({**header, "seconds": time.perf_counter() - started,
                      "runs_wall_seconds": sum(r["wall_seconds"] for r in results.values()), "runs": results}, args.out)
    plot(results, png_path(out), base_rank, config.rounds.local_steps)
    print(table(results))
    print(f"wrote {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
