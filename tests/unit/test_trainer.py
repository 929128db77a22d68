"""The reference trainer: reductions between methods, learning, wire accounting, the CLI."""

import dataclasses
import json

import pytest
import torch

from lordo_fed.data import DataConfig, load_dataset
from lordo_fed.device import pick_device
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.model import ModelConfig
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.trainer.cli import summary_table, train
from lordo_fed.trainer.config import TrainConfig
from lordo_fed.trainer.run import RunContext, run_async, run_ddp, run_rounds


def tiny_config(tmp_path, **kw) -> TrainConfig:
    base = dict(
        workers=1, total_steps=6, eval_batches=2, out_dir=str(tmp_path / "out"), progress=False,
        model=ModelConfig(preset="tiny"),
        data=DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=32, batch_size=4),
        inner=InnerConfig(rank=4, warmup_steps=2, lr=5e-3, omega=0.9),
        rounds=RoundConfig(local_steps=1),
    )
    base.update(kw)
    return TrainConfig(**base)


def context(cfg: TrainConfig, records: list) -> RunContext:
    dataset = load_dataset(cfg.data, cfg.workers)
    return RunContext(cfg, dataset, pick_device("cpu"), dataset.val_batches(cfg.eval_batches), records.append)


@pytest.mark.parametrize("init_projection", ["gradient", "random"])
def test_lordo_global_with_one_worker_and_k1_equals_low_rank_ddp(tmp_path, init_projection):
    """M = 1, K = 1: the round machinery (Δ, outer average, state sync, server projections and
    rotation) adds nothing and drops nothing relative to a plain loop with the same optimizer."""
    cfg = tiny_config(tmp_path)
    cfg.inner.init_projection = init_projection
    records: list = []
    ctx = context(cfg, records)
    lordo = resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer)
    # Low-rank DDP whose projection is refit from the update every K steps, as the server does.
    ddp = resolve_method("lowrank_ddp", cfg.inner, cfg.rounds, cfg.outer)
    ddp = dataclasses.replace(ddp, inner=dataclasses.replace(ddp.inner, projection="global"))
    a = dict(run_rounds(ctx, lordo).named_parameters())
    b = dict(run_ddp(ctx, ddp).named_parameters())
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
    # And training actually moved the weights (the comparison is not between two untouched models).
    first = [r for r in records if r["method"] == "lordo_global" and r["round"] == cfg.total_steps][0]
    assert first["delta_norm"] > 0


def test_the_ramp_gives_the_first_rounds_their_own_k_and_the_global_steps():
    """`local_steps_ramp` [8, 8, 16] with K = 32: rounds of 8, 8, 16, then 32, on K's grid."""
    rc = RoundConfig(local_steps=32, local_steps_ramp=[8, 8, 16]).validate()
    assert [rc.steps_of(r) for r in range(1, 6)] == [8, 8, 16, 32, 32]
    assert [rc.steps_before(r) for r in range(1, 6)] == [0, 8, 16, 32, 64]
    assert [rc.rounds_in(n) for n in (8, 16, 32, 64, 512)] == [1, 2, 3, 4, 3 + 15]
    plain = RoundConfig(local_steps=32)
    assert [plain.steps_before(r) for r in (1, 2, 17)] == [0, 32, 512] and plain.rounds_in(512) == 16


def test_late_rounds_run_their_own_k_from_the_step_they_start_at():
    """`late_local_steps` 8 from step 1638 of 2048 with K = 32 (WSD's decay): 52 rounds of 32, the first
    starting at or after step 1638 (step 1664) begins 48 rounds of 8; with a ramp in front, both hold."""
    rc = RoundConfig(local_steps=32, late_local_steps=8, late_from_step=1638).validate()
    assert [rc.steps_of(r) for r in (1, 52, 53, 100)] == [32, 32, 8, 8]
    assert [rc.steps_before(r) for r in (1, 52, 53, 54, 101)] == [0, 1632, 1664, 1672, 2048]
    assert rc.rounds_in(2048) == 52 + 48 and rc.rounds_in(1664) == 52 and rc.rounds_in(1000) == 31
    both = RoundConfig(local_steps=32, local_steps_ramp=[8, 8, 16], late_local_steps=16, late_from_step=64).validate()
    assert [both.steps_of(r) for r in range(1, 8)] == [8, 8, 16, 32, 16, 16, 16]
    assert [both.steps_before(r) for r in range(1, 8)] == [0, 8, 16, 32, 64, 80, 96]
    assert both.rounds_in(128) == 4 + 4
    inside = RoundConfig(local_steps=32, local_steps_ramp=[8, 8, 16], late_local_steps=4, late_from_step=10).validate()
    assert [inside.steps_of(r) for r in range(1, 5)] == [8, 8, 4, 4] and inside.steps_before(5) == 24
    for r in range(1, 101):  # every round starts where the last ended, under each schedule
        for c in (rc, both, inside):
            assert c.steps_before(r + 1) == c.steps_before(r) + c.steps_of(r)


