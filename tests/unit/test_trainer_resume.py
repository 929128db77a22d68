"""The reference trainer's checkpoints (lordo_fed.trainer.checkpoints): a run killed after a round and started
again with the same settings ends where the uninterrupted run ends, bit for bit, and writes the same records."""

import json
import time

import pytest
import torch

from lordo_fed.checkpoint import CheckpointError, list_checkpoints
from lordo_fed.data import DataConfig
from lordo_fed.model import ModelConfig
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.config import AsyncConfig, RoundConfig
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.trainer.cli import train
from lordo_fed.trainer.config import TrainConfig
from lordo_fed.trainer.run import RunContext, run_method
from lordo_fed.data import load_dataset
from lordo_fed.device import pick_device

TIMES = ("round_seconds", "aggregation_seconds")
"""Wall-clock fields of a record: the only ones a continued run may write differently."""


class Killed(Exception):
    """The failure injected into a run: raised by its emit, as a kill between two rounds."""


def config(out, method: str, **kw) -> TrainConfig:
    base = dict(methods=[method], workers=2, total_steps=12, eval_batches=2, eval_every=2, out_dir=str(out),
                progress=False, checkpoint_every=2, model=ModelConfig(preset="tiny"),
                data=DataConfig(cache_dir=str(out / "cache"), seq_len=32, batch_size=4),
                inner=InnerConfig(rank=4, warmup_steps=2, lr=5e-3, omega=0.9), rounds=RoundConfig(local_steps=2))
    base.update(kw)
    return TrainConfig(**base).validate()


def run(cfg: TrainConfig, kill_at_round: int | None = None, seconds_before: float = 0.0) -> tuple[dict, list]:
    """`cfg`'s method run in this process; with `kill_at_round`, killed as it emits that round's record (the
    round after a checkpoint: what the checkpoint holds is all a continued run has). `seconds_before`: as if
    this run had itself been continued after that many seconds' training."""
    records: list = []

    def emit(record: dict) -> None:
        if record.get("round") == kill_at_round and "train_loss" in record:
            raise Killed
        records.append(record)

    dataset = load_dataset(cfg.data, cfg.workers)
    ctx = RunContext(cfg, dataset, pick_device("cpu"), dataset.val_batches(cfg.eval_batches), emit, seconds_before)
    settings = resolve_method(cfg.methods[0], cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps)
    model = run_method(ctx, settings)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, records


def untimed(records: list) -> list:
    return [{k: v for k, v in json.loads(json.dumps(r, default=float)).items() if k not in TIMES} for r in records]


@pytest.mark.parametrize("method,extra", [
    ("lordo_global", {}),
    ("lordo_global", {"payload_dtype": "int8", "rounds": RoundConfig(local_steps=2, local_steps_ramp=[1, 1])}),
    ("lordo_local", {}),
    ("diloco", {}),
    ("lowrank_ddp", {}),
    ("ddp", {}),
])
def test_a_killed_run_continued_ends_where_the_uninterrupted_run_ends(tmp_path, method, extra):
    whole, whole_records = run(config(tmp_path / "whole", method, **extra))
    cfg = config(tmp_path / "killed", method, **extra)
    with pytest.raises(Killed):
        run(cfg, kill_at_round=5)  # rounds 1-4 done, the checkpoint of round 4 written
    assert [r for r, _ in list_checkpoints(tmp_path / "killed" / "checkpoints" / method)] == [2, 4]
    continued, records = run(cfg)
    for name, p in whole.items():
        assert torch.equal(continued[name], p), name
    assert untimed(records) == untimed(whole_records)  # the records before the kill emitted again, then the rest


def test_a_continued_run_writes_the_whole_history_once_and_a_finished_run_trains_nothing(tmp_path):
    """Through `train` (what lordo-train and the benchmarks call): the JSONL of a killed and continued run is
    the uninterrupted run's, and a run started again after its last checkpoint loads it and ends at once."""
    whole = train(config(tmp_path / "whole", "lordo_global"))["lordo_global"]
    cfg = config(tmp_path / "killed", "lordo_global")
    with pytest.raises(Killed):
        run(cfg, kill_at_round=3, seconds_before=1000.0)  # its checkpoint: 1000 s and this part's
    started = time.perf_counter()
    continued = train(cfg)["lordo_global"]
    # the summary's seconds: the killed parts' (from the checkpoint) and the continued part's
    assert 1000.0 < continued["seconds"] < 1000.0 + 2 * (time.perf_counter() - started) + 60.0
    assert (continued["val_loss"], continued["tokens"]) == (whole["val_loss"], whole["tokens"])
    lines = [untimed([json.loads(x) for x in (tmp_path / d / "lordo_global.jsonl").read_text().splitlines()])
             for d in ("whole", "killed")]
    assert lines[0] == lines[1] and [r["round"] for r in lines[1] if "val_loss" in r] == [0, 2, 4, 6]
    started = time.perf_counter()
    again = train(cfg)["lordo_global"]  # the checkpoint of the last round: nothing left to train
    assert again["val_loss"] == whole["val_loss"]
    assert again["seconds"] - continued["seconds"] <= time.perf_counter() - started


