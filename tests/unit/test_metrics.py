"""Metrics: JSONL writer/reader, TensorBoard scalars, plots, byte counts, stable rank."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lordo_fed.metrics import (
    MetricsWriter,
    optimizer_state_bytes,
    plot_curves,
    read_jsonl,
    stable_rank,
    tensor_bytes,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


# -----------------------------------------------------------------------------
# JSONL


def test_jsonl_round_trip_with_nan_and_scalars(tmp_path):
    with MetricsWriter(tmp_path, "run_a") as mw:
        mw.write({"step": 0, "loss": 4.5, "lr": 1e-3, "method": "lordo"})
        mw.write({
            "step": np.int64(1),
            "loss": float("nan"),
            "grad_norm": float("inf"),
            "np_loss": np.float32(2.5),
            "torch_loss": torch.tensor(3.25),
            "ok": np.bool_(True),
            "ranks": torch.tensor([1, 2]),
        })
    assert mw.path == tmp_path / "run_a.jsonl"
    records = read_jsonl(mw.path)
    assert records == [
        {"step": 0, "loss": 4.5, "lr": 1e-3, "method": "lordo"},
        {"step": 1, "loss": None, "grad_norm": None, "np_loss": 2.5, "torch_loss": 3.25, "ok": True,
         "ranks": [1, 2]},
    ]
    # strict JSON on disk: no bare NaN/Infinity tokens
    text = mw.path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    for line in text.splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))


def test_appends_to_existing_file(tmp_path):
    with MetricsWriter(tmp_path, "r") as mw:
        mw.write({"step": 1})
    with MetricsWriter(tmp_path, "r") as mw:
        mw.write({"step": 2})
    assert [r["step"] for r in read_jsonl(tmp_path / "r.jsonl")] == [1, 2]


def test_lines_visible_before_close(tmp_path):
    mw = MetricsWriter(tmp_path / "sub", "open_run")  # also creates the missing directory
    mw.write({"step": 1, "loss": 2.0})
    mw.write({"step": 2, "loss": 1.5})
    assert read_jsonl(tmp_path / "sub" / "open_run.jsonl") == [
        {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}
    ]
    mw.close()
    mw.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        mw.write({"step": 3})


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2, "loss": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3 is not valid JSON"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2 is a JSON list, expected an object"):
        read_jsonl(path)


def test_writer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"run_name='a/b'"):
        MetricsWriter(tmp_path, "a/b")
    with pytest.raises(ValueError, match=r"run_name=''"):
        MetricsWriter(tmp_path, "")
    with MetricsWriter(tmp_path, "r") as mw:
        with pytest.raises(ValueError, match=r"record field 'model' is a object"):
            mw.write({"step": 1, "model": object()})
        with pytest.raises(ValueError, match=r"record must be a dict, got list"):
            mw.write([1, 2])  # type: ignore[arg-type]


# -----------------------------------------------------------------------------
# TensorBoard


def test_tensorboard_scalars_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, "tb_run", tensorboard=True) as mw:
        mw.write({"step": 10, "train_loss": 3.5, "tokens": 1024, "method": "lordo"})
        mw.write({"step": 20, "train_loss": 2.75, "val_loss": 3.0, "tokens": 2048})
        mw.write({"step": 30, "train_loss": float("nan")})  # null in JSON, not in TensorBoard
        with pytest.raises(ValueError, match=r"record\['step'\]=None.*integer 'step'"):
            mw.write({"loss": 1.0})
    assert len(read_jsonl(tmp_path / "tb_run.jsonl")) == 3  # the rejected record was not written

    tb_dir = tmp_path / "tb" / "tb_run"
    assert any(p.name.startswith("events.out.tfevents") for p in tb_dir.iterdir())
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train_loss", "val_loss", "tokens"}
    assert [(e.step, e.value) for e in acc.Scalars("train_loss")] == [(10, 3.5), (20, 2.75)]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [(20, 3.0)]
    assert [(e.step, e.value) for e in acc.Scalars("tokens")] == [(10, 1024.0), (20, 2048.0)]


# -----------------------------------------------------------------------------
# plots


def test_plot_curves_writes_png(tmp_path):
    runs = {
        "average": [{"tokens": t, "val_loss": 5.0 - 0.3 * i} for i, t in enumerate(range(0, 5000, 1000))],
        "lordo": [{"tokens": 0, "train_loss": 9.0}]  # no val_loss: skipped
        + [{"tokens": t, "val_loss": 4.8 - 0.35 * i} for i, t in enumerate(range(0, 5000, 1000))]
        + [{"tokens": 6000, "val_loss": None}],  # a NaN logged as null: skipped
    }
    out = plot_curves(runs, x="tokens", y="val_loss", out_png=tmp_path / "plots" / "val.png",
                      title="validation loss", logy=True)
    assert out == tmp_path / "plots" / "val.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1024


def rendered_axes(monkeypatch, tmp_path, runs, x, y, **kw):
    """Draw with plot_curves and return the saved Figure's one Axes, drawn (tick and offset texts set)."""
    from matplotlib.figure import Figure

    saved = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), save(fig, *a, **k))[1])
    plot_curves(runs, x, y, tmp_path / "plot.png", **kw)
    (fig,) = saved
    fig.canvas.draw()
    (ax,) = fig.axes
    return ax


