"""Benchmarks are not tests, but their --quick modes run here so they cannot rot: most in the extended lane
(`-m extended`, run it when you change a benchmark), the cheap ones in the CI lane too."""

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, tmp_path: Path, *args: str, timeout: float = 300, **extra_env: str) -> dict:
    """Run `benchmarks/<script> --quick --out <tmp_path>/<stem>.json [args]` (environment plus `extra_env`);
    returns the result, checked to be a quick one that names its torch."""
    out = tmp_path / f"{Path(script).stem}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", **extra_env)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True and result["machine"]["torch"] and result["machine"]["torch_cpu_capability"]
    return result


def test_client_state_quick(tmp_path):
    result = run_quick("client_state.py", tmp_path)
    (row,) = result["rows"]
    assert row["state_bytes"] > 0 and row["disk_per_round_s"] > 0 and row["context_per_round_s"] > 0


@pytest.mark.extended
def test_quality_quick(tmp_path):
    result = run_quick("quality.py", tmp_path)
    runs = result["runs"]
    assert {r["group"] for r in runs.values()} == {"baseline", "rank", "K", "MxB", "projection", "error feedback"}
    assert len({r["tokens"] for r in runs.values()}) == 1, "every run must see the same tokens"
    g, ref = runs["rank8_lordo_global"], runs["rank8_lowrank_ddp"]
    assert g["gap_to_lowrank_ddp"] == pytest.approx(g["val_ppl"] / ref["val_ppl"] - 1)
    assert runs["K2_lordo_global"]["K"] == 2 and runs["M2xB8_lordo_local"]["M"] == 2
    assert runs["proj_dct_lordo_global"]["proj_method"] == "dct"
    # The stagnation diagnostic: without the QH term every low-rank update lies in the shared
    # subspace, so all of ||Δ̄||² is inside it; with ω < 1 the full-rank term leaves part outside.
    with_qh, without = g["diagnostics"], runs["rank8_lordo_global_omega1"]["diagnostics"]
    assert len(with_qh["delta_stable_rank"]) == len(with_qh["round"]) == 2
    assert min(without["delta_in_subspace"]) > 0.999
    assert max(with_qh["delta_in_subspace"]) < 0.99
    assert Path(tmp_path / "quality.png").stat().st_size > 10_000
    # the error-feedback diagnostics of the trainer: ‖U_out‖/‖U_in‖ per round, lower with the
    # full-rank term on G than on G + E (the build-up of E inside a round)
    fr_grad = runs["fr_grad_lordo_global"]["diagnostics"]
    assert len(with_qh["update_out_in_ratio"]) == len(fr_grad["update_out_in_ratio"]) == len(with_qh["ef_norm"]) == 2
    assert fr_grad["update_out_in_ratio_last"][-1] < with_qh["update_out_in_ratio_last"][-1]
    assert all(r == 0 for r in without["update_out_in_ratio"])  # ω = 1: nothing outside the subspace


