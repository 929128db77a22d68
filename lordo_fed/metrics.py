"""Logging and measurement: JSONL metrics (+ optional TensorBoard), curve plots, byte counts,
stable rank.

- `MetricsWriter` appends one JSON object per line and flushes it at once, so a run that is
  killed keeps everything it logged; `read_jsonl` reads such a file back.
- `plot_curves` draws e.g. validation loss against tokens, one line per method, its axes labelled
  with units as `FIELDS` says (`curve_figure`: the same Figure, unsaved).
- `tensor_bytes` / `optimizer_state_bytes` measure what crosses the wire and what the optimizer
  keeps in memory (the two costs LoRDO reduces).
- `stable_rank` = ||A||_F² / ||A||_2², a smooth proxy for the rank of an update or a state.
- `peak_rss_bytes`: this process's peak resident set (what a client or server really held).
"""

from __future__ import annotations

import json
import math
import numbers
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with this module
    from matplotlib.figure import Figure


# -----------------------------------------------------------------------------
# JSONL (+ TensorBoard) writer


def _to_json(value: Any, where: str) -> Any:
    """Convert one record value to plain JSON: numpy/torch scalars to Python numbers,
    non-finite floats to None (JSON has no NaN/Infinity), arrays/tensors to (nested) lists."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 and value.dim() == 0 else value.tolist()
        return _to_json(value, where)
    if hasattr(value, "dtype") and hasattr(value, "tolist"):  # numpy scalar or array
        return _to_json(value.tolist(), where)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _to_json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(
        f"record field {where!r} is a {type(value).__name__}; allowed: None, bool, str, int, float, "
        "numpy/torch scalars or arrays, Path, and dicts/lists of those"
    )


class MetricsWriter:
    """Append metric records to `<out_dir>/<run_name>.jsonl`, one JSON object per line.

    With `tensorboard=True` every top-level numeric field (except "step") of each record is also
    written as a scalar to `<out_dir>/tb/<run_name>` at global step `record["step"]`.

        with MetricsWriter("runs", "lordo_h64") as mw:
            mw.write({"step": 100, "tokens": 3.2e6, "val_loss": 3.91})
    """

    def __init__(self, out_dir: str | Path, run_name: str, tensorboard: bool = False) -> None:
        if not isinstance(run_name, str) or not run_name or "/" in run_name or "\\" in run_name \
                or run_name in (".", ".."):
            raise ValueError(f"run_name={run_name!r}: expected a non-empty file name without '/' or '\\'")
        self.out_dir = Path(out_dir)
        self.run_name = run_name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"{run_name}.jsonl"
        # append: a resumed run continues the same file instead of overwriting its history
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: slow, optional

            self.tb_dir = self.out_dir / "tb" / run_name
            self._tb = SummaryWriter(log_dir=str(self.tb_dir))

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, record: Mapping[str, Any]) -> None:
        """Append `record` as one JSON line (flushed); also to TensorBoard if enabled."""
        if self.closed:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        if not isinstance(record, Mapping):
            raise ValueError(f"record must be a dict, got {type(record).__name__}")
        clean = {str(k): _to_json(v, str(k)) for k, v in record.items()}
        step = clean.get("step")
        # checked before writing anything, so a bad record leaves both logs untouched
        if self._tb is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise ValueError(
                f"record['step']={record.get('step')!r}: TensorBoard logging needs an integer 'step'"
            )
        # allow_nan=False: a NaN that slipped through would make the file invalid JSON
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()  # one line at a time, so a killed run keeps what it logged
        if self._tb is not None:
            for key, value in clean.items():
                if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue  # strings, lists, nulls (non-finite) are JSON-only
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()

    def close(self) -> None:
        """Close the JSONL file and the TensorBoard writer (idempotent)."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL metrics file into a list of dicts (blank lines are skipped)."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno} is not valid JSON ({e.msg}): {line[:80]!r}") from e
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}: line {lineno} is a JSON {type(record).__name__}, expected an object"
                )
            records.append(record)
    return records


# -----------------------------------------------------------------------------
# plots


