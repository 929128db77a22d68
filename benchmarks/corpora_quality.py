"""Quality across corpora: every method at equal tokens on text of three kinds, with each method's
own best setting chosen by the mean over the corpora, never by one.

The setting is `examples/reference/small_cpu.yaml` (small preset, M = 4 workers of batch 16, 128-token
sequences, K = 32), at two horizons: 16 rounds (512 steps) and 64 rounds (2,048 steps). The corpora are
the three shipped with the package (lordo_fed/corpora/README.md): English verse (`tinyshakespeare.txt`),
Python code (`python_stdlib.txt`) and English technical prose (`python_docs.txt`), each split into its
train part and its held-out tail (`data.val_fraction`).

Two parts, each a list of cached runs (one folder per run under --work, so an interrupted benchmark
continues where it stopped; --fresh reruns):

- `tune`: every trial of `TRIALS` (the same number for every method: its error-feedback decay, the
  two-phase switch, its learning rate or outer step) on every corpus at 16 rounds, seed 0. A method's
  best trial has the lowest mean over the corpora of the validation loss (the geometric mean of the
  perplexities): no corpus decides alone.
- `table`: each method's best trial on every corpus, at both horizons and both seeds; the gap of each
  method to low-rank DDP (the paper's comparison) and to DiLoCo, and the bytes each worker sent and
  received. The goal (the issue): LoRDO-Global and LoRDO-Local within 1% of low-rank DDP at 64 rounds
  and within 3% at 16, on every corpus; at 64 rounds at or below DiLoCo with at least 10x fewer bytes.
  Each row also has its run's best point (`best_point`) and the gap at it: 64 rounds pass over these
  corpora about 17 times, and a run that fits faster can pass its best before the end.

    python benchmarks/corpora_quality.py --jobs 2         # tune, then the table (hours on 2 cores)
    python benchmarks/corpora_quality.py --part tune      # the trials only
    python benchmarks/corpora_quality.py --part exchanges --seeds 1 --horizons 64 --corpora code --methods lordo_local
                                                          # a probe part on another seed and horizon, one
                                                          # method's probes (and low-rank DDP's)
    python scripts/make_stdlib_corpus.py /tmp/stdlib_large.txt
    python benchmarks/corpora_quality.py --part exchanges --corpus code-large=/tmp/stdlib_large.txt \
        --corpora code-large --horizons 64 --methods lordo_global,lordo_local --probes k8-int8,ef1-switch-lr0.5x
                                                          # a local corpus (here 30 MB of code, which 64 rounds
                                                          # read less than once), some probes only
    python benchmarks/corpora_quality.py --part exchanges --horizons 64 --methods lordo_global \
        --probes ramp2x256-4x128-int8 --reference benchmarks/results/cpu_corpora_exchanges_global_ramp4_r64.json
                                                          # low-rank DDP and K = 32 read from a committed file
                                                          # of this host type, only the probe trained
    python benchmarks/corpora_quality.py --quick          # tiny runs: two methods, two trials, every corpus
    python benchmarks/corpora_quality.py --part best-points --out benchmarks/results/cpu_corpora_best_points_r64.json
                                                          # no run: every 64-round run in the committed files,
                                                          # its end and best point (`best_points`)
Writes benchmarks/results/corpora_quality.json and .png (validation loss against tokens and against
bytes sent, per corpus, 64 rounds, the lowest seed of the table).
"""

from __future__ import annotations

import glob
import json
import math
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

try:
    from benchmarks.common import (host_of, machine_info, make_parser, new_figure, png_path, require_host,
                                   result_header, write_json)
    from benchmarks.quality import QUICK_OVERRIDES, Run, execute
except ImportError:  # run as `python benchmarks/corpora_quality.py`
    from common import (host_of, machine_info, make_parser, new_figure, png_path, require_host, result_header,
                        write_json)
    from quality import QUICK_OVERRIDES, Run, execute

ROOT = Path(__file__).resolve().parents[1]
CORPORA: dict[str, Path] = {name: ROOT / "lordo_fed" / "corpora" / f"{file}.txt" for name, file in
                            (("verse", "tinyshakespeare"), ("code", "python_stdlib"), ("prose", "python_docs"))}
"""The shipped corpora by kind (lordo_fed/corpora/README.md)."""
METHODS = ("ddp", "lowrank_ddp", "diloco", "lordo_global", "lordo_local")
HORIZONS = (16, 64)
"""Rounds of K = 32 (small_cpu.yaml's K); the first is the tuning horizon."""
CONFIG = "small_cpu"
SPREAD = "data.eval_windows=spread"
"""`--eval-windows spread`'s override, added to every run's."""