def test_a_benchmark_run_killed_part_way_continues_from_its_checkpoint(tmp_path):
    """`quality.execute` (every quality benchmark's runs) checkpoints a run every `CHECKPOINT_EVERY` rounds: a
    run killed after one continues from it when the benchmark starts again and ends with the uninterrupted run's
    curve to the bit; the checkpoints go once its result is written."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quality import CHECKPOINT_EVERY, Run, compose, execute

    from lordo_fed.data import load_dataset
    from lordo_fed.device import pick_device
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.trainer.run import RunContext, run_method

    run = Run("resume", "test", "lordo_global", ("total_steps=40",))  # quick: 10 rounds of K = 4
    whole = execute(run, True, tmp_path / "whole", False)
    out = tmp_path / "killed" / run.label
    cfg = compose(run, True, out)
    cfg.checkpoint_every = CHECKPOINT_EVERY

    class Killed(Exception):
        pass

    def emit(record: dict) -> None:  # killed as it records the round after the checkpoint of round 8
        if record.get("round") == CHECKPOINT_EVERY + 1 and "train_loss" in record:
            raise Killed

    dataset = load_dataset(cfg.data, cfg.workers)
    ctx = RunContext(cfg, dataset, pick_device(cfg.device), dataset.val_batches(cfg.eval_batches), emit)
    with pytest.raises(Killed):
        run_method(ctx, resolve_method(run.method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer,
                                            cfg.total_steps))
    assert (out / "checkpoints" / run.method / "latest.json").exists()
    continued = execute(run, True, tmp_path / "killed", False)
    assert (whole["resumed_from_round"], continued["resumed_from_round"]) == (0, CHECKPOINT_EVERY)
    assert continued["curve"] == whole["curve"] and len(whole["curve"]["val_loss"]) == 11
    assert (continued["val_loss"], continued["tokens"]) == (whole["val_loss"], whole["tokens"])
    assert not (out / "checkpoints").exists() and not (tmp_path / "whole" / run.label / "checkpoints").exists()


@pytest.mark.extended
def test_corpora_quality_quick(tmp_path):
    result = run_quick("corpora_quality.py", tmp_path, "--jobs", "2", "--work", str(tmp_path / "work"))
    tuning, rows, best = result["tuning"], result["rows"], result["best"]
    corpora, methods = set(result["config"]["corpora"]), ["lowrank_ddp", "lordo_global"]
    assert corpora == {"verse", "code", "prose"} and result["config"]["methods"] == methods
    # every trial of every method ran on every corpus at the tuning horizon, at equal tokens
    assert {(r["method"], r["trial"], r["corpus"]) for r in tuning} == {
        (m, t["name"], c) for m in methods for t in result["config"]["trials"][m] for c in corpora}
    assert len({r["tokens"] for r in tuning}) == 1 and len({round(r["val_ppl"], 6) for r in tuning}) == len(tuning)
    for m in methods:  # the best trial has the lowest mean validation loss over the corpora, no corpus alone
        means = {t: sum(r["val_loss"] for r in tuning if r["method"] == m and r["trial"] == t) / 3
                 for t in {r["trial"] for r in tuning if r["method"] == m}}
        assert best[m] == min(means, key=means.get) and result["tuning_mean_loss"][m] == pytest.approx(means)
    # the table: each method's best trial on every corpus at both horizons; its first horizon is the tuning run
    assert {(r["method"], r["trial"], r["corpus"], r["rounds"]) for r in rows} == {
        (m, best[m], c, h) for m in methods for c in corpora for h in (1, 2)}
    tuned = {(r["method"], r["trial"], r["corpus"]): r["val_ppl"] for r in tuning}
    for r in rows:
        if r["rounds"] == 1:
            assert r["val_ppl"] == tuned[(r["method"], r["trial"], r["corpus"])]
        if r["method"] == "lordo_global":
            ref = next(o for o in rows if (o["method"], o["corpus"], o["rounds"]) == ("lowrank_ddp", r["corpus"], r["rounds"]))
            assert r["gap_lowrank_ddp"] == pytest.approx(r["val_ppl"] / ref["val_ppl"] - 1)
            assert 0 < r["bytes_per_worker"] < ref["bytes_per_worker"]  # LoRDO sends less than low-rank DDP
        assert r["curve"]["bytes"] == sorted(r["curve"]["bytes"]) and r["curve"]["bytes"][-1] == r["bytes_per_worker"]
    assert {r["tokens"] for r in rows if r["rounds"] == 2} == {2 * rows[0]["tokens"]}
    assert set(result["goal"]) == {"lordo_global_within_3pct_short", "lordo_global_within_1pct_long",
                                   "lordo_global_beats_diloco_long"}
    assert result["goal"]["lordo_global_beats_diloco_long"] is False  # DiLoCo did not run: nothing to beat
    assert Path(tmp_path / "corpora_quality.png").stat().st_size > 10_000
    # --jobs 2 ran the runs in a process pool: one of them again here, alone, gives the same loss to the bit
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from corpora_quality import TRIALS, _train
    from quality import QUICK_OVERRIDES

    trial = TRIALS["lordo_global"][1]
    alone = _train(("prose", None, "lordo_global", trial, 1, 0, True, tmp_path / "alone", False,
                    (*QUICK_OVERRIDES, "threads=1")))
    pooled = next(r for r in tuning if (r["method"], r["trial"], r["corpus"]) == ("lordo_global", trial.name, "prose"))
    assert alone["val_loss"] == pooled["val_loss"] and alone["bytes_per_worker"] == pooled["bytes_per_worker"]
    # --part early on two seeds: the probes on every corpus and seed, the tune's own runs (seed 0) taken from the
    # cache, each gap to low-rank DDP of the same corpus and seed, and their curves beside the JSON
    (tmp_path / "corpora_quality.png").unlink(missing_ok=True)
    early = run_quick("corpora_quality.py", tmp_path, "--part", "early", "--seeds", "0,1",
                      "--work", str(tmp_path / "work"))["rows"]
    assert (tmp_path / "corpora_quality.png").stat().st_size > 0
    assert sorted((r["method"], r["trial"], r["corpus"], r["seed"]) for r in early) == sorted(
        (m, t, c, s) for m, t in (("lowrank_ddp", "ef0.9"), ("lordo_global", "ef0.9"), ("lordo_global", "ef0.9-wu128"))
        for c in corpora for s in (0, 1))
    for r in early:
        ref = next(o for o in early if (o["method"], o["trial"], o["corpus"], o["seed"]) ==
                   ("lowrank_ddp", "ef0.9", r["corpus"], r["seed"]))
        assert r["gap_lowrank_ddp"] == pytest.approx(r["val_ppl"] / ref["val_ppl"] - 1)
        if r["trial"] == "ef0.9" and r["seed"] == 0:
            assert r["val_ppl"] == tuned[(r["method"], r["trial"], r["corpus"])]
    other = {(r["method"], r["trial"], r["corpus"]): r["val_ppl"] for r in early if r["seed"] == 1}
    assert all(other[(r["method"], r["trial"], r["corpus"])] != r["val_ppl"] for r in early if r["seed"] == 0)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "corpora_quality.py"), "--part", "early",
                          "--seeds", "0,x"], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--seeds '0,x': expected distinct comma-separated ints >= 0" in bad.stderr
    # a local corpus (--corpus NAME=PATH): the probes train on its text, and the result names the file
    text = (ROOT / "lordo_fed" / "corpora" / "python_docs.txt").read_bytes()[-300_000:]
    (tmp_path / "local.txt").write_bytes(text)
    local = run_quick("corpora_quality.py", tmp_path, "--part", "early", "--corpus", f"tail={tmp_path / 'local.txt'}",
                      "--corpora", "tail,prose", "--work", str(tmp_path / "work"))
    assert local["config"]["local_corpora"] == {"tail": {"path": str(tmp_path / "local.txt"), "bytes": len(text),
                                                         "sha256": hashlib.sha256(text).hexdigest()}}
    ppl = {(r["corpus"], r["method"], r["trial"]): r["val_ppl"] for r in local["rows"]}
    assert {c for c, _, _ in ppl} == {"tail", "prose"}
    for (c, m, t), v in ppl.items():  # prose from the cache; the tail of its text is other text
        if c == "prose":
            assert v == next(r["val_ppl"] for r in early if (r["corpus"], r["method"], r["trial"], r["seed"]) ==
                             ("prose", m, t, 0))
        else:
            assert v != ppl[("prose", m, t)]
    # other text under the same name and --work runs anew (the cache knows a file by its sha256), not from the cache
    (tmp_path / "local.txt").write_bytes(text[:200_000])
    other = run_quick("corpora_quality.py", tmp_path, "--part", "early", "--corpus", f"tail={tmp_path / 'local.txt'}",
                      "--corpora", "tail", "--work", str(tmp_path / "work"))
    assert other["config"]["local_corpora"]["tail"]["bytes"] == 200_000
    assert all(r["val_ppl"] != ppl[("tail", r["method"], r["trial"])] for r in other["rows"])
    assert len({p.name.split("_")[0] for p in (tmp_path / "work").glob("tail-*")}) == 2
    # --eval-windows spread: the same runs validated on windows spread over the split, cached apart from the others
    spread = run_quick("corpora_quality.py", tmp_path, "--part", "early", "--corpus", f"tail={tmp_path / 'local.txt'}",
                       "--corpora", "tail", "--eval-windows", "spread", "--work", str(tmp_path / "work"))
    assert all(r["val_ppl"] != o["val_ppl"] for r, o in zip(spread["rows"], other["rows"]))
    assert {(r["method"], r["trial"]) for r in spread["rows"]} == {(r["method"], r["trial"]) for r in other["rows"]}
    assert len(list((tmp_path / "work").glob("tail-*-spread_*"))) == len(spread["rows"])
    for args, expected in ((("--corpus", "prose=/tmp"), "none of the shipped"),
                           (("--corpus", f"x={tmp_path / 'absent.txt'}"), "no file or folder at"),
                           (("--corpus", f"x={tmp_path / 'local.txt'}", "--corpora", "y"), "expected some of")):
        bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "corpora_quality.py"), "--part", "early", *args],
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                             timeout=120)
        assert bad.returncode == 2 and expected in bad.stderr, bad.stderr


def test_corpora_quality_reads_committed_runs_instead_of_training_them(tmp_path):
    """--reference: a second probe part over seeds 0 and 1 reads seed 0 from the first part's result file, row for
    row as that part trained it, and trains seed 1 only; a file from another host, another trial or other eval
    windows is refused by name."""
    first = run_quick("corpora_quality.py", tmp_path, "--part", "early", "--corpora", "verse",
                      "--work", str(tmp_path / "w1"))
    (tmp_path / "first.json").write_text(json.dumps(first))
    assert {r["commit"] for r in first["rows"]} == {first["code"]["commit"]}  # each run names its code
    second = run_quick("corpora_quality.py", tmp_path, "--part", "early", "--corpora", "verse", "--seeds", "0,1",
                       "--reference", str(tmp_path / "first.json"), "--work", str(tmp_path / "w2"))
    assert second["config"]["references"] == [str(tmp_path / "first.json")]
    assert second["config"]["device"] == "auto" and second["config"]["eval_windows"] == "first"
    read = [r for r in second["rows"] if r["seed"] == 0]
    assert len(read) == len(first["rows"]) == 3
    for r, o in zip(read, first["rows"]):
        assert r["reference"] == {"file": str(tmp_path / "first.json"), "commit": first["code"]["commit"]}
        assert {k: v for k, v in r.items() if k != "reference"} == o  # the same run, curve and gaps included
    trained = sorted(p.name for p in (tmp_path / "w2").iterdir())
    assert len(trained) == 3 and all(name.endswith("_s1") for name in trained)
    assert all("reference" not in r and r["seed"] == 1 for r in second["rows"][3:])

    def refused(result: dict, *args: str) -> str:
        (tmp_path / "bad.json").write_text(json.dumps(result))
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "corpora_quality.py"), "--quick", "--part",
                               "early", "--corpora", "verse", "--reference", str(tmp_path / "bad.json"),
                               "--work", str(tmp_path / "w3"), "--out", str(tmp_path / "bad_out.json"), *args],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                              timeout=120)
        assert proc.returncode == 2 and not (tmp_path / "w3").exists(), proc.stderr
        return proc.stderr

    assert "measured on {'cpu_model': 'Other CPU'" in refused(
        {**first, "machine": {**first["machine"], "cpu_model": "Other CPU"}})
    changed = json.loads(json.dumps(first))
    changed["config"]["probes"][1]["overrides"] = ["inner.ef_decay=0.5"]
    assert f"its lordo_global trial {first['rows'][1]['trial']!r} has overrides ('inner.ef_decay=0.5',)" in refused(
        changed)
    # An early table file: its config names each method's one trial, its rows carry their own overrides.
    early = json.loads(json.dumps(first))
    probes = {(q["method"], q["name"]): q["overrides"] for q in first["config"]["probes"] if "overrides" in q}
    early["config"] = {"part": "table", "trials": {r["method"]: r["trial"] for r in first["rows"]}}
    for r in early["rows"]:
        r["overrides"] = probes.get((r["method"], r["trial"]), [])
    early["rows"][1]["overrides"] = ["inner.ef_decay=0.5"]
    assert f"its lordo_global trial {first['rows'][1]['trial']!r} has overrides ('inner.ef_decay=0.5',)" in refused(
        early)
    assert "ran with --eval-windows first; this run has --eval-windows spread" in refused(
        first, "--eval-windows", "spread")
    assert "quick=False, this run quick=True" in refused({**first, "quick": False})
    assert "expected a corpora_quality one" in refused({**first, "benchmark": "quality"})


def test_corpora_quality_trials_and_goal():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from corpora_quality import PROBES, TRIALS, Trial, gaps, goal, parse_best

    assert len({len(t) for t in TRIALS.values()}) == 1, "every method gets the same budget of trials"
    for probes in PROBES.values():  # a run is cached by method and trial name: one name, one setting
        settings = {(m, t.name): t.overrides for m, t in probes}
        assert len(settings) == len(probes)
        assert all(settings[(m, t.name)] == t.overrides for m in TRIALS for t in TRIALS[m] if (m, t.name) in settings)
        assert probes[0][0] == "lowrank_ddp" and probes[1][0] == "lordo_global"  # the gaps' references
    assert Trial("s", ("inner.switch_step={half}", "inner.lr=0.01")).resolved(512) == ("inner.switch_step=256", "inner.lr=0.01")
    rows = [{"corpus": c, "rounds": h, "seed": 0, "method": m, "val_ppl": p, "bytes_per_worker": b}
            for c, h, m, p, b in [("verse", 16, "lowrank_ddp", 10.0, 1000), ("verse", 16, "lordo_global", 10.25, 100),
                                  ("verse", 64, "lowrank_ddp", 5.0, 4000), ("verse", 64, "lordo_global", 5.04, 400),
                                  ("verse", 64, "diloco", 5.1, 4000)]]
    gaps(rows)
    g16, g64 = rows[1], rows[3]
    assert g16["gap_lowrank_ddp"] == pytest.approx(0.025) and g64["gap_lowrank_ddp"] == pytest.approx(0.008)
    assert g64["gap_diloco"] == pytest.approx(5.04 / 5.1 - 1) and g64["bytes_vs_diloco"] == 10
    assert "gap_lowrank_ddp" not in rows[0] and "gap_diloco" not in g16  # no DiLoCo run at 16 rounds
    assert goal(rows, (16, 64)) == {"lordo_global_within_3pct_short": True, "lordo_global_within_1pct_long": True,
                                    "lordo_global_beats_diloco_long": True}
    g64["val_ppl"] = 5.06  # 1.2% behind low-rank DDP
    gaps(rows)
    assert goal(rows, (16, 64))["lordo_global_within_1pct_long"] is False
    assert "best_gap_lowrank_ddp" not in g64  # rows without a best point (no curve): no gap at it
    # the first horizon alone (--horizons 16): the long-horizon goals were not measured, so not reported
    assert goal(rows, (16,)) == {"lordo_global_within_3pct_short": True}
    # the long horizon alone (--horizons 64): its goals only, never the short one's bound
    assert goal(rows, (64,)) == {"lordo_global_within_1pct_long": False, "lordo_global_beats_diloco_long": True}
    # each method's fifth trial is its best of the first four (docs/results.md, section 17) at half the lr,
    # the sixth at a quarter
    for m, best in (("lowrank_ddp", "ef0.9"), ("lordo_global", "ef0.9"), ("lordo_local", "ef1-switch")):
        four = {t.name: t for t in TRIALS[m][:4]}
        assert TRIALS[m][4].overrides == (*four[best].overrides, "inner.lr=0.004")
        assert TRIALS[m][5].overrides == (*four[best].overrides, "inner.lr=0.002")
    # --best: the table's trials without a tuning; a bad value names itself and what was expected
    methods = ["lowrank_ddp", "lordo_global"]
    assert parse_best("lowrank_ddp=ef0.9,lordo_global=ef1-switch", methods, TRIALS) == {
        "lowrank_ddp": "ef0.9", "lordo_global": "ef1-switch"}
    assert "expected one of lowrank_ddp's trials" in parse_best("lowrank_ddp=ef2,lordo_global=ef1", methods, TRIALS)
    assert "expected a method among" in parse_best("adam=lr1", methods, {m: TRIALS[m] for m in methods})
    assert "no trial for ['lordo_global']" in parse_best("lowrank_ddp=ef0.9", methods, TRIALS)
    # --probes picks a probe by its whole name or by the suffix added to its method's trial
    from corpora_quality import EXCHANGES, probe_named

    def picked(name: str) -> list[str]:
        return [t.name for _, t in EXCHANGES if probe_named(t, name)]

    assert picked("k8-int8") == ["ef0.9-lr0.5x-k8-int8", "ef1-switch-lr0.5x-k8-int8"]
    assert picked("k8") == ["ef0.9-lr0.5x-k8", "ef1-switch-lr0.5x-k8"]  # not the ...-k8-int8 ones
    assert picked("ef1-switch-lr0.5x") == ["ef1-switch-lr0.5x"] and picked("lr0.5x-k8-int8-p32") == [
        "ef1-switch-lr0.5x-k8-int8-p32"] and picked("k32") == []
    late = picked("late-outer2")  # the late outer lr from WSD's decay on: step 1,638 of 2,048
    assert late == ["ef0.9-lr0.5x-k8-int8-late-outer2", "ef1-switch-lr0.5x-k8-int8-late-outer2"]
    assert "rounds.late_from_step=1638" in next(t for _, t in EXCHANGES if t.name == late[0]).resolved(2048)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "corpora_quality.py"), "--part", "exchanges",
                          "--probes", "k8-int8,k64"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "no probe of --part exchanges named ['k64']" in bad.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "corpora_quality.py"), "--part", "table",
                          "--probes", "k8-int8"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--probes 'k8-int8' with --part table: expected a probe part" in bad.stderr


def test_corpora_quality_best_point_and_its_gap():
    """A run's lowest validation perplexity among its evaluations at each eighth of its tokens (a finer
    evaluation grid does not count), and the gap at each run's own best point beside the gap at the end."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from corpora_quality import best_point, gaps, row_of

    def curve(tokens, ppls):
        return {"tokens": tokens, "val_loss": [math.log(p) for p in ppls], "bytes": [0] * len(tokens)}

    ref = curve([0, 100, 200, 300, 400, 500, 600, 700, 800], [50, 9, 7, 6, 5.5, 5.0, 5.2, 5.4, 5.6])
    assert best_point(ref) == (pytest.approx(5.0), 500)
    # evaluated every 50 tokens: its 4.0 at token 450 is off the eighths' grid and does not count
    fine = curve([0, *range(50, 801, 50)], [50, *([6.0] * 8), 4.0, 5.25, *([6.0] * 6)])
    assert best_point(fine) == (pytest.approx(5.25), 500)
    assert best_point(curve([0, 3], [9.0, 8.0])) == (math.inf, 0)  # no eighth of 3 tokens: no best point
    rows = [row_of({"method": m, "val_loss": c["val_loss"][-1], "val_ppl": math.exp(c["val_loss"][-1]), "curve": c,
                    "wall_seconds": 1.0}, "code", "t", 64, 0)
            for m, c in (("lowrank_ddp", ref), ("lordo_local", fine))]
    assert rows[1]["best_val_ppl"] == pytest.approx(5.25) and rows[1]["best_tokens"] == 500
    gaps(rows)
    assert rows[1]["gap_lowrank_ddp"] == pytest.approx(6.0 / 5.6 - 1)  # at the end
    assert rows[1]["best_gap_lowrank_ddp"] == pytest.approx(5.25 / 5.0 - 1)  # each at its own best


