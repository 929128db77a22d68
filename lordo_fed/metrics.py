"""Logging and measurement: JSONL metrics (+ optional TensorBoard), curve plots, byte counts,
stable rank.

- `MetricsWriter` appends one JSON object per line and flushes it at once, so a run that is
  killed keeps everything it logged; `read_jsonl` reads such a file back.
- `plot_curves` draws e.g. validation loss against tokens, one line per method.
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
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor


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
    run's training and validation records can live in one list. Returns the PNG's path.
    """
    # Figure + Agg canvas directly, not pyplot: no global backend switch, no figure left open
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("runs is empty: nothing to plot")
    fig = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    n_lines = 0
    for run_name, records in runs.items():
        points = [
            (r[x], r[y]) for r in records
            if r.get(x) is not None and r.get(y) is not None
        ]
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, label=run_name, marker="." if len(points) < 30 else None)
        n_lines += 1
    if n_lines == 0:
        raise ValueError(f"no record in runs {sorted(runs)} has both {x!r} and {y!r}")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title if title is not None else f"{y} vs {x}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
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