@dataclass(frozen=True)
class Trial:
    """One setting of a method: a name and trainer overrides. `{half}` in an override stands for half
    the run's steps (the two-phase switch at the same point of every horizon), `{decay}` for the first
    step of WSD's learning-rate decay (the default `inner.decay_fraction`: the last 20% of the steps)."""

    name: str
    overrides: tuple[str, ...]

    def resolved(self, total_steps: int) -> tuple[str, ...]:
        from lordo_fed.optim.config import InnerConfig

        decay = total_steps - int(round(InnerConfig().decay_fraction * total_steps))
        return tuple(o.format(half=total_steps // 2, decay=decay) for o in self.overrides)


def _lordo_trials(best: str) -> list[Trial]:
    """LoRDO's four trials, the fifth: `best` (the name of its best of the four) at half the lr, and the
    sixth: that at a quarter of the lr (the fifth won for every method, section 17)."""
    four = [Trial("ef1", ("inner.ef_decay=1.0",)), Trial("ef0.9", ("inner.ef_decay=0.9",)),
            Trial("ef1-switch", ("inner.ef_decay=1.0", "inner.switch_step={half}")),
            Trial("ef0.9-lr2x", ("inner.ef_decay=0.9", "inner.lr=0.016"))]
    base = next(t for t in four if t.name == best)
    return [*four, Trial(f"{best}-lr0.5x", (*base.overrides, "inner.lr=0.004")),
            Trial(f"{best}-lr0.25x", (*base.overrides, "inner.lr=0.002"))]


TRIALS: dict[str, list[Trial]] = {
    "ddp": [Trial("lr0.008", ("inner.lr=0.008",)), Trial("lr0.004", ("inner.lr=0.004",)),
            Trial("lr0.016", ("inner.lr=0.016",)), Trial("lr0.024", ("inner.lr=0.024",)),
            Trial("lr0.002", ("inner.lr=0.002",)), Trial("lr0.001", ("inner.lr=0.001",))],
    "lowrank_ddp": [Trial("ef1", ("inner.ef_decay=1.0",)), Trial("ef0.9", ("inner.ef_decay=0.9",)),
                    Trial("ef1-lr2x", ("inner.ef_decay=1.0", "inner.lr=0.016")),
                    Trial("ef0.9-lr2x", ("inner.ef_decay=0.9", "inner.lr=0.016")),
                    Trial("ef0.9-lr0.5x", ("inner.ef_decay=0.9", "inner.lr=0.004")),
                    Trial("ef0.9-lr0.25x", ("inner.ef_decay=0.9", "inner.lr=0.002"))],
    "diloco": [Trial("nesterov0.7", ("diloco_outer.name=nesterov", "diloco_outer.lr=0.7", "diloco_outer.momentum=0.9")),
               Trial("nesterov0.4", ("diloco_outer.name=nesterov", "diloco_outer.lr=0.4", "diloco_outer.momentum=0.9")),
               Trial("average1", ("diloco_outer.name=average", "diloco_outer.lr=1.0")),
               Trial("average1.3", ("diloco_outer.name=average", "diloco_outer.lr=1.3")),
               Trial("average1-lr0.5x", ("diloco_outer.name=average", "diloco_outer.lr=1.0", "inner.lr=0.004")),
               Trial("average1-lr0.25x", ("diloco_outer.name=average", "diloco_outer.lr=1.0", "inner.lr=0.002"))],
    "lordo_global": _lordo_trials("ef0.9"),
    "lordo_local": _lordo_trials("ef1-switch"),
}
"""Six trials per method (the same budget for every baseline and for ours); the first of each is
small_cpu.yaml's own setting (the paper's error feedback, E fed back whole; DiLoCo's Nesterov outer step).
The first four chose the defaults of 2026-11-26; the fifth, each method's best of those four at half its
lr (DDP: half its best lr), won for every method in the next tuning and chose today's (docs/results.md,
section 17). Since the lowest lr tried won everywhere, the sixth halves it again: the next tuning runs it."""


def derived(method: str, suffix: str, *overrides: str) -> tuple[str, Trial]:
    """A probe of `method`: its table trial (the fifth of `TRIALS`, today's default) with `overrides` added,
    named after it with `-suffix`."""
    base = TRIALS[method][4]
    return method, Trial(f"{base.name}-{suffix}", (*base.overrides, *overrides))


EARLY: list[tuple[str, Trial]] = [
    ("lowrank_ddp", TRIALS["lowrank_ddp"][1]), ("lordo_global", TRIALS["lordo_global"][1]),
    ("lordo_global", Trial("ef0.9-k8", ("inner.ef_decay=0.9", "rounds.local_steps=8"))),
    ("lordo_global", Trial("ef0.9-k4", ("inner.ef_decay=0.9", "rounds.local_steps=4"))),
    ("lordo_global", Trial("ef0.9-ramp4", ("inner.ef_decay=0.9", "rounds.local_steps_ramp=[4,4,8,16]"))),
    ("lordo_global", Trial("ef0.9-ramp8x12", ("inner.ef_decay=0.9", "rounds.local_steps_ramp=[8,8,8,8,8,8,8,8,8,8,8,8,16,16]"))),
    ("lordo_global", Trial("ef0.9-wu128", ("inner.ef_decay=0.9", "inner.warmup_steps=128"))),
    ("lowrank_ddp", Trial("ef0.9-wu128", ("inner.ef_decay=0.9", "inner.warmup_steps=128"))),
    ("lordo_global", Trial("ef0.9-nesterov", ("inner.ef_decay=0.9", "outer.name=nesterov", "outer.lr=0.7",
                                              "outer.momentum=0.9"))),
    ("lordo_global", Trial("ef0.9-outer1.3", ("inner.ef_decay=0.9", "outer.lr=1.3"))),
    ("lordo_global", Trial("ef0.9-omega1", ("inner.ef_decay=0.9", "inner.omega=1.0"))),
    ("lowrank_ddp", Trial("ef0.9-omega1", ("inner.ef_decay=0.9", "inner.omega=1.0"))),
    ("lordo_global", Trial("noef", ("inner.error_feedback=false",))),
    ("lowrank_ddp", Trial("noef", ("inner.error_feedback=false",))),
]
"""`--part early`: why LoRDO trails low-rank DDP at 16 rounds of K = 32 (the issue's early-round gap), at
the first horizon, seed 0: K smaller throughout (8, 4: more exchanges), K smaller in the first rounds
only (`local_steps_ramp`: the first 32 steps in four rounds; the first 128 at K = 8), a longer warm-up
(for low-rank DDP too: is it the warm-up against K, or a better warm-up for any method?) and outer steps
that move further than the mean (Nesterov, as DiLoCo; lr 1.3); and which part of LoRDO's step suffers from
K unsynchronised steps: without the full-rank term (ω = 1) or without error feedback, against low-rank DDP
the same. The first two are the tune's own runs."""


LATE: list[tuple[str, Trial]] = [
    ("lowrank_ddp", TRIALS["lowrank_ddp"][1]), ("lordo_global", TRIALS["lordo_global"][1]),
    ("lordo_local", TRIALS["lordo_local"][2]),
    ("lordo_global", Trial("ef0.9-late8", ("inner.ef_decay=0.9", "rounds.late_local_steps=8",
                                           "rounds.late_from_step={decay}"))),
    ("lordo_local", Trial("ef1-switch-late8", (*TRIALS["lordo_local"][2].overrides, "rounds.late_local_steps=8",
                                               "rounds.late_from_step={decay}"))),
    ("lordo_global", Trial("ef0.9-M1xB64", ("inner.ef_decay=0.9", "workers=1", "data.batch_size=64"))),
]
"""`--part late`: at 64 rounds LoRDO leads low-rank DDP mid-run and gives part of the lead back while the
learning rate decays (section 17, part three): the same runs with rounds of K = 8 from the decay's first
step on (`rounds.late_local_steps`: four times the exchanges in the last 20% of the steps, 1.56x the
bytes). The first three are the table's own runs (their cache). The last is one worker of batch 64 (the
same tokens per step, nothing averaged): if it gains in the decay what low-rank DDP gains, what LoRDO
lacks there is moments of the whole batch's gradient, not exchanges."""


EXCHANGES: list[tuple[str, Trial]] = [
    ("lowrank_ddp", TRIALS["lowrank_ddp"][4]), ("lordo_global", TRIALS["lordo_global"][4]),
    derived("lordo_global", "k8-int8", "rounds.local_steps=8", "payload_dtype=int8"),
    derived("lordo_global", "k8", "rounds.local_steps=8"),
    derived("lordo_global", "k16-int8", "rounds.local_steps=16", "payload_dtype=int8"),
    ("lordo_local", TRIALS["lordo_local"][4]),
    derived("lordo_local", "k8-int8", "rounds.local_steps=8", "payload_dtype=int8"),
    derived("lordo_local", "k8", "rounds.local_steps=8"),
    derived("lordo_local", "k8-int8-p32", "rounds.local_steps=8", "payload_dtype=int8", "inner.proj_interval=32"),
    derived("lordo_global", "k8-int8-late-outer2", "rounds.local_steps=8", "payload_dtype=int8", "outer.late_lr=2.0",
            "rounds.late_from_step={decay}"),
    derived("lordo_local", "k8-int8-late-outer2", "rounds.local_steps=8", "payload_dtype=int8", "outer.late_lr=2.0",
            "rounds.late_from_step={decay}"),
    derived("lordo_global", "k4-int8", "rounds.local_steps=4", "payload_dtype=int8"),
    derived("lordo_local", "k4-int8", "rounds.local_steps=4", "payload_dtype=int8"),
    derived("lordo_local", "k8-int8-b0.9", "rounds.local_steps=8", "payload_dtype=int8", "inner.switch_betas=[0.9,0.999]"),
    derived("lordo_local", "k32-b0.9", "inner.switch_betas=[0.9,0.999]"),
    derived("lordo_global", "k8-int8-switch-b0.9", "rounds.local_steps=8", "payload_dtype=int8",
            "inner.switch_step={half}", "inner.switch_betas=[0.9,0.999]"),
    derived("lordo_global", "k4", "rounds.local_steps=4"),
    derived("lordo_global", "k4-int8-m8", "rounds.local_steps=4", "payload_dtype=int8", "rounds.sync_exp_avg_every=8",
            "rounds.sync_exp_avg_sq_every=8"),
    derived("lordo_global", "k4-int8-v8", "rounds.local_steps=4", "payload_dtype=int8", "rounds.sync_exp_avg_sq_every=8"),
    derived("lordo_global", "ramp4x128-int8", f"rounds.local_steps_ramp=[{','.join(['4'] * 128)}]", "payload_dtype=int8"),
    derived("lordo_global", "ramp4x128-int8-m8", f"rounds.local_steps_ramp=[{','.join(['4'] * 128)}]", "payload_dtype=int8",
            "rounds.sync_exp_avg_every=8", "rounds.sync_exp_avg_sq_every=8"),
    derived("lordo_global", "ramp2x256-int8", f"rounds.local_steps_ramp=[{','.join(['2'] * 256)}]", "payload_dtype=int8"),
    derived("lordo_global", "ramp2x256-4x128-int8", f"rounds.local_steps_ramp=[{','.join(['2'] * 256 + ['4'] * 128)}]",
            "payload_dtype=int8"),
]
"""`--part exchanges`: the early-round gap against the bytes it is allowed, at today's defaults. Section 16
closed it with more exchanges (K = 8: 4x the bytes); the int8 payload (within 1% of fp32, section 12)
sends each exchange in about a third of fp32's bytes, so K = 8 with int8 costs about what K = 32 with fp32
does, and K = 16 with int8 less; K = 8 in fp32 (4x the bytes) tells what int8 costs. The first two are the
table's own trials (its cache); the gaps are to low-rank DDP, the bytes to LoRDO-Global's K = 32 run
(LoRDO-Local's own K = 32 run is the sixth). The eighth, LoRDO-Local with K = 8 in fp32, tells which of the
seventh's two changes (more exchanges, int8) costs LoRDO-Local at 64 rounds; the ninth, the seventh with each
worker's bases refitted every 32 steps as at K = 32 (`inner.proj_interval`; 0, the default, refits every K
steps), whether the cost is the refits (docs/results.md, section 17, part eight). The last two are the seventh and
the third with an outer lr of 2 = √M in WSD's decay (`outer.late_lr`: the `workers` part's `late-outer2`). The
last two are K = 4 with int8 (about twice K = 32's bytes): whether more exchanges still close the 16-round gap
where K = 8 with int8 leaves it above 3% (docs/results.md, section 17, part eleven). The next is LoRDO-Local's
K = 8 with int8 keeping β1 = 0.9 after its two-phase switch (the authors' switch sets β = (0.999, 0.999): a first
moment that averages ~1,000 steps: with it LoRDO-Local gains least in WSD's decay; docs/results.md, section 17,
part twelve); the next, the same at the default's K = 32 in fp32 (`k32-b0.9`); the last, LoRDO-Global's K = 8 with
int8 given LoRDO-Local's two-phase switch at half the run with β1 0.9 after it (its best trial has no switch: whether
the switch's halved lr and fresh moments help it in the decay as they help LoRDO-Local). The last three ask what
int8 costs LoRDO-Global at K = 4 (docs/results.md, section 17, part fifteen): K = 4 in fp32, and K = 4 with int8
with both moments, or the second alone, averaged every 8 rounds (32 steps, as at K = 32) instead of every round:
whether the cost is the moments' int8, quantised again at every exchange without error feedback. The last is K = 4
with int8 for the first 512 steps only (`rounds.local_steps_ramp`: 128 rounds of 4, then K = 32 with int8): the whole
16-round horizon at K = 4, where it closes most of the gap, and K = 32 after it, where K = 4 overfits code at 64
rounds (docs/results.md, section 17, part eighteen); `-m8` also averages both moments every 8 rounds (32 steps in
the ramp, as `k4-int8-m8`; 256 after it). `ramp2x256-int8` is the same ramp at K = 2 (256 rounds of 2, then K = 32
with int8): whether twice the ramp's exchanges close the 16-round gap on the pairs K = 4 leaves above 3% (prose
seed 0, verse seed 1; docs/results.md, section 17, part nineteen). `ramp2x256-4x128-int8` adds 128 rounds of 4 after
it (K = 32 from step 1,024): at 16 rounds it is `ramp2x256-int8`; at 64, whether K = 4 a while longer takes verse
within 1% (K = 4 throughout did, part sixteen) without the overfitting on code that K = 4 throughout had (part
twenty)."""

def horizon_overrides(rounds: int, quick: bool) -> tuple[str, ...]:
    """`rounds` rounds of small_cpu's K = 32, eight evaluations (quick: rounds of QUICK_OVERRIDES' K = 4)."""
    k = 4 if quick else 32
    return (f"total_steps={rounds * k}", f"rounds.local_steps={k}", f"eval_every={max(1, rounds // 8)}")


def run_of(corpus: str, method: str, trial: Trial, rounds: int, seed: int, quick: bool,
           path: Path | None = None, spread: bool = False) -> Run:
    """One run of `trial` on `corpus`: a shipped one by name, or a local one (`--corpus`) at `path`. A local
    file's run is cached under its name and the start of its sha256, so other text under the same name runs anew,
    and a run validated on spread windows (`--eval-windows spread`) under `-spread`."""
    k = 4 if quick else 32
    digest = local_corpus(path).get("sha256", "") if corpus not in CORPORA and path is not None else ""
    name = (f"{corpus}-{digest[:12]}" if digest else corpus) + ("-spread" if spread else "")
    return Run(f"{name}_{method}_{trial.name}_R{rounds}_s{seed}", corpus, method,
               (f"data.path={path or CORPORA[corpus]}", f"seed={seed}", *horizon_overrides(rounds, quick),
                *trial.resolved(rounds * k)))  # the trial's last: it may change K (`EARLY`)


def mean_loss(rows: list[dict]) -> float:
    """The mean validation loss over corpora (log of the geometric-mean perplexity)."""
    return statistics.fmean(r["val_loss"] for r in rows)


def best_trials(tuned: list[dict], methods: list[str]) -> dict[str, str]:
    """method -> the name of its trial with the lowest `mean_loss` over the corpora (the first on a tie)."""
    best = {}
    for m in methods:
        names = [t.name for t in TRIALS[m]]
        scores = {n: mean_loss([r for r in tuned if r["method"] == m and r["trial"] == n]) for n in names
                  if any(r["method"] == m and r["trial"] == n for r in tuned)}
        best[m] = min(scores, key=lambda n: (scores[n], names.index(n)))
    return best


def parse_best(text: str, methods: list[str], trials: dict[str, list[Trial]]) -> dict[str, str] | str:
    """`--best`'s 'method=trial,...' as {method: trial name}, or the error message naming the bad value."""
    best = {}
    for item in (i for i in text.split(",") if i):
        method, _, name = item.partition("=")
        if method not in trials:
            return f"--best {item!r}: expected a method among --methods {methods}"
        names = [t.name for t in trials[method]]
        if name not in names:
            return f"--best {item!r}: expected one of {method}'s trials {names}"
        best[method] = name
    missing = [m for m in methods if m not in best]
    return f"--best {text!r}: no trial for {missing}" if missing else best


def set_gap(r: dict, ref: dict, key: str, best: bool = True) -> None:
    """r[key] = r's perplexity / ref's − 1 at the end of the runs; with `best`, also `best_<key>` at each run's
    `best_point`, where both rows have one."""
    r[key] = r["val_ppl"] / ref["val_ppl"] - 1.0
    if best and "best_val_ppl" in r and "best_val_ppl" in ref:
        r[f"best_{key}"] = r["best_val_ppl"] / ref["best_val_ppl"] - 1.0


def gaps(rows: list[dict]) -> None:
    """Add `gap_lowrank_ddp` and `gap_diloco` (ppl / ppl of that method on the same corpus, horizon and
    seed − 1), `best_gap_lowrank_ddp` (the same with each run's `best_point`, where both rows have one) and
    `bytes_vs_diloco` (DiLoCo's bytes / the run's), in place, where the reference ran."""
    index = {(r["corpus"], r["rounds"], r["seed"], r["method"]): r for r in rows}
    for r in rows:
        for ref, key in (("lowrank_ddp", "gap_lowrank_ddp"), ("diloco", "gap_diloco")):
            other = index.get((r["corpus"], r["rounds"], r["seed"], ref))
            if other is not None and other is not r:
                set_gap(r, other, key, best=ref == "lowrank_ddp")
        d = index.get((r["corpus"], r["rounds"], r["seed"], "diloco"))
        if d is not None and r["bytes_per_worker"]:
            r["bytes_vs_diloco"] = d["bytes_per_worker"] / r["bytes_per_worker"]


def goal(rows: list[dict], horizons: tuple[int, ...]) -> dict[str, bool]:
    """The issue's goal per LoRDO method (every corpus and seed): gap to low-rank DDP ≤ 1% at the last
    horizon and ≤ 3% at the first; at the last, at or below DiLoCo with ≥ 10x fewer bytes. A table of
    one horizon reports the goals of that horizon only: 64 rounds (`HORIZONS`' last) counts as the long one."""
    short = horizons[0] if horizons[0] != HORIZONS[-1] else None
    long = horizons[-1] if len(horizons) > 1 or horizons[-1] == HORIZONS[-1] else None
    out = {}
    for m in ("lordo_global", "lordo_local"):
        mine = [r for r in rows if r["method"] == m]
        if not mine:
            continue
        if short is not None:
            out[f"{m}_within_3pct_short"] = all(r.get("gap_lowrank_ddp", math.inf) <= 0.03
                                                for r in mine if r["rounds"] == short)
        if long is not None:
            at_long = [r for r in mine if r["rounds"] == long]
            out[f"{m}_within_1pct_long"] = all(r.get("gap_lowrank_ddp", math.inf) <= 0.01 for r in at_long)
            out[f"{m}_beats_diloco_long"] = all(r.get("gap_diloco", math.inf) <= 0.0 and r.get("bytes_vs_diloco", 0) >= 10
                                                for r in at_long)
    return out


def best_point(curve: dict) -> tuple[float, int]:
    """The lowest validation perplexity of a run and its tokens, among its evaluations at each eighth of its tokens
    (`horizon_overrides`' eight; a probe with a smaller K evaluates more often, and a finer grid would favour it).
    On the shipped corpora (about 1 M training tokens each) 64 rounds are 16 epochs, and a run's validation
    perplexity can pass its lowest before the end (docs/results.md, section 17, part eight)."""
    eighth = curve["tokens"][-1] // 8
    points = [(math.exp(v), t) for t, v in zip(curve["tokens"], curve["val_loss"])
              if v is not None and t > 0 and eighth and t % eighth == 0]
    return min(points, default=(math.inf, 0))


def row_of(result: dict, corpus: str, trial: str, rounds: int, seed: int) -> dict:
    best_ppl, best_tokens = best_point(result["curve"])
    best = {"best_val_ppl": best_ppl, "best_tokens": best_tokens} if math.isfinite(best_ppl) else {}
    return {"corpus": corpus, "method": result["method"], "trial": trial, "rounds": rounds, "seed": seed,
            "val_loss": result["val_loss"], "val_ppl": result["val_ppl"], "bytes_per_worker": result["curve"]["bytes"][-1],
            "tokens": result["curve"]["tokens"][-1], **best, "wall_seconds": result["wall_seconds"],
            **({"commit": result["code"]["commit"]} if "code" in result else {}), "curve": result["curve"]}


def _train(spec: tuple) -> dict:
    """One run (or its cached result) as a table row; top-level so that --jobs can run it in a process pool."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    corpus, path, method, trial, rounds, seed, quick, work, fresh, base = spec
    run = run_of(corpus, method, trial, rounds, seed, quick, path, spread=SPREAD in base)
    result = execute(run, False, work, fresh, base, CONFIG)
    print(f"{run.label}: val ppl {result['val_ppl']:.3f} ({result['wall_seconds']:.0f} s)", flush=True)
    return row_of(result, corpus, trial.name, rounds, seed)


def table_text(rows: list[dict], horizons: tuple[int, ...]) -> str:
    lines = []
    for rounds in horizons:
        for corpus in dict.fromkeys(r["corpus"] for r in rows):  # in the order of --corpora
            for r in sorted((r for r in rows if r["rounds"] == rounds and r["corpus"] == corpus),
                            key=lambda r: (r["seed"], METHODS.index(r["method"]))):
                gap = f"{r['gap_lowrank_ddp']:+.1%}" if "gap_lowrank_ddp" in r else "-"
                best = f"{r['best_gap_lowrank_ddp']:+.1%}" if "best_gap_lowrank_ddp" in r else "-"
                lines.append(f"R{rounds:<3} {corpus:6} s{r['seed']} {r['method']:13} {r['trial']:12} "
                             f"val ppl {r['val_ppl']:8.3f}  vs low-rank DDP {gap:>7}  "
                             f"best {r.get('best_val_ppl', math.nan):8.3f} ({best:>7})  "
                             f"{r['bytes_per_worker'] / 1e6:9.1f} MB/worker")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, rounds: int) -> None:
    corpora = list(dict.fromkeys(r["corpus"] for r in rows))  # a table of some corpora: theirs
    seed = min((r["seed"] for r in rows if r["rounds"] == rounds), default=0)  # a table of seed 1 alone: seed 1
    fig = new_figure(5 * len(corpora), 8.5)
    for i, corpus in enumerate(corpora):
        ax_tok, ax_bytes = fig.add_subplot(2, len(corpora), i + 1), fig.add_subplot(2, len(corpora), i + 1 + len(corpora))
        for r in rows:
            if r["corpus"] == corpus and r["rounds"] == rounds and r["seed"] == seed:
                c = r["curve"]
                ax_tok.plot(c["tokens"], c["val_loss"], label=f"{r['method']} ({r['trial']})")
                sent = [(b, v) for b, v in zip(c["bytes"], c["val_loss"]) if b > 0]  # log axis: no point at 0 bytes
                if sent:
                    ax_bytes.plot(*zip(*sent), marker=".", label=r["method"])
        ax_tok.set(xlabel="tokens", ylabel="validation loss", title=f"{corpus}, {rounds} rounds, seed {seed}")
        ax_bytes.set(xscale="log", xlabel="bytes sent + received per worker", ylabel="validation loss")
        ax_tok.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


WORKERS: list[tuple[str, Trial]] = [
    ("lowrank_ddp", TRIALS["lowrank_ddp"][4]), ("lordo_global", TRIALS["lordo_global"][4]),
    derived("lordo_global", "M1xB64", "workers=1", "data.batch_size=64", "diagnostics=true"),
    derived("lordo_global", "M1xB16", "workers=1", "diagnostics=true"),
    derived("lordo_global", "outer2", "outer.lr=2.0", "diagnostics=true"),
    derived("lordo_global", "outer3", "outer.lr=3.0", "diagnostics=true"),
    derived("lordo_global", "late-outer2", "outer.late_lr=2.0", "rounds.late_from_step={decay}", "diagnostics=true"),
    derived("diloco", "late-outer2", "diloco_outer.late_lr=2.0", "rounds.late_from_step={decay}"),
    derived("lowrank_ddp", "shuffled", "data.partition=dirichlet", "data.dirichlet_alpha=1000"),
    derived("lordo_global", "shuffled", "data.partition=dirichlet", "data.dirichlet_alpha=1000", "diagnostics=true"),
    ("lordo_global", Trial("ef0.9-lr0.25x-diag", (*TRIALS["lordo_global"][5].overrides, "diagnostics=true"))),
]
"""`--part workers`: what four workers cost LoRDO-Global at 16 rounds, at today's defaults (lr 0.004, γ 0.9;
run with `diagnostics=true` for `delta_retention`, ||Δ̄|| / Σ w ||Δ_m||): one worker with the whole batch
(64: the same tokens per step) and with one worker's batch (16: a quarter of the tokens); outer steps of
2 and 3 times the mean (does the mean move too little?), and of 2 = √M in WSD's decay only (`outer.late_lr`, for
DiLoCo too; the candidate of docs/results.md, section 17, part ten: where gradient noise dominates, the mean of
four steps each normalised by its own batch's moments is about half of one step over the whole batch); a random share of the paragraphs per worker in place
of the `iid` partition's contiguous pieces (are the workers' pieces of one file too different?), for
low-rank DDP too; and the sixth trial's lr (0.002, with diagnostics). The first two are the tune's fifth trials."""


def probe_named(trial: Trial, name: str) -> bool:
    """Whether `--probes name` picks `trial`: its whole name, or the suffix `derived` added (`k8-int8` picks
    LoRDO-Global's and LoRDO-Local's `...-k8-int8`)."""
    return trial.name == name or trial.name.endswith(f"-{name}")


PROBES: dict[str, list[tuple[str, Trial]]] = {"early": EARLY, "late": LATE, "workers": WORKERS, "exchanges": EXCHANGES}
"""The probe parts by name (`--part`): each a list of (method, trial), low-rank DDP's first."""