def test_corpora_quality_best_points_reads_result_files(tmp_path):
    """`--part best-points` runs nothing: it reads the runs of one horizon from result files, takes a run found twice
    from the later file, and gives each its end and best-point gaps to low-rank DDP of the same corpus and seed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from corpora_quality import best_points

    def curve(ppls):  # evaluated at each eighth of 800 tokens
        return {"tokens": list(range(0, 801, 100)), "val_loss": [math.log(p) for p in ppls], "bytes": [0] * 9}

    def row(method, trial, seed, ppls, rounds=64):
        return {"corpus": "code", "method": method, "trial": trial, "rounds": rounds, "seed": seed,
                "val_ppl": ppls[-1], "curve": curve(ppls)}

    def write(name, rows, commit):
        path = tmp_path / name
        path.write_text(json.dumps({"benchmark": "corpora_quality", "code": {"commit": commit},
                                    "machine": {"cpu_model": "cpu", "torch_cpu_capability": "AVX2"}, "rows": rows}))
        return path

    ref = [50, 9, 7, 6, 5.5, 5.0, 5.2, 5.4, 5.6]  # best 5.0 at 500 tokens, end 5.6
    first = write("a.json", [row("lowrank_ddp", "ref", 0, ref), row("lordo_local", "k32", 0, [50, *[6.0] * 8]),
                             row("lordo_local", "k32", 0, [50, *[9.0] * 8], rounds=16)], "aaa")
    rerun = write("b.json", [row("lordo_local", "k32", 0, [50, 8, 7, 6, 5.5, 5.25, 5.5, 5.8, 6.16])], "bbb")
    rows = {r["method"]: r for r in best_points([first, rerun], 64)}
    assert len(rows) == 2  # the 16-round run is another horizon
    local = rows["lordo_local"]
    assert (local["file"], local["commit"], local["host"]) == (str(rerun), "bbb", "cpu AVX2 ?")  # the later file's run
    assert local["gap_lowrank_ddp"] == pytest.approx(6.16 / 5.6 - 1)
    assert local["best_val_ppl"] == pytest.approx(5.25) and local["best_tokens"] == 500
    assert local["best_gap_lowrank_ddp"] == pytest.approx(5.25 / 5.0 - 1)
    assert rows["lowrank_ddp"]["gap_lowrank_ddp"] == 0.0
    # two low-rank DDP trials: the reference must be named
    other = write("c.json", [row("lowrank_ddp", "other", 0, [50, *[4.0] * 8])], "ccc")
    with pytest.raises(ValueError, match=r"trials \['other', 'ref'\]"):
        best_points([first, other], 64)
    named = {r["trial"]: r for r in best_points([first, other], 64, reference="other")}
    assert named["k32"]["gap_lowrank_ddp"] == pytest.approx(6.0 / 4.0 - 1)
    foreign = tmp_path / "d.json"
    foreign.write_text(json.dumps({"benchmark": "quality", "rows": []}))
    with pytest.raises(ValueError, match="a 'quality' result; expected a corpora_quality one"):
        best_points([foreign], 64)


def test_corpora_quality_probe_part_runs_the_given_methods(tmp_path):
    """--methods narrows a probe part to those methods' probes, low-rank DDP (every gap's reference) always kept;
    without LoRDO-Global's K = 32 run there is no bytes ratio to it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from corpora_quality import EXCHANGES, best_points, early

    asked: list[tuple] = []

    def train(runs):  # a fake trainer: perplexity and bytes made from the run's place in EXCHANGES, as `row_of` has them
        asked.extend(runs)
        order = [(m, t.name) for m, t in EXCHANGES]
        rows = [{"corpus": c, "seed": s, "method": m, "trial": t.name, "rounds": h,
                 "val_ppl": 4.0 + order.index((m, t.name)) / 10 + s, "bytes_per_worker": 100 * (1 + order.index((m, t.name)))}
                for c, m, t, h, s in runs]
        for r in rows:
            r["curve"] = {"tokens": [0, 64], "val_loss": [5.5, math.log(r["val_ppl"])], "bytes": [0, r["bytes_per_worker"]]}
        return rows

    early(train, 16, str(tmp_path / "x.json"), False, "exchanges", ("code",), (0, 1), ("lordo_local",))
    assert [(m, t.name, s) for _, m, t, _, s in asked] == [(m, t.name, s) for s in (0, 1) for m, t in EXCHANGES
                                                           if m in ("lowrank_ddp", "lordo_local")]
    rows = json.loads((tmp_path / "x.json").read_text())["rows"]
    assert (tmp_path / "x.png").stat().st_size > 0 and all(r["curve"]["val_loss"] for r in rows)
    local_k8 = next(r for r in rows if r["trial"] == "ef1-switch-lr0.5x-k8-int8" and r["seed"] == 1)
    assert local_k8["gap_lowrank_ddp"] == pytest.approx(5.6 / 5.0 - 1) and local_k8["bytes_vs_k32"] is None
    # the rows keep their curves, so `--part best-points` reads a probe part's file: every run, the same end gaps
    read = {(r["trial"], r["seed"]): r for r in best_points([tmp_path / "x.json"], 16)}
    assert set(read) == {(r["trial"], r["seed"]) for r in rows}
    assert read[("ef1-switch-lr0.5x-k8-int8", 1)]["gap_lowrank_ddp"] == pytest.approx(local_k8["gap_lowrank_ddp"])
    asked.clear()  # every method: the bytes against LoRDO-Global's K = 32 run (EXCHANGES' second)
    early(train, 16, str(tmp_path / "y.json"), False, "exchanges", ("code",), (0,))
    assert len(asked) == len(EXCHANGES)
    rows = json.loads((tmp_path / "y.json").read_text())["rows"]
    assert next(r for r in rows if r["trial"] == "ef1-switch-lr0.5x-k8-int8")["bytes_vs_k32"] == pytest.approx(7 / 2)


