"""The processes the harness starts, found and stopped by PID on Linux: a test must not leave a
Flower process (SuperLink, SuperNode, SuperExec, ClientApp, Ray) or a node worker behind, and
Flower's process trees escape a plain kill (a SuperExec runs in a session of its own, torchrun's
ranks too, and both outlive their parent's death for a moment, re-parented).

So every tree the harness starts carries OWNER_VAR in its environment (inherited by every
descendant, found in /proc/<pid>/environ wherever it was re-parented), and `terminate` stops the
given PIDs, their process groups, their descendants and the owner's processes: SIGTERM, a bounded
wait, SIGKILL, never this process or its ancestors. Also the small waits the harness polls with
(free ports, /health URLs, log lines).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

#: Set on every process tree the harness starts; inherited by all descendants, so leftovers can
#: be found in /proc even after they were re-parented. Values are fresh UUID-based strings.
OWNER_VAR = "LORDO_FED_HARNESS_OWNER"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: SIGTERM this child when the thread that spawned it dies (e.g. pytest killed)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_preexec() -> Callable[[], None] | None:
    """The `preexec_fn` for a process the harness starts: on Linux, from the main thread, the child
    gets SIGTERM when its parent dies, so a killed pytest leaves no Flower process behind (PDEATHSIG
    fires when the spawning *thread* exits: only safe from the main thread; elsewhere None)."""
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        return _die_with_parent
    return None


# --------------------------------------------------------------------------------------------
# waiting for ports, URLs and conditions
# --------------------------------------------------------------------------------------------


def checkout_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default os.environ) plus `extra`, with this checkout first on PYTHONPATH and the
    caller's PYTHONPATH kept after it: a child must import this checkout's lordo_fed and still
    find what the caller added (e.g. a GPU machine's carried wheels in /tmp/site)."""
    env = dict(os.environ if base is None else base, **extra)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                  if p and p != root])
    return env


_PORTS_GIVEN: set[int] = set()
"""The ports `free_port` handed out in this process (each once)."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (net.ipv4.ip_local_port_range; Linux's default when unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A TCP port P on `host` with P .. P + span − 1 free now, below the kernel's ephemeral range.

    A port picked inside that range (bind to port 0, read, close) can be taken before the child process
    that was told to serve on it binds it: the kernel hands the same range to every outgoing connection's
    local end (seen in CI: a SuperNode's HTTP port already in use, taken by another node's connection to
    the SuperLink). Below the range nothing is assigned unasked, so a port checked free here stays free
    for the child unless some process binds it by number. Drawn at random from 20000 up (Ray's workers
    bind ports 10002-19999 by default, Flower's defaults sit at 9091-9095), checked by binding, each handed
    out once per process."""
    import random

    low, high = _ephemeral_range()
    first, last = (20000, low - span) if low - span > 20000 else (high + 1, 65536 - span)
    for _ in range(1000):
        port = random.randrange(first, last)
        ports = range(port, port + span)
        if _PORTS_GIVEN.intersection(ports):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for p in ports:
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, p))
        except OSError:
            continue
        _PORTS_GIVEN.update(ports)
        return port
    raise RuntimeError(f"no {span} free consecutive TCP port(s) on {host} in [{first}, {last + span})")


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.3) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout: float = 0.5, cafile: str | os.PathLike | None = None) -> bool:
    """Whether GET url answers 2xx (an https URL is verified against `cafile`, a CA certificate,
    or else the system's trust store)."""
    context = ssl.create_default_context(cafile=os.fspath(cafile)) if cafile else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:  # noqa: S310
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2, what: str = "condition") -> float:
    """Poll `predicate()` until true; returns the seconds waited, raises TimeoutError after
    `timeout`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def tail(path: str | os.PathLike, n: int = 40) -> str:
    """The last n lines of a text file ('' when missing)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