def early(train, rounds: int, out: str, quick: bool, part: str = "early", corpora: tuple[str, ...] = tuple(CORPORA),
          seeds: tuple[int, ...] = (0,), methods: tuple[str, ...] = tuple(METHODS), local: dict | None = None,
          only: tuple[str, ...] = (), recorded: dict | None = None) -> None:
    """The `EARLY` (or `LATE`, `WORKERS`, `EXCHANGES`) probes of `methods` on every corpus and seed: validation
    perplexity and the gap to low-rank DDP (the probes' first run, always run) on the same corpus and seed, and the
    bytes against LoRDO-Global's own K = 32 run (the second; None when LoRDO-Global is not among `methods`);
    the figure beside the JSON plots every run of the lowest seed against tokens and bytes, and each row keeps its
    validation curve (`--part best-points` reads it).
    `local`: the local corpora's `local_corpora` entries, recorded with the result; `only`: the names of the
    probes to run besides those two references (all when empty); `recorded`: more of the command's options for the
    result's config (--device, --eval-windows, --reference)."""
    probes = PROBES[part]
    if quick:  # quick rounds are too short for K = 8
        probes = [EARLY[0], EARLY[1], EARLY[6]] if part == "early" else probes[:2]
    k32_probe = probes[1] if probes[1][0] in methods else None
    probes = [probes[0], *(p for p in probes[1:] if p[0] in methods and (not only or p[1].name in only or p == k32_probe))]
    # low-rank DDP is every gap's reference and LoRDO-Global's K = 32 run the bytes'; `only` never drops them
    rows = train([(c, m, t, rounds, s) for s in seeds for m, t in probes for c in corpora])
    ref = {(r["corpus"], r["seed"], r["method"], r["trial"]): r for r in rows}
    for r in rows:
        at = (r["corpus"], r["seed"])
        base = ref[(*at, "lowrank_ddp", probes[0][1].name)]
        set_gap(r, base, "gap_lowrank_ddp")
        r["bytes_vs_k32"] = (r["bytes_per_worker"] / ref[(*at, k32_probe[0], k32_probe[1].name)]["bytes_per_worker"]
                             if k32_probe else None)
        times = f"x{r['bytes_vs_k32']:.2f} of K = 32" if k32_probe else f"{r['bytes_per_worker'] / 1e6:,.1f} MB"
        print(f"{r['corpus']:6} s{r['seed']} {r['method']:12} {r['trial']:16} val ppl {r['val_ppl']:7.3f}  vs low-rank "
              f"DDP {r['gap_lowrank_ddp']:+6.1%}  bytes {times}")
    result = result_header("corpora_quality", quick, {"part": part, "rounds": rounds, "seeds": list(seeds),
                                                      "corpora": list(corpora), "local_corpora": local or {},
                                                      **(recorded or {}),
                                                      "probes": [{"method": m, "name": t.name, "overrides": list(t.overrides)}
                                                                 for m, t in probes]})
    result["rows"] = rows  # with their curves: `--part best-points` reads a probe part's file as it reads a table's
    written = write_json(result, out)
    plot(rows, png_path(written), rounds)  # validation loss against tokens and bytes, the lowest seed
    print(f"wrote {written} and {png_path(written)}")