def test_each_method_takes_its_own_lr_and_ef_decay_unless_the_config_sets_them(monkeypatch):
    """inner.lr / inner.ef_decay None: every method runs with its own (`METHOD_DEFAULTS`); a value set
    in the config holds for every method; a config never resolved is refused, not run with a guess."""
    from lordo_fed.optim.config import build_inner_optimizer
    from lordo_fed.rounds import methods

    monkeypatch.setitem(methods.METHOD_DEFAULTS, "ddp", {"lr": 0.016, "ef_decay": 0.9})
    monkeypatch.setitem(methods.METHOD_DEFAULTS, "lordo_local", {"lr": 0.008, "ef_decay": 1.0})
    unset = InnerConfig(rank=4)
    got = {m: resolve_method(m, unset, RoundConfig(), OuterConfig()).inner for m in ("ddp", "lordo_local")}
    assert (got["ddp"].lr, got["lordo_local"].lr, got["lordo_local"].ef_decay) == (0.016, 0.008, 1.0)
    pinned = InnerConfig(rank=4, lr=0.004, ef_decay=0.5)
    for m in ("ddp", "lordo_local"):
        inner = resolve_method(m, pinned, RoundConfig(), OuterConfig()).inner
        assert (inner.lr, inner.ef_decay) == (0.004, 0.5), m
    with pytest.raises(ValueError, match=r"inner.lr=None: expected the method's settings"):
        build_inner_optimizer(torch.nn.Linear(4, 4), unset, [])


def one_worker_run(out, rounds: RoundConfig, total_steps: int) -> tuple[dict, list]:
    """Local Adam with M = 1 (states averaged every round, plain averaging) under `rounds`' schedule:
    its parameters and records, for the schedules' same-path tests."""
    cfg = tiny_config(out, total_steps=total_steps, rounds=rounds,
                      inner=InnerConfig(rank=4, warmup_steps=3, lr=5e-3, omega=0.9))
    records: list = []
    settings = resolve_method("local_adam", cfg.inner, cfg.rounds, cfg.outer)
    return dict(run_rounds(context(cfg, records), settings).named_parameters()), records


def test_a_ramp_with_one_worker_follows_the_plain_runs_path(tmp_path):
    """M = 1, states averaged every round, plain averaging: cutting a round in two changes nothing, so a
    run whose first rounds are ramped ([1, 3] with K = 4: rounds of 1, 3, 4 steps) must follow the plain
    run's path (K = 4: 4, 4): the same learning rate at every global step (warm-up over the rounds'
    boundaries), the same batches, the moments carried over."""
    plain, plain_records = one_worker_run(tmp_path / "plain", RoundConfig(local_steps=4), 8)
    ramp, ramp_records = one_worker_run(tmp_path / "ramp", RoundConfig(local_steps=4, local_steps_ramp=[1, 3]), 8)
    assert [(r["round"], r["step"]) for r in ramp_records if "val_loss" in r] == [(0, 0), (1, 1), (2, 4), (3, 8)]
    assert ramp_records[-1]["tokens"] == plain_records[-1]["tokens"] == 8 * 4 * 32
    for name in plain:
        torch.testing.assert_close(ramp[name], plain[name], rtol=0, atol=1e-6, msg=name)
    assert all(r["delta_norm"] > 0 for r in ramp_records if r["round"])  # every round moved θ