@dataclass(frozen=True)
class Axis:
    """How a record field reads on a plot axis: a label, its unit, and whether it starts at 0."""

    label: str
    """What the field is, for a person: 'cumulative bytes per client, sent + received'."""
    unit: str = ""
    """'bytes' and 'tokens' pick a scale by magnitude ('MB' or 'GB'; 'thousands', 'millions' or
    'billions' of tokens); any other unit ('s') is printed as given; '' for none."""
    from_zero: bool = False
    """A count (tokens, bytes, rounds, steps) or a duration: the axis starts at 0, so a slope reads as
    a rate and two lines' heights as a ratio. Losses do not: their differences are what matter."""


FIELDS: dict[str, Axis] = {
    "tokens": Axis("tokens", "tokens", from_zero=True),
    "step": Axis("step", from_zero=True),
    "round": Axis("round", from_zero=True),
    "val_loss": Axis("validation loss (nats / token)"),
    "train_loss": Axis("training loss (nats / token)"),
    "val_ppl": Axis("validation perplexity"),
    "cum_bytes_per_client": Axis("cumulative bytes per client, sent + received", "bytes", from_zero=True),
    "bytes_sent_per_client": Axis("bytes sent per client per round", "bytes", from_zero=True),
    "bytes_received_per_client": Axis("bytes received per client per round", "bytes", from_zero=True),
    "cum_bytes_sent_per_worker": Axis("cumulative bytes sent per worker", "bytes", from_zero=True),
    "cum_bytes_received_per_worker": Axis("cumulative bytes received per worker", "bytes", from_zero=True),
    "server_peak_rss_bytes": Axis("server peak resident memory", "bytes", from_zero=True),
    "seconds": Axis("time", "s", from_zero=True),
    "round_seconds": Axis("round time", "s", from_zero=True),
    "elapsed_seconds": Axis("time since start", "s", from_zero=True),
    "virtual_time": Axis("virtual time", "s", from_zero=True),
}
"""The record fields the plots use, as they read on an axis; any other field is labelled with its
name (server/records.py, lordo_fed/trainer/cli.py and the docs name the fields)."""

_SCALES: dict[str, list[tuple[float, str]]] = {
    # (divisor, unit) from the largest down: the first whose divisor the data's largest value reaches
    "bytes": [(1e9, "GB"), (1e6, "MB")],  # MB below 1 GB, however small: runs are compared in MB
    "tokens": [(1e9, "billions"), (1e6, "millions"), (1e3, "thousands"), (1.0, "")],
}


def _axis_scale(field: str, values: list[float]) -> tuple[str, float, bool]:
    """(axis label with its unit, divisor for the values, starts at 0) of `field` over `values`.

    The divisor brings the values to a few digits, so the tick labels need no '1e6' offset."""
    axis = FIELDS.get(field, Axis(field))
    if axis.unit not in _SCALES:
        return (f"{axis.label} ({axis.unit})" if axis.unit else axis.label), 1.0, axis.from_zero
    top = max((abs(v) for v in values), default=0.0)
    scales = _SCALES[axis.unit]
    divisor, unit = next(((d, u) for d, u in scales if top >= d), scales[-1])
    return (f"{axis.label} ({unit})" if unit else axis.label), divisor, axis.from_zero