@pytest.mark.extended
def test_long_horizon_quick(tmp_path):
    result = run_quick("long_horizon.py", tmp_path)
    runs, gaps, summary = result["runs"], result["gaps"], result["summary"]
    assert set(runs) == {f"{v}_s{s}" for v in ("lowrank_ddp", "global", "local") for s in (0, 1)}
    assert len({r["tokens"] for r in runs.values()}) == 1, "every run must see the same tokens"
    for s in (0, 1):  # the gap at the end is the ratio of the perplexities of the same seed
        g, ref = runs[f"global_s{s}"], runs[f"lowrank_ddp_s{s}"]
        assert gaps["global"]["per_seed"][str(s)][-1] == pytest.approx(g["val_ppl"] / ref["val_ppl"] - 1, rel=1e-9)
    row = summary["global"]
    assert row["final_gap_min"] <= row["final_gap_mean"] <= row["final_gap_max"]
    assert summary["lowrank_ddp"]["final_gap_mean"] == 0
    assert Path(tmp_path / "long_horizon.png").stat().st_size > 10_000


def test_step_cost_quick(tmp_path):
    result = run_quick("step_cost.py", tmp_path)
    step = result["inner_step"]
    for name in ("adamw", "adamw_fast", "lordo", "lordo_batched"):
        med = step["median_seconds"][name]
        assert med["fwd_bwd"] > 0 and med["step"] > 0
        assert len(step["samples"][name]["step"]) == step["timed_steps"]
    assert step["adamw_fast"] == "foreach"
    # the headline ratio: the product's (batched) step against AdamW's fastest form
    assert step["step_ratio_lordo_to_adamw"] == pytest.approx(
        step["median_seconds"]["lordo_batched"]["step"] / step["median_seconds"]["adamw_fast"]["step"])
    assert step["step_ratio_lordo_vs_adamw_fast"] == pytest.approx(
        step["median_seconds"]["lordo"]["step"] / step["median_seconds"]["adamw_fast"]["step"])
    batched = result["whole_model_refresh"]["batched_seconds"]
    assert set(batched) == {"rsvd", "dct"} and all(v > 0 for v in batched.values())
    methods = {(r["method"], tuple(r["shape"])) for r in result["refresh"]}
    assert {m for m, _ in methods} == {"svd", "rsvd", "dct"}
    assert all(r["median_seconds"] > 0 for r in result["refresh"])
    # every low-rank shape of the preset was timed, and the whole-model figure sums them
    matrices = result["whole_model_refresh"]["matrices"]
    assert all(("svd", tuple(int(x) for x in s.split("x"))) in methods for s in matrices)
    assert set(result["whole_model_refresh"]["seconds"]) == {"svd", "rsvd", "dct"}
    assert Path(tmp_path / "step_cost.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.extended
def test_framework_overhead_quick(tmp_path):
    result = run_quick("framework_overhead.py", tmp_path, timeout=600)
    ref = result["modes"]["reference"]["median_rounds_2_to_n"]
    sim = result["modes"]["simulation"]["median_rounds_2_to_n"]
    assert 0 < ref["aggregation"] < ref["round_seconds"]
    assert ref["ideal_parallel_round_seconds"] < ref["round_seconds"]
    # every part was measured, and the measured parts fit inside the round
    for part in ("client compute", "client other", "serialization", "aggregation", "transport + Flower"):
        assert sim[part] > 0, part
    assert sim["bytes_down"] > 0 and sim["bytes_up"] > 0
    assert sim["ratio_to_ideal_parallel_round"] > 0
    assert Path(tmp_path / "framework_overhead.png").stat().st_size > 10_000


@pytest.mark.extended
def test_server_memory_quick(tmp_path):
    """Both paths end at the same θ; streaming loads each reply once and holds one at a time; its
    round peak does not grow from M = 2 to 4, while the list path's grows by about the two replies
    it holds more (16m: a 17 MB reply, against a few MB of allocator noise)."""
    result = run_quick("server_memory.py", tmp_path, timeout=120)
    rows = {(r["path"], r["M"]): r for r in result["rows"]}
    assert set(rows) == {(p, m) for p in ("list", "stream") for m in (2, 4)}
    reply = result["config"]["reply_bytes"]
    assert result["config"]["model_bytes"] > 0 and reply > result["config"]["model_bytes"]
    for m in (2, 4):
        assert rows["list", m]["theta_sha256"] == rows["stream", m]["theta_sha256"]
        assert rows["stream", m]["loads"] == m and rows["stream", m]["max_replies_loaded"] == 1
        assert rows["list", m]["max_replies_loaded"] == m
        assert all(rows[p, m]["accepted"] == list(range(m)) for p in ("list", "stream"))
    growth = {p: rows[p, 4]["round_peak_bytes"] - rows[p, 2]["round_peak_bytes"] for p in ("list", "stream")}
    assert growth["list"] > 1.5 * reply
    assert growth["stream"] < 0.5 * reply


@pytest.mark.extended
def test_server_memory_deployment_quick(tmp_path):
    """The product ServerApp in a real deployment with 2 stand-in nodes on the data plane (one
    deployment: the full run's M = 2, 4, 8 give the scaling): every round has every client, the
    stand-ins' replies are the size of a worker's, and server.jsonl carries the peak RSS the
    benchmark reports (structure, not the figures)."""
    result = run_quick("server_memory_deployment.py", tmp_path, timeout=240)
    rows = result["rows"]
    assert [(r["M"], r["data_plane"]) for r in rows] == [(2, "grpc")]
    model = result["config"]["model_bytes"]
    for r in rows:
        assert [p["round"] for p in r["per_round"]] == [1, 2]
        assert all(p["clients_ok"] == r["M"] for p in r["per_round"])
        assert r["server_peak_rss_bytes"] == max(p["server_peak_rss_bytes"] for p in r["per_round"]) > model
        # round 1 sends no θ (seeded); round 2 sends θ; replies carry Δ of every parameter
        assert r["per_round"][0]["bytes_sent_per_client"] < model < r["per_round"][1]["bytes_sent_per_client"]
        assert r["per_round"][1]["bytes_received_per_client"] > model


@pytest.mark.extended
def test_gpu_check_orchestrates_its_steps(tmp_path):
    """benchmarks/gpu_check.py on a CPU (--quick --device cpu): each step runs as a subprocess and
    leaves its result file; the CUDA tests are collected and, without a GPU, all skipped."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--device", "cpu",
                           "--only", "tests,step16m", "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(summary["steps"]) == ["tests", "step16m"]
    assert all(s["rc"] == 0 and s["result_written"] for s in summary["steps"].values())
    counts = summary["steps"]["tests"]["counts"]
    assert counts.get("skipped", 0) >= 10 and not counts.get("failed") and not counts.get("passed")
    step = json.loads((tmp_path / "gpu_step_cost_16m.json").read_text())
    assert step["config"]["device"] == "cpu" and step["inner_step"]["step_ratio_lordo_to_adamw"] > 0
    # a budget too small for any step: each is recorded as skipped, none runs, the summary is written
    spent = tmp_path / "spent"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--device", "cpu",
                           "--only", "tests,step16m", "--out-dir", str(spent), "--budget-s", "10"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    skipped = json.loads((spent / "gpu_check.json").read_text())["steps"]
    assert [s["rc"] for s in skipped.values()] == [None, None] and all("budget" in s["skipped"] for s in skipped.values())
    assert sorted(p.name for p in spent.iterdir()) == ["gpu_check.json"]


def test_gpu_check_a_step_past_its_timeout_is_killed_with_its_children(tmp_path, monkeypatch):
    """A step cut off at its timeout is recorded as rc 124, and its children (corpora's process pool)
    are killed with it rather than left to run beside the next step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    script = f"sleep 30 & echo $! > {tmp_path / 'child.pid'}; wait"
    monkeypatch.setattr(gpu_check, "commands", lambda *a, **k: (["bash", "-c", script], tmp_path / "none.json", 2.0))
    assert gpu_check.main(["--quick", "--device", "cpu", "--only", "step16m", "--out-dir", str(tmp_path)]) == 124
    step = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["step16m"]
    assert step["rc"] == 124 and "timed out after 2 s" in step["output_tail"] and step["seconds"] < 20
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}"), "the step's child outlived its timeout"


def test_gpu_check_carries_the_corpora_runs_between_sessions(tmp_path):
    """The `corpora` step's cache: the committed runs unpacked and packed again come back the same,
    file for file and byte for byte, with a new run added; a member outside the folder is refused."""
    import tarfile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import CORPORA_RUNS, pack_corpora_runs, unpack_corpora_runs

    def contents(archive: Path) -> dict[str, bytes]:
        with tarfile.open(archive) as tar:
            return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}

    committed = contents(CORPORA_RUNS)
    assert len(committed) >= 75 and all(json.loads(b)["val_ppl"] > 1 for b in committed.values())
    work = tmp_path / "work"
    assert unpack_corpora_runs(CORPORA_RUNS, work) == len(committed)
    (work / "new_run").mkdir()
    (work / "new_run" / "result.json").write_text('{"val_ppl": 4.2}')
    (work / "unfinished").mkdir()  # a run cut short: no result.json, not packed
    assert pack_corpora_runs(work, tmp_path / "out.tar.gz") == len(committed) + 1
    assert contents(tmp_path / "out.tar.gz") == {**committed, "new_run/result.json": b'{"val_ppl": 4.2}'}
    assert unpack_corpora_runs(tmp_path / "missing.tar.gz", tmp_path / "empty") == 0
    hostile = tmp_path / "hostile.tar.gz"
    with tarfile.open(hostile, "w:gz") as tar:
        tar.add(work / "new_run" / "result.json", arcname="../escaped/result.json")
    with pytest.raises(tarfile.OutsideDestinationError):
        unpack_corpora_runs(hostile, tmp_path / "w2")
    assert not (tmp_path / "escaped").exists()
    # a run that records its host stays where it is this machine's and trains anew where it is not
    here = {"cpu_model": "This CPU", "torch_cpu_capability": "AVX512", "torch": "2.13.0", "device": "NVIDIA H200"}
    for name, host in (("same", here), ("other", {**here, "device": "NVIDIA A100"})):
        (work / name).mkdir()
        (work / name / "result.json").write_text(json.dumps({"val_ppl": 4.2, "host": host}))
    pack_corpora_runs(work, tmp_path / "hosts.tar.gz")
    assert unpack_corpora_runs(tmp_path / "hosts.tar.gz", tmp_path / "w3", here) == len(committed) + 2
    assert (tmp_path / "w3" / "same" / "result.json").exists() and not (tmp_path / "w3" / "other" / "result.json").exists()