def test_plot_of_bytes_against_tokens_reads_with_units_from_zero(monkeypatch, tmp_path):
    """What a person sees: units on both axes, values scaled (no '1e6' offset), bytes and tokens
    from 0, one legend for the runs."""
    # a 16m-sized run: 2.4-24 M tokens, 0.3-3 GB per client
    history = [{"round": r, "tokens": 2_400_000 * r, "cum_bytes_per_client": 300_000_000 * r} for r in range(1, 11)]
    other = [{**rec, "cum_bytes_per_client": rec["cum_bytes_per_client"] // 2} for rec in history]
    ax = rendered_axes(monkeypatch, tmp_path, {"lordo_global": history, "lordo_local": other},
                       "tokens", "cum_bytes_per_client", title="Cumulative bytes per client against tokens")
    assert ax.get_title() == "Cumulative bytes per client against tokens"
    assert ax.get_xlabel() == "tokens (millions)"
    assert ax.get_ylabel() == "cumulative bytes per client, sent + received (GB)"
    assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] == 0
    assert ax.xaxis.get_offset_text().get_text() == "" and ax.yaxis.get_offset_text().get_text() == ""
    assert max(line.get_ydata().max() for line in ax.get_lines()) == pytest.approx(3.0)  # GB, not bytes
    legends = [c for c in ax.figure.findobj() if type(c).__name__ == "Legend"]
    assert len(legends) == 1 and [t.get_text() for t in legends[0].get_texts()] == ["lordo_global", "lordo_local"]
    # under 1 GB: MB
    small = [{"tokens": 1000 * r, "cum_bytes_per_client": 2_000_000 * r} for r in range(1, 5)]
    ax = rendered_axes(monkeypatch, tmp_path, {"a": small}, "tokens", "cum_bytes_per_client")
    assert ax.get_ylabel().endswith("(MB)") and ax.get_xlabel() == "tokens (thousands)"
    assert ax.get_title() == "Cumulative bytes per client, sent + received against tokens"


def test_plot_of_seconds_and_of_an_unknown_field(monkeypatch, tmp_path):
    """server/records.py's link plot (seconds against round); an unknown field keeps its name; a
    loss does not start at 0."""
    runs = {"measured": [{"round": r, "seconds": 7.0 + r} for r in range(1, 4)],
            "link-bound ideal": [{"round": r, "seconds": 2.0} for r in range(1, 4)]}
    ax = rendered_axes(monkeypatch, tmp_path, runs, "round", "seconds")
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("round", "time (s)")
    assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0  # a duration: two lines' heights read as a ratio
    ax = rendered_axes(monkeypatch, tmp_path, {"a": [{"step": s, "my_metric": 1e7 + s} for s in range(5)]},
                       "step", "my_metric")
    assert ax.get_ylabel() == "my_metric" and ax.yaxis.get_offset_text().get_text() == ""
    ax = rendered_axes(monkeypatch, tmp_path, {"a": [{"tokens": t, "val_loss": 3.0 - t / 1e4} for t in range(5)]},
                       "tokens", "val_loss")
    assert ax.get_ylabel() == "validation loss (nats / token)" and ax.get_ylim()[0] > 2


def test_plot_curves_needs_some_data(tmp_path):
    with pytest.raises(ValueError, match=r"no record in runs \['a'\] has both 'tokens' and 'val_loss'"):
        plot_curves({"a": [{"tokens": 1, "train_loss": 2.0}]}, "tokens", "val_loss", tmp_path / "x.png")
    with pytest.raises(ValueError, match="runs is empty"):
        plot_curves({}, "tokens", "val_loss", tmp_path / "x.png")


# -----------------------------------------------------------------------------
# bytes


def test_tensor_bytes():
    assert tensor_bytes(torch.zeros(3, 4, dtype=torch.float32)) == 48
    assert tensor_bytes(torch.zeros(10, dtype=torch.bfloat16)) == 20
    assert tensor_bytes(torch.zeros(5, dtype=torch.int64)) == 40
    nested = {
        "a": torch.zeros(2, 2),                               # 16
        "b": [torch.zeros(3, dtype=torch.bfloat16),           # 6
              (torch.zeros(1, dtype=torch.int64),)],          # 8
        "c": {"d": torch.zeros(0), "e": torch.zeros(())},     # 0 + 4
    }
    assert tensor_bytes(nested) == 34
    assert tensor_bytes([]) == 0
    with pytest.raises(ValueError, match=r"tensor_bytes got a int"):
        tensor_bytes({"a": 3})


def test_optimizer_state_bytes_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))  # 12+4+8+2 = 26 params
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    assert optimizer_state_bytes(opt) == 0
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    # exp_avg + exp_avg_sq: 2 × 26 × 4 bytes = 208, plus one fp32 scalar `step` per tensor: 4 × 4 = 16
    assert optimizer_state_bytes(opt) == 224