def test_a_run_that_ends_inside_the_ramp_is_the_run_with_the_ramp_cut_where_it_ends(tmp_path):
    """A run may be shorter than `local_steps_ramp` if it ends where one of the ramp's rounds does (so a
    ramp of 512 steps serves a run of 256): LoRDO-Global with M = 2 and int8 over 4 steps of the ramp
    [1, 1, 2, 4] with K = 4 trains what the ramp [1, 1, 2] does, bit for bit (the same rounds, the same
    schedule over T = 4)."""
    def run(name: str, ramp: list[int]) -> dict:
        cfg = tiny_config(tmp_path, out_dir=str(tmp_path / name), workers=2, total_steps=4, payload_dtype="int8",
                          rounds=RoundConfig(local_steps=4, local_steps_ramp=ramp)).validate()
        records: list = []
        settings = resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer)
        params = dict(run_rounds(context(cfg, records), settings).named_parameters())
        assert [r["step"] for r in records if "val_loss" in r] == [0, 1, 2, 4], name
        return params

    cut, long = run("cut", [1, 1, 2]), run("long", [1, 1, 2, 4])
    for name in cut:
        torch.testing.assert_close(long[name], cut[name], rtol=0, atol=0, msg=name)


def test_a_switch_at_a_fraction_of_the_run_is_the_switch_at_that_step(tmp_path):
    """inner.switch_fraction = 0.5 over 8 steps is the two-phase switch at step 4: LoRDO-Local with M = 2 trains
    the same curve bit for bit (the settings `resolve_method` gives the trainer name step 4); at 16 steps it is
    step 8. A fraction beside a step, one out of [0, 1), or one with no run length is refused by name."""
    def curve(name: str, **inner) -> list:
        cfg = tiny_config(tmp_path, out_dir=str(tmp_path / name), workers=2, total_steps=8, eval_every=1,
                          inner=InnerConfig(rank=4, warmup_steps=2, lr=5e-3, omega=0.9, **inner),
                          rounds=RoundConfig(local_steps=2)).validate()
        records: list = []
        run_rounds(context(cfg, records), resolve_method("lordo_local", cfg.inner, cfg.rounds, cfg.outer,
                                                         total_steps=cfg.total_steps))
        return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]

    by_fraction, by_step, one_phase = (curve("fraction", switch_fraction=0.5), curve("step", switch_step=4),
                                       curve("one", switch_fraction=0.0))
    assert by_fraction == by_step and len(by_step) == 5
    assert by_step[:3] == one_phase[:3] and by_step[3:] != one_phase[3:]  # the switch at step 4 changed the rest
    settings = resolve_method("lordo_local", InnerConfig(switch_fraction=0.5), RoundConfig(), OuterConfig(),
                              total_steps=16)
    assert (settings.inner.switch_step, settings.inner.switch_fraction) == (8, 0.0)
    # LoRDO-Local's own (its tuned best trial: the switch at half the run); the others' one phase; a step the run
    # names wins over the method's own fraction
    own = {m: resolve_method(m, InnerConfig(), RoundConfig(), OuterConfig(), total_steps=16).inner.switch_step
           for m in ("lordo_local", "lordo_global", "diloco")}
    assert own == {"lordo_local": 8, "lordo_global": 0, "diloco": 0}
    assert resolve_method("lordo_local", InnerConfig(switch_step=5), RoundConfig(), OuterConfig(),
                          total_steps=16).inner.switch_step == 5
    assert by_fraction == curve("own")  # LoRDO-Local left at None: the switch at half its 8 steps
    with pytest.raises(ValueError, match=r"inner.switch_fraction=0.5 \(two-phase switch at that share of the run\) "
                                         r"needs the run's total_steps"):
        resolve_method("lordo_local", InnerConfig(switch_fraction=0.5), RoundConfig(), OuterConfig())
    with pytest.raises(ValueError, match=r"\(lordo_local's own two-phase switch .* or inner.switch_fraction=0.0 "
                                         r"for one phase"):
        resolve_method("lordo_local", InnerConfig(), RoundConfig(), OuterConfig())
    with pytest.raises(ValueError, match=r"inner.switch_fraction=0.5 with inner.switch_step=6: expected one of the two"):
        InnerConfig(switch_fraction=0.5, switch_step=6).validate()
    with pytest.raises(ValueError, match=r"inner.switch_fraction=1.0: expected a number in \[0, 1\)"):
        InnerConfig(switch_fraction=1.0).validate()