@pytest.mark.extended
def test_corpus_tokenize_quick(tmp_path):
    """Every format and tokenizer ran; the record formats gave the same tokens (the benchmark
    checks their sha256); one thread and all cores tokenise to the same stream."""
    result = run_quick("corpus_tokenize.py", tmp_path, timeout=300)
    rows = result["rows"]
    assert {(r["format"], r["tokenizer"]) for r in rows} == {
        (f, t) for f in ("text", "jsonl", "parquet", "hf") for t in ("byte", "bpe-8192, all cores", "bpe-8192, 1 thread")}
    for fmt in ("text", "jsonl", "parquet", "hf"):
        bpe = {r["tokens_sha256"] for r in rows if r["format"] == fmt and r["tokenizer"].startswith("bpe")}
        assert len(bpe) == 1
    assert all(r["mb_per_s"] > 0 and r["tokens"] > 0 for r in rows)


@pytest.mark.extended
def test_codec_memory_quick(tmp_path):
    """The direct encoder and in-place decoder need about their output (the payload, or the fp32
    tensors decoded from it); the protobuf path about 4x / 2x more, which the run must see."""
    result = run_quick("codec_memory.py", tmp_path, timeout=300)
    summary = {(s["step"], s["payload_dtype"]): s for s in result["summary"]}
    assert set(summary) == {(step, pd) for step in ("encode", "encode_file", "decode", "decode_mmap")
                            for pd in ("fp32", "bf16")}
    slack = 4e6  # code pages of a first call, Python objects
    for pd, widen in (("fp32", 1), ("bf16", 2)):
        payload = summary[("encode", pd)]["payload_bytes"]
        assert payload == pytest.approx(16e6 / widen, rel=0.01)
        assert summary[("encode", pd)]["new_peak_extra_bytes"] < 1.25 * payload + slack
        assert summary[("encode", pd)]["old_peak_extra_bytes"] > 2.5 * payload
        assert summary[("encode_file", pd)]["new_peak_extra_bytes"] < 4 * 2 ** 20 + slack  # the staging buffer
        assert summary[("decode", pd)]["new_peak_extra_bytes"] < 1.25 * widen * payload + slack
        assert summary[("decode", pd)]["old_peak_extra_bytes"] > summary[("decode", pd)]["new_peak_extra_bytes"] + 0.3 * payload
        for step in ("encode", "encode_file", "decode", "decode_mmap"):
            s = summary[(step, pd)]
            assert s["old_seconds"] > 0 and s["new_seconds"] > 0