READ = ("benchmarks/results/cpu_corpora_quality_r64_*_lr0.5x*.json,"
        "benchmarks/results/cpu_corpora_exchanges_local_r64_probes.json")
"""`--part best-points`' default `--read`: the 64-round table's files and LoRDO-Local's K = 8 probes at 64 rounds."""


def local_corpus(path: Path) -> dict:
    """What a result records of a local corpus (`--corpus`), to tell which text it was: its path, and a file's
    size and sha256 (a folder's files are not hashed)."""
    import hashlib

    if not path.is_file():
        return {"path": str(path)}
    with path.open("rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": sha256}


def _host(result: dict) -> str:
    """The machine a result file ran on, as docs/results.md names hosts (CPU model, torch's kernels, the platform)."""
    m = result.get("machine", {})
    return f"{m.get('cpu_model', '?')} {m.get('torch_cpu_capability', '?')} {m.get('platform', '?')}"


def best_points(files: list[Path], rounds: int, reference: str | None = None) -> list[dict]:
    """`--part best-points` (read, not run): every run of `rounds` rounds with a validation curve in `files` (result
    files of this benchmark: tables and probe parts), its end and best point (`best_point`) and both gaps to low-rank
    DDP of the same corpus and seed (its trial `reference`, or its only trial in `files`), with the file, commit and
    host each came from. A run found in several files is taken from the last one read (`files` in order: a rerun
    after the file it replaces). Raises ValueError when low-rank DDP has several trials and `reference` is None."""
    runs: dict[tuple, dict] = {}
    for path in files:
        result = json.loads(path.read_text())
        if result.get("benchmark") != "corpora_quality":
            raise ValueError(f"{path}: a {result.get('benchmark')!r} result; expected a corpora_quality one")
        for r in result.get("rows", []):
            if r["rounds"] == rounds and r.get("curve", {}).get("val_loss"):
                best, at = best_point(r["curve"])
                runs[(r["corpus"], r["seed"], r["method"], r["trial"])] = {
                    "corpus": r["corpus"], "seed": r["seed"], "method": r["method"], "trial": r["trial"],
                    "rounds": rounds, "val_ppl": r["val_ppl"], "best_val_ppl": best, "best_tokens": at,
                    "file": str(path), "commit": result["code"]["commit"], "host": _host(result)}
    trials = sorted({k[3] for k in runs if k[2] == "lowrank_ddp"})
    if reference is None and len(trials) > 1:
        raise ValueError(f"low-rank DDP ran with trials {trials} in the files read; name the reference with "
                         "--best lowrank_ddp=TRIAL")
    reference = reference or (trials[0] if trials else None)
    rows = [runs[k] for k in sorted(runs)]
    for r in rows:
        ref = runs.get((r["corpus"], r["seed"], "lowrank_ddp", reference))
        if ref is not None:
            set_gap(r, ref, "gap_lowrank_ddp")
    return rows