def test_late_rounds_with_one_worker_follow_the_plain_runs_path(tmp_path):
    """As the ramp's test: rounds of 4, 4, then 2, 2, 2, 2 from step 8 (`late_local_steps`) must follow
    the plain run's path (K = 4 throughout) with one worker averaged every round."""
    plain, plain_records = one_worker_run(tmp_path / "plain", RoundConfig(local_steps=4), 16)
    late, late_records = one_worker_run(tmp_path / "late", RoundConfig(local_steps=4, late_local_steps=2,
                                                                       late_from_step=8), 16)
    assert [(r["round"], r["step"]) for r in late_records if "val_loss" in r] == [
        (0, 0), (1, 4), (2, 8), (3, 10), (4, 12), (5, 14), (6, 16)]
    assert late_records[-1]["tokens"] == plain_records[-1]["tokens"] == 16 * 4 * 32
    for name in plain:
        torch.testing.assert_close(late[name], plain[name], rtol=0, atol=1e-6, msg=name)


def test_lordo_global_learns_on_the_sample_corpus(tmp_path):
    """200 steps of LoRDO-Global on the tiny preset clearly lower the validation loss."""
    cfg = tiny_config(
        tmp_path, workers=2, total_steps=200, eval_every=5, eval_batches=4,
        data=DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=64, batch_size=8),
        inner=InnerConfig(rank=8, lr=8e-3, warmup_steps=10),
        rounds=RoundConfig(local_steps=8),
    )
    records: list = []
    ctx = context(cfg, records)
    run_rounds(ctx, resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer))
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    assert evals[0] > 5.0  # ≈ ln(256) for an untrained byte-level model
    assert evals[-1] < evals[0] - 2.0, evals  # measured ≈ 2.6 after 200 steps
    assert evals[-1] < min(evals[:3])