@pytest.mark.slow
@pytest.mark.extended
def test_dataplane_throughput_quick(tmp_path):
    """Structure and verification of benchmarks/dataplane_throughput.py --quick (not its speed):
    every variant ran, every transfer arrived whole (sha256, sizes, content), ratios are ratios."""
    result = run_quick("dataplane_throughput.py", tmp_path, timeout=300)
    size = int(result["config"]["size_mb"] * 1e6)
    nodes = result["config"]["nodes"]
    assert nodes == 2 and result["verified"] is True
    variants = result["variants"]
    assert set(variants) == {"bare grpc", "bare grpc TLS", "dp transport only", "dp transport only TLS",
                             "dp transport, sha256", "dp transport, sha256 TLS",
                             "whole path, announced", "whole path, announced TLS",
                             "whole path, announced, encoded whole before publishing",
                             "whole path, announced, encoded whole before publishing TLS",
                             "data plane", "flower"}  # --quick: no TLS deployment
    for name, v in variants.items():
        assert v["verified"] is True, name
        if name.startswith(("bare", "dp transport")):
            assert v["seconds"] > 0 and v["mb_per_s"] > 0, name
        # (in a deployment, big - tiny exchange can come out <= 0 at --quick's 20 MB on a loaded
        # machine: Flower's control latency varies by more than the transfer takes)
        bare = variants["bare grpc TLS" if v["security"] == "tls" else "bare grpc"]["mb_per_s"]
        # (the benchmark rounds ratios to 3 decimals: allow that rounding, which is large for a small ratio)
        assert v["ratio_to_bare"] == pytest.approx(v["mb_per_s"] / bare, rel=1e-2, abs=5e-4), name
        if name.startswith(("bare", "dp transport")):
            assert v["bytes_moved"] == 2 * nodes * size, name  # each node: size down and size up
        else:  # the encoded GlobalState / WorkerUpdate: the tensor plus a small header
            assert 2 * nodes * size <= v["bytes_moved"] < 2 * nodes * size + 4096, name
        if not name.startswith(("bare", "dp transport", "whole path")):
            assert v["end_to_end_s"] >= v["seconds"] and v["tiny_exchange_s"] > 0, name
    # the Flower-less streams: both directions of every client checked after the timed part (by
    # sha256; the whole path: the decoded tensors against the sender's draw)
    for key, runs in result["stream_runs"].items():
        for run in runs:
            assert run["verified"] is True
            for c in run["clients"]:
                assert c["down_sha256_ok"] and c["up_sha256_ok"]
                if key.startswith("codec"):
                    assert size < c["down_bytes"] == run["payload_bytes"] < size + 1024 and size < c["up_bytes"] < size + 1024
                else:
                    assert c["down_bytes"] == c["up_bytes"] == size
    for name in ("whole path, announced", "whole path, announced TLS"):
        steps = variants[name]["breakdown"]
        assert all(v >= 0 for v in steps.values()) and steps["download_s"] > 0 and steps["upload_s"] > 0, name
    # the deployment: every exchange, every node, both directions
    rows = result["deployments"]["plaintext"]["rows"]
    assert sorted((r["mode"], r["size_mb"]) for r in rows) == [
        ("flower", 0.001), ("flower", 20.0), ("grpc", 0.001), ("grpc", 20.0)]
    for r in rows:
        assert r["verified"] is True and len(r["nodes"]) == nodes
        for n in r["nodes"].values():
            assert n["down_ok"] and n["up_content_ok"], r["mode"]  # decoded tensors equal what was drawn
            assert n["down_bytes"] == r["payload_bytes_down"] and n["up_bytes"] == n["up_bytes_received"] > 0
            assert n["up_digest_ok"] is (True if r["mode"] == "grpc" else None)
    breakdown = variants["data plane"]["breakdown"]
    for key in ("server_encode_s", "publish_digest_s", "download_s", "client_decode_s", "client_encode_s",
                "upload_s", "server_decode_s", "control_down_s", "control_up_s", "critical_path_s"):
        assert breakdown[key] >= 0, key
    assert variants["data plane"]["critical_path_s"] == breakdown["critical_path_s"]
    decode = result["server_decode"]  # (the decodes were checked equal to what was encoded)
    assert decode["in_place_once_s"] > 0 and decode["copy_twice_s"] > 0
    assert len(result["table"]) == 2 + len(variants)