def curve_figure(
    runs: Mapping[str, list[dict]],
    x: str,
    y: str,
    title: str | None = None,
    logy: bool = False,
) -> Figure:
    """The Figure of `plot_curves` (not saved): one line per run, labelled axes with units, one legend."""
    # Figure + Agg canvas directly, not pyplot: no global backend switch, no figure left open
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("runs is empty: nothing to plot")
    lines = {}
    for run_name, records in runs.items():
        points = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
        if points:
            lines[run_name] = points
    if not lines:
        raise ValueError(f"no record in runs {sorted(runs)} has both {x!r} and {y!r}")
    xlabel, xdiv, xzero = _axis_scale(x, [p[0] for pts in lines.values() for p in pts])
    ylabel, ydiv, yzero = _axis_scale(y, [p[1] for pts in lines.values() for p in pts])
    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for run_name, points in lines.items():
        ax.plot([p[0] / xdiv for p in points], [p[1] / ydiv for p in points], label=run_name,
                marker="." if len(points) < 30 else None)
    if logy:
        ax.set_yscale("log")
    # no '1e6' offset or scientific notation on a linear axis: the values are already scaled
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    if not logy:
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    if xzero:
        ax.set_xlim(left=0)
    if yzero and not logy:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is None:
        what = FIELDS.get(y, Axis(y)).label
        title = f"{what[:1].upper()}{what[1:]} against {FIELDS.get(x, Axis(x)).label}"
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_curves(
    runs: Mapping[str, list[dict]],
    x: str,
    y: str,
    out_png: str | Path,
    title: str | None = None,
    logy: bool = False,
) -> Path:
    """One line per run of `y` against `x` (e.g. val_loss against tokens), saved as a PNG.

    Records without `x` or `y`, or where either is null (a non-finite value), are skipped, so a
    run's training and validation records can live in one list. Axes read as `FIELDS` says
    (label, unit scaled by magnitude, counts and durations from 0). Returns the PNG's path.
    """
    fig = curve_figure(runs, x, y, title=title, logy=logy)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png")
    return out_png


# -----------------------------------------------------------------------------
# measurements


def tensor_bytes(tensors: Tensor | Mapping | list | tuple) -> int:
    """Bytes of a tensor, or of all tensors in a (nested) dict/list/tuple: Σ numel · element_size.

    Used for communication volume (what a worker sends) and state memory; shared storage is
    counted once per reference, as it would be sent once per reference.
    """
    if isinstance(tensors, Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(getattr(tensors, "nbytes", None), int):  # a compressed tensor (wire.compress.Encoded): as encoded
        return tensors.nbytes
    if isinstance(tensors, Mapping):
        return sum(tensor_bytes(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return sum(tensor_bytes(v) for v in tensors)
    raise ValueError(
        f"tensor_bytes got a {type(tensors).__name__}; expected a Tensor or a dict/list/tuple of them"
    )


def _state_tensors(obj: Any, seen: set[int]) -> list[Tensor]:
    """All tensors reachable from one optimizer-state value, each once.

    Also looks inside plain objects' attributes: e.g. GaLore keeps its projection matrix in a
    projector object in `state["projector"]`, and that matrix is optimizer memory too.
    """
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _state_tensors(v, seen)]
    if isinstance(obj, (list, tuple, set)):
        return [t for v in obj for t in _state_tensors(v, seen)]
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return [t for v in vars(obj).values() for t in _state_tensors(v, seen)]
    return []  # numbers, strings, None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in `optimizer.state` (moments, step counters, projections...).

    A tensor referenced twice is counted once: this is memory, not traffic.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer is a {type(optimizer).__name__}, expected a torch.optim.Optimizer")
    seen: set[int] = set()
    return sum(tensor_bytes(t) for state in optimizer.state.values() for t in _state_tensors(state, seen))


def stable_rank(matrix: Tensor) -> float:
    """Stable rank ||A||_F² / ||A||_2² = Σ σ_i² / σ_1², computed in fp32.

    Lies in [1, rank(A)]; 1 for a rank-1 matrix, n for an n×n orthogonal one. Returns 0.0 for the
    zero matrix (e.g. a momentum buffer before its first update) rather than dividing by zero.
    """
    if not isinstance(matrix, Tensor) or matrix.dim() != 2:
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise ValueError(f"stable_rank needs a 2-D tensor, got {shape}")
    s = torch.linalg.svdvals(matrix.detach().to(torch.float32))
    top = s.max() if s.numel() else torch.tensor(0.0)
    if top == 0:
        return 0.0
    return float((s.square().sum() / top.square()).item())


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, in bytes: VmHWM from /proc/self/status (Linux).

    VmHWM is the high-water mark of this process's own address space. `getrusage(RUSAGE_SELF)
    .ru_maxrss` is only the fallback where /proc is missing: on Linux it carries the parent's
    high-water mark across fork/exec, so a fresh child (a ClientApp process, a benchmark's client)
    would read as large as the process that started it.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    import resource  # Unix only; imported here so this module imports everywhere

    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