def test_wire_bytes_match_the_tensors_of_the_method(tmp_path):
    """Bytes per worker per round = Δ (all params) + due moments (low-rank shape for LoRDO)."""
    cfg = tiny_config(tmp_path, workers=2, total_steps=4, rounds=RoundConfig(local_steps=2))
    records: list = []
    ctx = context(cfg, records)
    model = run_rounds(ctx, resolve_method("lordo_global", cfg.inner, cfg.rounds, cfg.outer))
    r = 4
    n_params = sum(p.numel() for p in model.parameters())
    moments = 0
    for name, p in model.named_parameters():
        low = p.ndim == 2 and any(k in name for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
        moments += (p.shape[0] * r if p.shape[0] >= p.shape[1] else r * p.shape[1]) if low else p.numel()
    expected = 4 * n_params + 2 * 4 * moments
    sent = [rec["bytes_sent_per_worker"] for rec in records if "bytes_sent_per_worker" in rec]
    assert sent == [expected, expected]
    # DiLoCo sends only Δ.
    records.clear()
    run_rounds(ctx, resolve_method("diloco", cfg.inner, cfg.rounds, cfg.outer, OuterConfig(name="nesterov", lr=0.7)))
    assert [rec["bytes_sent_per_worker"] for rec in records if "bytes_sent_per_worker" in rec] == [4 * n_params] * 2


def test_train_writes_metrics_plot_and_summary(tmp_path):
    cfg = tiny_config(tmp_path, workers=2, total_steps=4, methods=["lordo_local", "ddp", "desloc"],
                      rounds=RoundConfig(local_steps=2), tensorboard=True)
    summary = train(cfg)
    out = tmp_path / "out"
    assert set(summary) == {"lordo_local", "ddp", "desloc"}
    lines = (out / "ddp.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[-1])["step"] == 4
    assert (out / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "lordo_local" in (out / "summary.md").read_text()
    assert any((out / "tb").rglob("events.out.tfevents.*"))
    # DDP sends a gradient every step; LoRDO-Local only Δ every K = 2 steps.
    assert summary["ddp"]["bytes_sent_per_worker_per_step"] == 2 * summary["lordo_local"]["bytes_sent_per_worker_per_step"]


class RecordingBar:
    """Stands in for tqdm: what the loops asked the bar to count to, and how far it got."""

    made: list = []

    def __init__(self, total=None, **kw) -> None:
        self.total, self.n, self.disable = total, 0, kw.get("disable", False)
        RecordingBar.made.append(self)

    def update(self, n=1) -> None:
        self.n += n

    def set_postfix(self, **kw) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("method,loop", [("lordo_local", run_rounds), ("ddp", run_ddp), ("async_diloco", run_async)])
def test_the_progress_bar_counts_total_steps_not_worker_steps(tmp_path, monkeypatch, method, loop):
    """total_steps=4, workers=2: the bar counts to 4 (the run's steps, what the user asked for), not 8."""
    monkeypatch.setattr("lordo_fed.trainer.run.tqdm", RecordingBar)
    RecordingBar.made = []
    cfg = tiny_config(tmp_path, workers=2, total_steps=4, progress=True, rounds=RoundConfig(local_steps=2))
    records: list = []
    loop(context(cfg, records), resolve_method(method, cfg.inner, cfg.rounds, cfg.outer, total_steps=cfg.total_steps))
    (bar,) = RecordingBar.made
    assert (bar.total, bar.n, bar.disable) == (4, 4, False)
    assert max(r["step"] for r in records) == 4  # the records' step counter: the same count


def test_summary_table_compares_bytes_with_ddp():
    """DDP's own row is the baseline (not '1.0x less'); a method sending more says 'more'."""
    def row(sent: float) -> dict:
        return {"val_loss": 2.0, "val_ppl": 7.389, "tokens": 1000, "bytes_sent_per_worker_per_step": sent,
                "bytes_received_per_worker_per_step": sent, "opt_state_bytes": 10, "seconds": 1.0}

    table = summary_table({"ddp": row(3200.0), "lowrank_ddp": row(3200.0), "lordo_local": row(100.0),
                           "chatty": row(6400.0)})
    vs = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[4] for line in table.splitlines()[2:]}
    assert vs == {"ddp": "1x (baseline)", "lowrank_ddp": "1x", "lordo_local": "32.0x less", "chatty": "2.0x more"}
    without_ddp = summary_table({"lordo_local": row(100.0)})
    assert without_ddp.splitlines()[2].split(" | ")[4] == "-"


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(methods=["lordo", "ddp"]), "'lordo' is not a method"),
        (dict(total_steps=5), "total_steps=5 is not a multiple of rounds.local_steps=2"),
        (dict(workers=0), "workers=0"),
        (dict(inner=InnerConfig(omega=1.2)), "inner.omega=1.2"),
        (dict(inner=InnerConfig(proj_method="qr")), "inner.proj_method='qr'"),
        (dict(rounds=RoundConfig(local_steps=2, local_steps_ramp=[1, 2])),
         r"rounds.local_steps_ramp=\[1, 2\]: expected integers > 0 whose sum is a multiple of rounds.local_steps=2"),
        (dict(rounds=RoundConfig(local_steps=2, local_steps_ramp=[0, 2])), r"local_steps_ramp=\[0, 2\]: expected integers > 0"),
        (dict(total_steps=2, rounds=RoundConfig(local_steps=2, local_steps_ramp=[1, 2, 1, 2])),
         r"total_steps=2 ends inside round 2 of rounds.local_steps_ramp=\[1, 2, 1, 2\]: expected a step its rounds end "
         r"at \(1, 3, 4, 6\) or a multiple of rounds.local_steps=2 from 6 on"),
        (dict(rounds=RoundConfig(local_steps=2, local_steps_ramp=[1, 1], overlap_delay=1)),
         r"rounds.overlap_delay=1 with rounds.local_steps_ramp=\[1, 1\]"),
        (dict(methods=["heloco"], rounds=RoundConfig(local_steps=2, local_steps_ramp=[1, 1])),
         r"rounds.local_steps_ramp=\[1, 1\] with the asynchronous method 'heloco'"),
        (dict(rounds=RoundConfig(local_steps=2, late_local_steps=3, late_from_step=2)),
         r"total_steps=4 with rounds.late_local_steps=3 from rounds.late_from_step=2: the late rounds start at step 2, "
         r"and the 2 steps after it are not a whole number of them"),
        (dict(rounds=RoundConfig(local_steps=2, late_local_steps=1, late_from_step=2, overlap_delay=1)),
         r"rounds.overlap_delay=1 with rounds.late_local_steps=1"),
        (dict(methods=["heloco"], rounds=RoundConfig(local_steps=2, late_local_steps=1, late_from_step=2)),
         r"rounds.late_local_steps=1 with the asynchronous method 'heloco'"),
    ],
)
def test_bad_config_is_named(tmp_path, overrides, match):
    cfg = tiny_config(tmp_path, **{"rounds": RoundConfig(local_steps=2), "total_steps": 4, **overrides})
    with pytest.raises(ValueError, match=match):
        train(cfg)