@pytest.mark.extended
def test_async_rounds_quick(tmp_path):
    """Structure of benchmarks/async_rounds.py --quick: on IID and non-IID data every method trained
    on the same tokens, the asynchronous ones on the same deterministic schedule (not their
    quality), async LoRDO's pushes carrying more bytes than async DiLoCo's (moments, bases)."""
    result = run_quick("async_rounds.py", tmp_path)
    assert set(result["settings"]) == {"iid", "non_iid"}
    for summary in result["settings"].values():
        methods = summary["methods"]
        assert set(methods) == {"diloco", "async_diloco", "async_lookahead", "heloco", "lordo_global", "async_lordo",
                                "heloco_lordo"}
        assert len({m["final_tokens"] for m in methods.values()}) == 1
        schedules = {json.dumps([m["staleness"], m["pushes_by_worker"]]) for k, m in methods.items()
                     if k not in ("diloco", "lordo_global")}
        assert len(schedules) == 1
        slow = methods["heloco"]["pushes_by_worker"]
        assert slow[-1] < slow[0]  # the 4x slower worker pushes less often
        assert methods["async_lordo"]["bytes_per_worker"] > methods["async_diloco"]["bytes_per_worker"]
    assert (tmp_path / "async_rounds.png").exists()


@pytest.mark.extended
def test_compression_quick(tmp_path):
    """Structure of benchmarks/compression.py --quick: the presets' serialized bytes at 16m against
    fp32 DDP (fp32 LoRDO-Global equal to communication.py's 12x, every compressed preset fewer
    bytes than bf16), encode/decode time, the server's two readings of top-k replies (the same θ) at one
    and two threads, and a tiny quality run (not its figures' quality)."""
    result = run_quick("compression.py", tmp_path, "--server-threads", "1,2")
    by = {r["payload"]: r for r in result["bytes"]}
    from lordo_fed.wire.payload import PAYLOADS

    assert set(by) == set(PAYLOADS)
    # option B: the same uplink, the state's own fields and the other 3 of 4 workers' replies (Δ only) down: more
    # than θ's change at 3%, far less than θ's change int8
    relay = by["topk2bit-relay"]
    assert relay["up_bytes_per_round"] == by["topk2bit-all"]["up_bytes_per_round"] and relay["M"] == 4
    assert by["topk2bit-both"]["down_bytes_per_round"] < relay["down_bytes_per_round"] < by["topk2bit-all"]["down_bytes_per_round"]
    assert round(by["fp32"]["reduction_vs_ddp_fp32"]) == 12
    assert by["fp32"]["reduction_vs_ddp_fp32"] < by["bf16"]["reduction_vs_ddp_fp32"] < by["int8"]["reduction_vs_ddp_fp32"]
    up = {p: r["up_bytes_per_round"] for p, r in by.items()}
    # the embedding travels int8 in every compressed preset: top-k saves on the blocks' matrices only
    assert up["int8"] > up["int4"] and up["int8"] > up["lowrank+topk2bit"] > up["topk2bit"]
    # all of the embedding's rows (--row-share 1): a scale and an index per row of 256 values cost
    # less than int8's scale per 64 values
    assert up["lowrank+topk2bit"] > up["lowrank+topk2bit+rows"] and up["lowrank+topk2bit"] > up["topk2bit"]
    # one 4-entry table per tensor against two magnitudes per chunk
    assert up["topk2bit-lut"] < up["topk2bit"]
    times = {r["payload"]: r for r in result["time"]}
    assert all(times[p]["up_bytes"] < times["fp32"]["up_bytes"] for p in ("int8", "int4", "topk2bit", "lowrank+topk2bit"))
    assert all(r["codec_s"] > 0 for r in result["time"])
    refit = {r["method"]: r for r in result["refit"]}
    assert set(refit) == {"svd", "rsvd", "dct"} and all(r["refit_s"] > 0 and r["link_s_100mbps"] > r["link_s_1gbps"] > 0
                                                        for r in refit.values())
    server = result["server"]
    assert sorted((r["preset"], r["path"], r["threads"]) for r in server) == sorted(
        [(p, q, t) for p in ("diloco-sparse", "sparseloco") for q in ("sparse-once", "dense-twice") for t in (1, 2)]
        + [("relay", "sparse-once", t) for t in (1, 2)])
    # both readings of the replies end at the same θ, bit for bit (the relay reads them one way)
    assert all(r["same_theta"] is (None if r["preset"] == "relay" else True) and r["screen_s"] > 0
               and r["aggregate_s"] > 0 and r["encode_s"] > 0 for r in server)
    # a relay also encodes each node's own state (its reply left out), and only a relay does
    assert all((r.get("encode_own_s", 0) > 0) is (r["preset"] == "relay") for r in server)
    quality = {r["payload"]: r for r in result["quality"]}
    assert set(quality) == {"fp32", "int8"} and quality["int8"]["bytes_vs_fp32"] > 1.5
    assert (tmp_path / "compression.png").exists()