def recorded_option(result: dict, key: str, flag: str, default: str) -> str:
    """An option of the run that wrote `result`: its config's `key` where it records one, else the value of
    `flag` in its command line (files written before the key was recorded), else `default`."""
    if key in result.get("config", {}):
        return str(result["config"][key])
    found = re.search(rf"(?:^|\s){re.escape(flag)}[= ](\S+)", result.get("command", ""))
    return found.group(1) if found else default


def reference_rows(files: list[Path], machine: dict, quick: bool, device: str, windows: str) -> dict[tuple, dict]:
    """`--reference`: the rows of committed result files of this benchmark by (corpus, method, trial, rounds,
    seed), each with `reference` = its file and commit, and `overrides` = the trial's overrides as the file
    records them (None where it does not) for `train` to compare with the trial it would run. A run found in
    several files is taken from the last. Raises ValueError naming the file when one is not a corpora_quality
    result, was --quick where this run is not (or the reverse), or ran on another host, device or
    eval windows than `machine` (`host_of`), `device` and `windows`: its runs would not be the runs this command
    trains."""
    mine = host_of(machine)
    found: dict[tuple, dict] = {}
    for path in files:
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"--reference {name}: not a readable JSON result ({err})") from None
        if result.get("benchmark") != "corpora_quality":
            raise ValueError(f"--reference {name}: a {result.get('benchmark')!r} result; expected a corpora_quality one")
        if bool(result.get("quick")) != quick:
            raise ValueError(f"--reference {name}: quick={bool(result.get('quick'))}, this run quick={quick}")
        require_host(host_of(result.get("machine", {})), mine, f"--reference {name}", "train the references here")
        for key, flag, default, here in (("device", "--device", "auto", device),
                                         ("eval_windows", "--eval-windows", "first", windows)):
            there = recorded_option(result, key, flag, default)
            if there != here:
                raise ValueError(f"--reference {name}: ran with {flag} {there}; this run has {flag} {here}")
        config = result.get("config", {})
        overrides = {(p["method"], p["name"]): tuple(p["overrides"]) for p in config.get("probes", [])
                     if "overrides" in p}
        # A table's config lists each method's trials; an early table file names only the trial it ran (a string),
        # and its rows carry their own overrides.
        overrides |= {(m, t["name"]): tuple(t["overrides"]) for m, ts in config.get("trials", {}).items()
                      if not isinstance(ts, str) for t in ts}
        local = config.get("local_corpora", {})
        commit = result.get("code", {}).get("commit")
        for r in result.get("rows", []):
            key = (r["corpus"], r["method"], r["trial"], r["rounds"], r["seed"])
            found[key] = {**r, "reference": {"file": name, "commit": commit},
                          "overrides": overrides.get((r["method"], r["trial"]),
                                                     tuple(r["overrides"]) if "overrides" in r else None),
                          "local_corpus": local.get(r["corpus"])}
    return found