# --------------------------------------------------------------------------------------------
# /proc inspection and bounded termination
# --------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a live process, None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def alive(pids: Iterable[int]) -> set[int]:
    """The subset of `pids` still running (zombies count as gone)."""
    return {pid for pid in pids if pid_alive(pid)}


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def proc_environ(pid: int) -> dict[str, str]:
    """The initial environment of `pid` ({} when unreadable or gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def proc_cmdline(pid: int) -> list[str]:
    """The command line of `pid`, one argument per item ([] when unreadable or gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _protected_pids() -> set[int]:
    """This process and its ancestors: never signalled."""
    protected, pid = set(), os.getpid()
    while pid > 0 and pid not in protected:
        protected.add(pid)
        stat = _proc_stat(pid)
        pid = stat[1] if stat else 0
    return protected


def descendants(roots: Iterable[int]) -> set[int]:
    """All live descendants of `roots` (by parent PID; not including the roots)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None:
            children.setdefault(stat[1], []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def find_pids(env_match: Mapping[str, str], cmdline_contains: Sequence[str] = ()) -> set[int]:
    """Live processes whose initial environment has all of `env_match` and whose command line
    contains every string of `cmdline_contains` (as an argument or inside one)."""
    protected = _protected_pids()
    hits = set()
    for pid in _all_pids():
        if pid in protected or not pid_alive(pid):
            continue
        if cmdline_contains:
            cmdline = proc_cmdline(pid)
            if not all(any(s in arg for arg in cmdline) for s in cmdline_contains):
                continue
        env = proc_environ(pid)
        if env and all(env.get(k) == v for k, v in env_match.items()):
            hits.add(pid)
    return hits


def terminate(
    pids: Iterable[int] = (),
    pgids: Iterable[int] = (),
    *,
    timeout: float = 10.0,
    kill_timeout: float = 5.0,
    sig: int = signal.SIGTERM,
    owner: str | None = None,
) -> set[int]:
    """Stop processes: the given PIDs, every member of the given process groups, all their
    descendants and (if `owner`) every process whose environment has OWNER_VAR=owner.

    Sends `sig` (SIGTERM), waits up to `timeout` s (re-collecting descendants spawned meanwhile),
    then SIGKILLs what is left and waits up to `kill_timeout` s. Never signals this process, its
    ancestors or its own process group. Returns the PIDs still alive at the end (normally empty).
    """
    protected = _protected_pids()
    own_pgid = os.getpgid(0)
    pgids = {g for g in pgids if g > 1 and g != own_pgid}
    roots = set(pids)

    def collect() -> set[int]:
        victims = set(roots)
        for pid in _all_pids():
            stat = _proc_stat(pid)
            if stat is not None and stat[2] in pgids:
                victims.add(pid)
        if owner is not None:
            victims |= find_pids({OWNER_VAR: owner})
        victims |= descendants(victims)
        return {p for p in victims if p not in protected and p > 1}

    def signal_groups(signum: int) -> None:
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signum)

    def signal_pids(victims: set[int], signum: int) -> None:
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    seen = collect()
    signal_groups(sig)
    signal_pids(alive(seen), sig)
    signalled = set(seen)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen |= collect()
        remaining = alive(seen)
        if not remaining:
            return set()
        signal_pids(remaining - signalled, sig)  # spawned meanwhile
        signalled |= remaining
        time.sleep(0.1)
    deadline = time.monotonic() + kill_timeout
    while True:
        seen |= collect()
        remaining = alive(seen)
        if not remaining or time.monotonic() > deadline:
            return remaining
        signal_groups(signal.SIGKILL)
        signal_pids(remaining, signal.SIGKILL)
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> set[int]:
    """Stop a process the harness started in its own session and everything it started. First
    SIGTERM to the process alone, waiting up to `timeout`: torchrun passes it on to its ranks and
    waits for them (a second SIGTERM would cut its shutdown short, and its ranks, which die with it,
    with it). Then whatever is left, in its process group, among its descendants or, for a node
    worker, carrying its OWNER_VAR marker (torchrun's ranks run in sessions of their own):
    SIGTERM, then SIGKILL. Returns the PIDs still alive after that (normally none; the suite's
    session-end check reports them)."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
    survivors = terminate([proc.pid], [proc.pid], timeout=5, owner=getattr(proc, "owner", None))
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)  # reap it
    return survivors