@pytest.mark.extended
def test_compression_ladder_quick(tmp_path):
    """benchmarks/compression_ladder.py --quick with two rungs: each rung's row against the seed's
    fp32 run, with the rung's overrides recorded (not the figures' quality)."""
    work = str(tmp_path / "work")
    result = run_quick("compression_ladder.py", tmp_path, "--rungs", "sign,mean", "--work", work)
    rows = {r["rung"]: r for r in result["rows"]}
    assert set(rows) == {"fp32", "sign", "mean"}
    assert "rounds.sparse_mean=contributors" in rows["mean"]["overrides"]
    assert rows["sign"]["bytes_vs_fp32"] > 1.5 and rows["mean"]["val_loss"] != rows["sign"]["val_loss"]
    # the wire's per-round metrics: every round's residual ratio, from the second on the re-selected share
    wire = rows["mean"]["round_metrics"]
    assert [m["round"] for m in wire] == list(range(1, rows["mean"]["rounds"] + 1)) and all(m["wire_ef_ratio"] > 0 for m in wire)
    assert "sparse_reselected" not in wire[0] and all(0 <= m["sparse_reselected"] <= 1 for m in wire[1:])
    assert all(0 <= m["sparse_support_shared"] <= 1 for m in wire) and not rows["fp32"]["round_metrics"]
    assert (tmp_path / "compression_ladder.png").exists()
    # --work keeps the runs: the same ladder again trains nothing and gives the same rows; a rung run with
    # other arguments (--set) is trained again, while fp32 (which --set does not touch) is not
    again = run_quick("compression_ladder.py", tmp_path, "--rungs", "sign,mean", "--work", work)["rows"]
    assert all(r.pop("cached") for r in again) and again == result["rows"]
    changed = {r["rung"]: r for r in run_quick("compression_ladder.py", tmp_path, "--rungs", "sign", "--work", work,
                                               "--set", "rounds.wire_ef_decay=0.5")["rows"]}
    assert changed["fp32"]["cached"] and "cached" not in changed["sign"]
    assert changed["sign"]["val_loss"] != rows["sign"]["val_loss"]


@pytest.mark.extended
def test_compression_ladder_reference_stands_in_for_the_baseline(tmp_path):
    """`--reference` with `--baseline`: the reference's baseline rows are taken as they are (nothing trained
    for them) and the other rung is compared with them as in the run that made them; a reference from
    another kernel set (its torch_cpu_capability edited), another torch thread count (SVD and QR round otherwise)
    or with other baseline overrides is refused."""
    args = ("--method", "diloco", "--baseline", "fp32-average", "--rungs", "avg-relay-1bit")
    first = run_quick("compression_ladder.py", tmp_path, *args)
    ref = tmp_path / "reference.json"
    ref.write_text(json.dumps(first))
    (tmp_path / "compression_ladder.json").unlink()
    again = run_quick("compression_ladder.py", tmp_path, *args, "--reference", str(ref))
    rows = {r["rung"]: r for r in again["rows"]}
    assert rows["fp32-average"].pop("cached") is True
    assert [rows["fp32-average"], rows["avg-relay-1bit"]["ppl_vs_fp32"]] == [
        first["rows"][0], first["rows"][1]["ppl_vs_fp32"]]
    for edit, expected in ((lambda d: d["machine"].update(torch_cpu_capability="NO_AVX"), "ATEN_CPU_CAPABILITY"),
                           (lambda d: d["machine"].update(torch_threads=d["machine"]["torch_threads"] + 1),
                            f"OMP_NUM_THREADS={first['machine']['torch_threads'] + 1}"),
                           (lambda d: d["rows"][0]["overrides"].append("diloco_outer.lr=2.0"), "fp32-average row")):
        other = json.loads(json.dumps(first))
        edit(other)
        ref.write_text(json.dumps(other))
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compression_ladder.py"), "--quick", "--out",
                               str(tmp_path / "refused.json"), *args, "--reference", str(ref)],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
                              timeout=300)
        assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]


@pytest.mark.extended
def test_node_ranks_quick(tmp_path):
    """benchmarks/node_ranks.py --quick: local steps through DDP and FSDP2 (gloo, one rank) against
    the bare model; the bytes two ranks of one node hold under each (FSDP2: about half each)."""
    result = run_quick("node_ranks.py", tmp_path, timeout=180)
    o = result["overhead"]
    assert o["bare_seconds_per_step"] > 0 and o["samples"] == 5
    for name in ("ddp", "fsdp"):
        assert o[f"{name}_seconds_per_step"] > 0 and len(o[f"samples_{name}"]) == 6
        assert o[f"{name}_over_bare"] == o[f"{name}_seconds_per_step"] / o["bare_seconds_per_step"]
        assert o[f"{name}_over_bare_paired"] > 0
    ddp, fsdp = ([r[w] for r in result["held"]["ranks"]] for w in ("ddp", "fsdp"))
    assert ddp[0] == ddp[1] and fsdp[0]["theta_bytes"] + fsdp[1]["theta_bytes"] == ddp[0]["theta_bytes"]
    assert all(f["total_bytes"] < 0.75 * ddp[0]["total_bytes"] for f in fsdp), result["held"]