def test_optimizer_state_bytes_looks_inside_objects():
    # GaLore-style: projection matrix held by a projector object in the state
    class Projector:
        def __init__(self):
            self.ortho_matrix = torch.zeros(4, 2)  # 32 bytes
            self.rank = 2

    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.SGD([p], lr=0.1)
    shared = torch.zeros(4)  # 16 bytes, referenced twice, counted once
    opt.state[p] = {"projector": Projector(), "a": shared, "b": shared, "step": 3}
    assert optimizer_state_bytes(opt) == 48
    with pytest.raises(ValueError, match=r"optimizer is a dict"):
        optimizer_state_bytes({})  # type: ignore[arg-type]


# -----------------------------------------------------------------------------
# stable rank


def test_stable_rank():
    u, v = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 4.0, -1.0, 2.0])
    assert stable_rank(torch.outer(u, v)) == pytest.approx(1.0, abs=1e-5)
    assert stable_rank(torch.eye(7)) == pytest.approx(7.0, abs=1e-5)
    # diag(2, 1): (4 + 1) / 4
    assert stable_rank(torch.diag(torch.tensor([2.0, 1.0]))) == pytest.approx(1.25, abs=1e-6)
    assert stable_rank(torch.eye(5, dtype=torch.bfloat16)) == pytest.approx(5.0, abs=1e-5)
    assert stable_rank(torch.zeros(3, 3)) == 0.0
    assert isinstance(stable_rank(torch.eye(2)), float)
    with pytest.raises(ValueError, match=r"2-D tensor, got \(3,\)"):
        stable_rank(torch.ones(3))


def test_stable_rank_within_bounds():
    a = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    r = stable_rank(a)
    assert 1.0 <= r <= 8.0 and not math.isnan(r)


