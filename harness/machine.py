"""What the machine did while a run ran: the evidence that a failure inside Ray's start-up needs.

Ray waits a fixed 30 s for each step of its start-up (the GCS writing its port file, the raylet
registering with the GCS), and a simulation that misses one fails with Flower's exit code 700,
often with nothing in Ray's own logs. Whether the machine stalled (CPU, I/O or memory pressure),
killed a process for memory, ran short of disk, or was paused and resumed (its wall clock stepped
against its monotonic clock) can only be read while the machine still shows it: take
`Machine.now()` before the run and `machine_report(before)` after it fails.

Linux only; every reading that the machine does not offer (no PSI, `dmesg` refused) is left out,
never guessed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_PSI = ("cpu", "io", "memory")
_DMESG_LINE = re.compile(r"^\[\s*(\d+\.\d+)\]\s?(.*)$")
_USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _psi_totals() -> dict[str, float]:
    """Seconds stalled since boot, by resource and kind ('io full': every task waited on I/O)."""
    totals: dict[str, float] = {}
    for resource in _PSI:
        text = _read(f"/proc/pressure/{resource}") or ""
        for line in text.splitlines():
            kind, _, rest = line.partition(" ")
            match = re.search(r"total=(\d+)", rest)
            if match:
                totals[f"{resource} {kind}"] = int(match.group(1)) / 1e6
    return totals


def _vmstat(keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (_read("/proc/vmstat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name in keys:
            out[name] = int(value)
    return out


def _steal_seconds() -> float | None:
    """CPU time the hypervisor gave to others while this VM wanted it (/proc/stat's 8th field)."""
    first = (_read("/proc/stat") or "").split("\n", 1)[0].split()
    return int(first[8]) / _USER_HZ if len(first) > 8 and first[0] == "cpu" else None


def _uptime() -> float | None:
    text = _read("/proc/uptime")
    return float(text.split()[0]) if text else None


class Watchdog:
    """A daemon thread that wakes every `period` seconds and keeps each gap between two wake-ups longer
    than `threshold`: a gap of seconds where the period is 0.1 s means this process, or the whole VM,
    was not run (a paused and resumed VM moves both clocks on together, so no clock step shows it;
    CPU contention alone delays a wake-up by milliseconds)."""

    def __init__(self, period: float = 0.1, threshold: float = 1.0):
        self.period, self.threshold = period, threshold
        self._gaps: list[tuple[float, float]] = []  # (monotonic at the late wake-up, gap)
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="machine-watchdog", daemon=True).start()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(self.period)
            now = time.monotonic()
            if now - last > self.threshold:
                with self._lock:
                    self._gaps.append((now, now - last))
            last = now

    def gaps_since(self, since: float) -> list[tuple[float, float]]:
        """The gaps over the threshold that ended after monotonic time `since`: (end, length)."""
        with self._lock:
            return [g for g in self._gaps if g[0] >= since]


_watchdog: Watchdog | None = None
_watchdog_lock = threading.Lock()


def watchdog() -> Watchdog:
    """This process's watchdog, started on first use."""
    global _watchdog
    with _watchdog_lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog


@dataclass(frozen=True)
class Machine:
    """One reading of the counters that `machine_report` compares."""

    monotonic: float
    """time.monotonic() at the reading."""
    wall: float
    """time.time() at the reading: its change minus the monotonic one is a clock step (a pause, a resume)."""
    uptime: float | None
    """Seconds since boot (/proc/uptime), to pick the kernel log lines written since."""
    steal: float | None
    """Seconds of CPU stolen by the hypervisor since boot."""
    psi: dict[str, float] = field(default_factory=dict)
    """Pressure-stall seconds since boot ('cpu some', 'io full', 'memory full', ...)."""
    vmstat: dict[str, int] = field(default_factory=dict)
    """oom_kill and pgmajfault since boot."""

    @classmethod
    def now(cls) -> "Machine":
        watchdog()  # from the first reading on, gaps in this process's schedule are kept
        return cls(time.monotonic(), time.time(), _uptime(), _steal_seconds(), _psi_totals(),
                   _vmstat(("oom_kill", "pgmajfault")))


def kernel_log_since(uptime: float | None, limit: int = 20) -> list[str] | None:
    """The kernel's log lines stamped at or after `uptime` (seconds since boot), the last `limit`;
    None when `dmesg` is not readable here."""
    if uptime is None:
        return None
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    text = done.stdout
    lines = []
    for line in text.splitlines():
        match = _DMESG_LINE.match(line)
        if match and float(match.group(1)) >= uptime:
            lines.append(line)
    return lines[-limit:]


def machine_report(before: Machine, paths: tuple[str, ...] = ("/tmp",)) -> str:
    """What changed on the machine since `before`, on a few lines: the clock step, stolen CPU,
    pressure stalls, OOM kills, major faults, then load, available memory and free disk of `paths`,
    and the kernel's log lines written since."""
    after = Machine.now()
    elapsed = after.monotonic - before.monotonic
    parts = [f"wall clock stepped {(after.wall - before.wall) - elapsed:+.1f} s against the monotonic clock"]
    dog = watchdog()
    gaps = dog.gaps_since(before.monotonic)
    parts.append(f"gaps over {dog.threshold:.0f} s in this process's {dog.period} s schedule: " + (
        ", ".join(f"{gap:.1f} s ({end - gap - before.monotonic:.1f} s into the run)" for end, gap in gaps[-5:])
        if gaps else "none"))
    if before.steal is not None and after.steal is not None:
        parts.append(f"CPU stolen by the hypervisor {after.steal - before.steal:.1f} s")
    stalls = [f"{k} {after.psi[k] - before.psi[k]:.1f} s" for k in after.psi if k in before.psi]
    if stalls:
        parts.append("pressure stalls: " + ", ".join(stalls))
    for key, label in (("oom_kill", "processes killed for memory"), ("pgmajfault", "major page faults")):
        if key in before.vmstat and key in after.vmstat:
            parts.append(f"{label} {after.vmstat[key] - before.vmstat[key]}")
    now = [f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}"]
    mem = re.search(r"MemAvailable:\s+(\d+) kB", _read("/proc/meminfo") or "")
    if mem:
        now.append(f"MemAvailable {int(mem.group(1)) / 2**20:.1f} GiB")
    for path in paths:
        try:
            now.append(f"free disk {shutil.disk_usage(path).free / 2**30:.2f} GiB at {path}")
        except OSError:
            pass
    lines = [f"machine over the run's {elapsed:.1f} s: " + "; ".join(parts), "machine now: " + "; ".join(now)]
    kernel = kernel_log_since(before.uptime)
    if kernel is None:
        lines.append("kernel log during the run: not readable here")
    else:
        lines.append("kernel log during the run: " + ("\n  " + "\n  ".join(kernel) if kernel else "(none)"))
    return "\n".join(lines)