def main() -> None:
    parser = make_parser("corpora_quality", __doc__, "tiny runs: two methods, two trials each, every corpus (seconds)")
    parser.add_argument("--part", default="all", choices=("all", "tune", "table", *PROBES, "best-points"),
                        help="tune: the trials at the first horizon, seed 0; table: each method's best everywhere; "
                        "early: the early-round probes (`EARLY`), first horizon, seed 0 (or --seeds); late: the late-round "
                        "probes (`LATE`), likewise (e.g. --horizons 64); workers: what four workers cost (`WORKERS`), likewise; "
                        "exchanges: more exchanges at the bytes of K = 32 (`EXCHANGES`), likewise; best-points: no run, "
                        "every run of the last horizon in --read, its end and best point and the gaps to low-rank DDP")
    parser.add_argument("--read", default=READ, help="best-points: comma-separated result files or glob patterns, read "
                        "in order (a run in several files is taken from the last), relative to the repository root")
    parser.add_argument("--corpora", default=",".join(CORPORA),
                        help=f"comma-separated, of {', '.join(CORPORA)} and the --corpus names: the probe parts' and "
                        "the table's (the tuning always runs on the shipped corpora)")
    parser.add_argument("--probes", default="", help="a probe part's probes to run, comma-separated, by name or by "
                        "the suffix added to the method's trial (e.g. k8-int8); low-rank DDP and LoRDO-Global's "
                        "K = 32 run always run (default: every probe)")
    parser.add_argument("--corpus", action="append", default=[], metavar="NAME=PATH",
                        help="a local corpus (a file or folder lordo_fed.data reads) under a name of its own, for "
                        "--corpora; e.g. code-large=/tmp/stdlib_large.txt from scripts/make_stdlib_corpus.py, which "
                        "64 rounds read less than once. A file's runs are cached under --work by its name and sha256, so "
                        "other text under the same name runs anew. Repeatable")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)} "
                        "(a probe part runs these methods' probes, and low-rank DDP's, every gap's reference)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds of the table (default 0,1) or of the "
                        "early, late, workers and exchanges parts (default 0)")
    parser.add_argument("--horizons", default=",".join(map(str, HORIZONS)),
                        help="comma-separated rounds of K = 32, the first the tuning horizon (e.g. 16: the table at the "
                        "first horizon only, from a device session cut short)")
    parser.add_argument("--work", default=None, help="folder of the per-run outputs (default: outputs/corpora_quality, "
                        "or a temporary one with --quick)")
    parser.add_argument("--eval-windows", default="first", choices=("first", "spread"),
                        help="which windows of each held-out split the validation passes read: its start (as the "
                        "committed figures were measured) or windows spread evenly over all of it (data.eval_windows; "
                        "on code-large the start is three files)")
    parser.add_argument("--fresh", action="store_true", help="rerun runs that already have a result in --work")
    parser.add_argument("--reference", default="", help="comma-separated result files of this benchmark or glob "
                        "patterns, relative to the repository root: a run they hold (the same corpus and its text, "
                        "method, trial and its overrides, rounds and seed) is read from them instead of trained, when "
                        "they ran on this host type, device and eval windows; its row names the file and commit "
                        "(e.g. a probe's low-rank DDP reference from an earlier part)")
    parser.add_argument("--best", default="", help="the table's trial of each method, skipping the tuning, e.g. "
                        "'lowrank_ddp=ef0.9,lordo_global=ef0.9' (the best of an earlier tuning: a device session "
                        "that has time for the table only)")
    parser.add_argument("--device", default="auto", help="the trainer's device: auto (CUDA when present), cpu, cuda")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process (every run "
                        "uses one torch thread whatever --jobs is, so the results do not depend on it)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected an int >= 1")
    import logging
    import tempfile

    logging.basicConfig(level=logging.WARNING)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        parser.error(f"--methods {args.methods!r}: expected some of {list(METHODS)}")
    missing = [str(p) for p in CORPORA.values() if not p.is_file()]
    if missing:
        parser.error(f"missing shipped corpora {missing}: reinstall the package (lordo_fed/corpora)")
    if args.part == "best-points":
        files = [Path(f) for pattern in args.read.split(",") if pattern
                 for f in (sorted(glob.glob(str(ROOT / pattern))) or [ROOT / pattern])]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            parser.error(f"--read {args.read!r}: no result file at {absent}")
        reference = dict(kv.split("=", 1) for kv in args.best.split(",") if "=" in kv).get("lowrank_ddp")
        rounds = int(args.horizons.split(",")[-1])
        try:
            rows = best_points(files, rounds, reference)
        except ValueError as err:
            parser.error(str(err))
        for r in rows:
            print(f"{r['corpus']:6} s{r['seed']} {r['method']:12} {r['trial']:32} end {r['val_ppl']:.3f} "
                  f"{r.get('gap_lowrank_ddp', math.nan):+6.1%}  best {r['best_val_ppl']:.3f} at "
                  f"{r['best_tokens'] / 2**20:4.0f} Mi {r.get('best_gap_lowrank_ddp', math.nan):+6.1%}  {r['host']}")
        result = result_header("corpora_quality", False, {
            "part": "best points", "rounds": rounds, "read": [str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else
                                                              str(f) for f in files],
            "how": "read, not run: every run of these rounds with a validation curve in the files read; best: "
                   "corpora_quality.best_point; the gaps against low-rank DDP of the same corpus and seed"})
        for r in rows:
            r["file"] = str(Path(r["file"]).relative_to(ROOT)) if Path(r["file"]).is_relative_to(ROOT) else r["file"]
        result["rows"] = rows
        print(f"wrote {write_json(result, args.out)}")
        return
    probing = args.part in PROBES
    if args.probes and not probing:
        parser.error(f"--probes {args.probes!r} with --part {args.part}: expected a probe part, one of {list(PROBES)}")
    try:
        seeds = [int(s) for s in (args.seeds or ("0" if probing else "0,1")).split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds {args.seeds!r}: expected distinct comma-separated ints >= 0, e.g. 0,1")
    try:
        horizons = tuple(int(h) for h in args.horizons.split(","))
    except ValueError:
        horizons = ()
    if not horizons or min(horizons) < 1 or list(horizons) != sorted(set(horizons)):
        parser.error(f"--horizons {args.horizons!r}: expected increasing comma-separated rounds >= 1, e.g. 16,64")
    if args.quick:  # one seed unless asked for more
        methods = [m for m in methods if m in ("lowrank_ddp", "lordo_global")] or methods[:1]
        seeds = seeds if args.seeds else [0]
    horizons = (1, 2) if args.quick else horizons
    trials = {m: TRIALS[m][:2] if args.quick else TRIALS[m] for m in methods}
    work = Path(args.work) if args.work else (Path(tempfile.mkdtemp(prefix="corpora-")) if args.quick
                                              else ROOT / "outputs" / "corpora_quality")
    base = (*(QUICK_OVERRIDES if args.quick else ()), "threads=1", f"device={args.device}",
            *((SPREAD,) if args.eval_windows == "spread" else ()))
    started = time.perf_counter()

    def train(runs: list[tuple[str, str, Trial, int, int]]) -> list[dict]:
        """The rows of `runs` in order: read from --reference where it holds the run, trained (or read from the
        cache under --work) otherwise."""
        rows: dict[int, dict] = {}
        for i, (c, m, t, h, s) in enumerate(runs):
            ref = references.get((c, m, t.name, h, s))
            if ref is None:
                continue
            if ref["overrides"] != t.overrides:
                parser.error(f"--reference {ref['reference']['file']}: its {m} trial {t.name!r} has overrides "
                             f"{ref['overrides']}; this one has {t.overrides}")
            if c in local and (ref["local_corpus"] or {}).get("sha256") != local[c].get("sha256"):
                parser.error(f"--reference {ref['reference']['file']}: its corpus {c!r} is other text than "
                             f"{paths[c]} (sha256 {(ref['local_corpus'] or {}).get('sha256')} against "
                             f"{local[c].get('sha256')})")
            rows[i] = {k: v for k, v in ref.items() if k not in ("overrides", "local_corpus")}
            print(f"{c}_{m}_{t.name}_R{h}_s{s}: val ppl {ref['val_ppl']:.3f} (from {ref['reference']['file']})")
        specs = [(c, paths[c], m, t, h, s, args.quick, work, args.fresh, base)
                 for i, (c, m, t, h, s) in enumerate(runs) if i not in rows]
        if args.jobs == 1 or len(specs) < 2:
            trained = [_train(spec) for spec in specs]
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                trained = list(pool.map(_train, specs))
        fresh = iter(trained)
        return [rows[i] if i in rows else next(fresh) for i in range(len(runs))]

    paths = dict(CORPORA)
    for entry in args.corpus:
        name, _, path = entry.partition("=")
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name) or not path or name in CORPORA:
            parser.error(f"--corpus {entry!r}: expected NAME=PATH, NAME of lower-case letters, digits, - and _ "
                         f"and none of the shipped {list(CORPORA)}")
        if not Path(path).exists():
            parser.error(f"--corpus {entry!r}: no file or folder at {path} (scripts/make_stdlib_corpus.py makes "
                         "a large code corpus)")
        paths[name] = Path(path).resolve()
    local = {c: local_corpus(paths[c]) for c in paths if c not in CORPORA}
    reference_files = [Path(f) for pattern in args.reference.split(",") if pattern
                       for f in (sorted(glob.glob(str(ROOT / pattern))) or [ROOT / pattern])]
    absent = [str(f) for f in reference_files if not f.is_file()]
    if absent:
        parser.error(f"--reference {args.reference!r}: no result file at {absent}")
    try:
        references = reference_rows(reference_files, machine_info(), args.quick, args.device, args.eval_windows)
    except ValueError as err:
        parser.error(str(err))
    recorded = {"device": args.device, "eval_windows": args.eval_windows,
                "references": [str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f) for f in reference_files]}
    corpora = tuple(c for c in args.corpora.split(",") if c)
    if not corpora or any(c not in paths for c in corpora):
        parser.error(f"--corpora {args.corpora!r}: expected some of {list(paths)}")
    if probing:
        default = str(Path(parser.get_default("out")))
        out = args.out.replace(".json", f"_{args.part}.json") if args.out == default else args.out
        wanted = [n for n in args.probes.split(",") if n]
        only = tuple(t.name for _, t in PROBES[args.part] if any(probe_named(t, n) for n in wanted))
        unknown = [n for n in wanted if not any(probe_named(t, n) for _, t in PROBES[args.part])]
        if unknown:
            parser.error(f"--probes {args.probes!r}: no probe of --part {args.part} named {unknown}; its probes: "
                         f"{[t.name for _, t in PROBES[args.part]]}")
        early(train, horizons[0], out, args.quick, args.part, corpora, tuple(seeds), tuple(methods), local, only,
              recorded)
        return
    given = parse_best(args.best, methods, trials) if args.best else None
    if isinstance(given, str):
        parser.error(given)
    tuned = [] if given else train([(c, m, t, horizons[0], 0) for m in methods for t in trials[m] for c in CORPORA])
    best = given or best_trials(tuned, methods)
    result = result_header("corpora_quality", args.quick, {
        "base": f"examples/reference/{CONFIG}.yaml" + (" + " + " ".join(QUICK_OVERRIDES) if args.quick else ""),
        "corpora": {k: str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
                    for k, p in paths.items() if k in corpora or (not given and k in CORPORA)},
        "local_corpora": local, **recorded,
        "methods": methods,
        "horizons": list(horizons), "seeds": seeds,
        "trials": {m: [{"name": t.name, "overrides": list(t.overrides)} for t in trials[m]] for m in methods}})
    result.update(tuning=[{k: v for k, v in r.items() if k != "curve"} for r in tuned], best=best,
                  best_given=bool(given),
                  tuning_mean_loss={m: {t.name: mean_loss([r for r in tuned if r["method"] == m and r["trial"] == t.name])
                                        for t in trials[m]} for m in methods} if tuned else {})
    write_json({**result, "seconds": time.perf_counter() - started}, args.out)  # a cut-short run keeps the tuning
    rows = []
    if args.part != "tune":
        by_name = {m: {t.name: t for t in trials[m]} for m in methods}
        rows = train([(c, m, by_name[m][best[m]], h, s) for h in horizons for s in seeds for m in methods for c in corpora])
        gaps(rows)
        result.update(rows=rows, goal=goal(rows, horizons))
        print(table_text(rows, horizons))
    result["seconds"] = time.perf_counter() - started
    out = write_json(result, args.out)
    if rows:
        plot(rows, png_path(out), horizons[-1])
    print("best trials (mean validation loss over the corpora): " + ", ".join(f"{m} {t}" for m, t in best.items()))
    print(f"wrote {out}" + (f" and {png_path(out)}" if rows else ""))


if __name__ == "__main__":
    main()