def test_a_checkpoint_of_other_settings_is_refused_naming_them(tmp_path):
    cfg = config(tmp_path, "lordo_global")
    with pytest.raises(Killed):
        run(cfg, kill_at_round=3)
    other = config(tmp_path, "lordo_global", inner=InnerConfig(rank=4, warmup_steps=2, lr=1e-3, omega=0.9))
    with pytest.raises(CheckpointError, match=r"config.inner.lr is 0.005 in the checkpoint, expected 0.001"):
        run(other)
    assert [r for r, _ in list_checkpoints(tmp_path / "checkpoints" / "lordo_global")] == [2]  # nothing overwritten
    moved = config(tmp_path, "lordo_global", progress=True, threads=1)  # how it shows and runs: not compared
    run(moved)


@pytest.mark.parametrize("value,expected", [
    (-1, r"checkpoint_every=-1: expected an integer >= 0"),
    (True, r"checkpoint_every=True: expected an integer >= 0"),
])
def test_checkpoint_every_bad_values(tmp_path, value, expected):
    with pytest.raises(ValueError, match=expected):
        config(tmp_path, "lordo_global", checkpoint_every=value)


UNEQUAL = dict(speeds=[1.0, 3.0], local_steps=[2, 3])
"""Worker 1 three times slower, with its own local steps: its replies arrive stale, and records fall between the
arrivals of a round in flight."""


@pytest.mark.parametrize("method,extra", [
    ("heloco", {"async_rounds": AsyncConfig(**UNEQUAL, grace=3.0, staleness_exponent=0.5)}),  # a window open at round 4
    ("heloco_lordo", {"async_rounds": AsyncConfig(**UNEQUAL)}),
    ("async_lordo", {"async_rounds": AsyncConfig(**UNEQUAL), "payload_dtype": "int8"}),
    ("async_diloco", {"async_rounds": AsyncConfig(**UNEQUAL), "payload_dtype": "topk2bit-both-wide"}),
    ("async_lordo", {"async_rounds": AsyncConfig(**UNEQUAL, grace=3.0, cache="ca2fl")}),  # each worker's latest Δ kept
], ids=["heloco-grace-staleness", "heloco_lordo", "async_lordo-int8", "async_diloco-topk2bit-both", "async_lordo-ca2fl"])
def test_a_killed_asynchronous_run_continued_ends_where_the_uninterrupted_run_ends(tmp_path, method, extra):
    """On the virtual clock: the checkpoint holds the rounds in flight (the slow worker's Δ, made from an older θ
    and, for async LoRDO, in an older basis), each worker's copy θ_c of a compressed downlink, the grace window's
    arrivals; the continued run applies them as the uninterrupted one does."""
    extra = {**extra, "total_steps": 16}  # 13 pushes or so: 7 records, checkpoints after the 2nd, 4th, ...
    whole, whole_records = run(config(tmp_path / "whole", method, **extra))
    assert max(r.get("staleness_max", 0) for r in whole_records) >= 1  # stale replies were in flight
    cfg = config(tmp_path / "killed", method, **extra)
    with pytest.raises(Killed):
        run(cfg, kill_at_round=5)
    saved = [r for r, _ in list_checkpoints(tmp_path / "killed" / "checkpoints" / method)]
    assert saved and max(saved) < 5, saved
    continued, records = run(cfg)
    for name, p in whole.items():
        assert torch.equal(continued[name], p), name
    assert untimed(records) == untimed(whole_records)
    again, records = run(cfg)  # started after its end: its last checkpoint loaded, nothing left to train
    assert all(torch.equal(again[n], p) for n, p in whole.items()) and untimed(records) == untimed(whole_records)


def test_a_continued_run_logs_each_step_to_tensorboard_once(tmp_path, monkeypatch):
    """With `tensorboard`, the log of a run killed inside `train` and continued holds each (tag, step) once, as
    the uninterrupted run's does: the earlier records emitted again replace the killed part's log."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from lordo_fed.metrics import MetricsWriter

    def logged(directory) -> list:
        return sorted((v.tag, e.step) for f in sorted(directory.iterdir()) for e in EventFileLoader(str(f)).Load()
                      for v in e.summary.value)

    train(config(tmp_path / "whole", "lordo_global", tensorboard=True))
    cfg = config(tmp_path / "killed", "lordo_global", tensorboard=True)
    write = MetricsWriter.write

    def killed_at_round_5(self, record):
        if record.get("round") == 5 and "train_loss" in record:
            raise Killed
        write(self, record)

    monkeypatch.setattr(MetricsWriter, "write", killed_at_round_5)
    with pytest.raises(Killed):
        train(cfg)
    monkeypatch.setattr(MetricsWriter, "write", write)
    killed = logged(tmp_path / "killed" / "tb" / "lordo_global")
    assert killed and max(step for _, step in killed) == 8  # rounds 1-4 of K = 2 logged before the kill
    train(cfg)
    whole, continued = (logged(tmp_path / d / "tb" / "lordo_global") for d in ("whole", "killed"))
    assert continued == whole and len(set(whole)) == len(whole)
