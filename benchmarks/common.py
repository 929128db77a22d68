"""Helpers shared by the benchmark scripts: machine description, argparse, JSON output, figures.

    from benchmarks.common import RESULTS, make_parser, machine_info, write_json, new_figure

Every benchmark takes `--quick` (a small configuration that finishes in seconds: what the test
suite runs) and `--out PATH` (the JSON file; a figure, when there is one, goes next to it with the
same stem and `.png`). Results default to `benchmarks/results/<name>.json`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

GPT2_VOCAB = 50257
"""The GPT-2 BPE vocabulary the paper's parameter counts assume."""
BYTE_VOCAB = 256
"""Our default tokenizer (UTF-8 bytes)."""
RANKS = {"tiny": 8, "small": 16, "16m": 32, "125m": 96, "360m": 128, "720m": 256}
"""Rank r per preset: dim / 8 (the paper's 720M setting, r = 256 at d = 2048)."""


def machine_info() -> dict[str, Any]:
    """Where a result was measured: versions, the CPU (its model and the vector instructions torch's
    kernels use), CPU count, platform, memory and load.

    The CPU is named because a run's figures depend on it bit for bit: the same commit and seed give
    other floating-point roundings under another kernel set, and over a training run those grow into
    differences of the order of the seeds' (docs/results.md section 12, part six). Results are
    compared side by side on one machine; these fields say when two were not. An AVX512 machine gives
    an AVX2 one's runs bit for bit with `ATEN_CPU_CAPABILITY=avx2` (same CPU model; section 12, part
    twenty-six), and then records AVX2 here."""
    import torch  # here, not at the top: scripts that only need the other helpers start fast

    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    for name in ("numpy", "protobuf", "flwr"):  # read from the installed metadata: nothing imported
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - each is a dependency
            pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_bytes"] = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return info


HOST_KEYS = ("cpu_model", "torch_cpu_capability", "torch")
"""The fields of `machine_info` that two runs must share to compare bit for bit: the CPU's kernels and torch's
version change a run's roundings (see `machine_info`); the kernel's version in `platform` does not
(docs/results.md, section 17, part twenty)."""


def host_of(machine: dict[str, Any]) -> dict[str, Any]:
    """The `HOST_KEYS` of a `machine_info` record (None where it lacks one)."""
    return {k: machine.get(k) for k in HOST_KEYS}


def require_host(theirs: dict[str, Any], mine: dict[str, Any], what: str, remedy: str, verb: str = "measured") -> None:
    """Raise ValueError naming both hosts (`host_of` records) when `theirs` is not `mine`: `what` was `verb` on
    another host, so its figures are not this machine's; `remedy` says what to do. Where only torch's kernel set
    differs, the message adds the variable that gives torch `theirs` (docs/results.md section 12, part twenty-six)."""
    if theirs == mine:
        return
    kernels = ""
    if {k: v for k, v in theirs.items() if k != "torch_cpu_capability"} == \
            {k: v for k, v in mine.items() if k != "torch_cpu_capability"} and theirs.get("torch_cpu_capability"):
        kernels = (f", or give torch their kernels where this CPU has them "
                   f"(ATEN_CPU_CAPABILITY={str(theirs['torch_cpu_capability']).lower()})")
    raise ValueError(f"{what}: {verb} on {theirs}; this machine is {mine}, and a run's figures depend on the host bit "
                     f"for bit: {remedy}{kernels}")


def make_parser(name: str, doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """An ArgumentParser with `--quick` and `--out` (default benchmarks/results/<name>.json)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", default=str(RESULTS / f"{name}.json"),
                        help="JSON result file; the figure is written next to it as <stem>.png "
                             "(default: %(default)s)")
    return parser


def png_path(out: str | Path) -> Path:
    """The figure that goes with JSON result `out`."""
    return Path(out).with_suffix(".png")


def write_json(result: dict[str, Any], out: str | Path) -> Path:
    """Write `result` (plain JSON: no NaN) to `out`, creating its folder. Returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return out


def code_info() -> dict[str, Any]:
    """What code a result measured: this tree's git commit, whether tracked files had changes, and
    where `lordo_fed` was imported from. The processes a benchmark starts (a deployment's SuperNodes,
    node workers, ServerApp) import the package as this one does, so with an editable install of
    another checkout they run that checkout's code beside this tree's server/ and client/: warned
    about here (run with PYTHONPATH=<this tree>) and recorded."""
    import lordo_fed

    package = Path(lordo_fed.__file__).resolve().parent
    info: dict[str, Any] = {"package": str(package), "commit": None, "dirty": None}
    try:
        git = ["git", "-C", str(ROOT)]
        info["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                        timeout=30).stdout.strip()
        info["dirty"] = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                            text=True, check=True, timeout=30).stdout.strip())
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked release): no commit to name
        pass
    if package.parent != ROOT:
        print(f"[benchmarks] lordo_fed is imported from {package}, not from this tree ({ROOT}): the figures would "
              f"measure that code; run with PYTHONPATH={ROOT}", file=sys.stderr, flush=True)
    return info


def result_header(benchmark: str, quick: bool, config: dict[str, Any]) -> dict[str, Any]:
    """The common top of every result file: the benchmark, its command, the machine and the code."""
    return {"benchmark": benchmark, "quick": quick, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": machine_info(), "code": code_info(), "config": config}


def new_figure(width: float, height: float):
    """A matplotlib Figure with an Agg canvas (no pyplot, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as bandwidth is quoted)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


def median_rounds_2_to_n(rows: list[dict[str, Any]], skip: Iterable[str] = ("round",)) -> dict[str, float]:
    """Per numeric field of per-round `rows` (each with a "round"; fields in `skip` left out), the
    median over rounds 2..N: round 1 includes warm-up (all rows when there is no round 2). A field
    that some rows lack (or hold as None) takes the median of the rows that have it."""
    later = [r for r in rows if r["round"] >= 2] or rows
    skipped = set(skip)
    keys = sorted({k for r in later for k, v in r.items() if k not in skipped and isinstance(v, (int, float))})
    return {k: statistics.median(r[k] for r in later if isinstance(r.get(k), (int, float))) for k in keys}


def print_rows(head: str, lines: Iterable[str]) -> None:
    """Print a text table: the header `head`, a dashed rule as wide, then one line per row."""
    print(head)
    print("-" * len(head))
    for line in lines:
        print(line)


def stop_children_on_sigterm() -> None:
    """Make SIGTERM (`kill`, `pkill`, a job's time limit) stop a benchmark the way Ctrl-C does: it raises
    SystemExit in the main thread, so a `subprocess.run` waiting on a trainer kills and reaps it on the way
    out. Without this the benchmark died at once and its trainer ran on, orphaned, taking a core."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_child(script: str | Path, spec: dict[str, Any], what: str, timeout: float,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `script --child <spec as JSON>` in a fresh, single-threaded process (its peak RSS is
    its own) and return the JSON its last stdout line holds; RuntimeError naming `what` if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(env or {}))
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, str(Path(script).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
