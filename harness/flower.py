"""Run a Flower app from tests: simulation (`flwr run <app> local`) and a real deployment
(one `flower-superlink` plus N `flower-supernode` subprocesses on 127.0.0.1).

Plain functions and context managers, no pytest fixtures. Every process this module starts is
stopped by PID (process groups plus their descendants, SIGTERM then SIGKILL, bounded waits).

Facts about flwr 1.41 this relies on (read from the installed package, checked on this machine):

- The SuperLink serves ONE HTTP port (`--host`/`--port`, default 127.0.0.1:8000) that carries the
  Fleet API (SuperNodes), the Control API (`flwr` CLI) and the Runtime API (its SuperExec /
  ServerApp). `--control-api-address` / `--fleet-api-address` are deprecated and not opened
  (unless FLWR_INTERNAL_GRPC_CONTROL_API/FLWR_INTERNAL_GRPC_FLEET_API=1, which we strip).
  A `--insecure` SuperLink answers `GET http://host:port/health` with 200 once up.
- A SuperNode opens one HTTP port of its own (`--host`/`--port`, default 127.0.0.1:9094: the
  Runtime API for its SuperExec / ClientApp processes); two SuperNodes on one host need distinct
  `--port`. It logs `SuperNode ID: <id>` once it is registered with the SuperLink.
- Process trees: `flower-superlink` spawns `flower-superexec` in a NEW session (so killing the
  SuperLink's process group misses it; it exits ~0.2 s after its parent dies) which spawns
  `flwr-serverapp` / `flwr-simulation` (+ Ray). `flower-supernode` spawns `flower-superexec` in its
  own process group, which spawns one `flwr-clientapp` per message. Each `flower-superexec` asks
  for work every FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds (default 1; `flower_env` sets 0.1).
  A SuperNode sleeps a hard-coded 3 s after every empty pull of the SuperLink and checks for its
  ClientApp's reply every 0.5 s (flwr/supernode/start_client_internal.py; no flag or variable).
- `flower-supernode --isolation process` does not spawn the SuperExec: something else must serve
  its Runtime API (`Deployment(isolation="process")` starts a `flower-superexec` next to it). A
  `flwr-clientapp` process still handles exactly one message (one task token) and exits.
- `flwr run <app> local` reads `$FLWR_HOME/config.toml`; `address = ":local:"` makes the CLI start
  (if `GET 127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT/health` fails; default port 39091) a
  detached `flower-superlink --simulation` that keeps running after the run. It reuses ANY
  SuperLink answering on that port, even one started with another FLWR_HOME: `flower_env` gives
  each environment its own free port through FLWR_LOCAL_SUPERLINK_HTTP_API_PORT.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

#: Set by `flower_env`; identifies one environment (and its FLWR_HOME).
ENV_ID_VAR = "LORDO_FED_HARNESS_ENV"
#: Set on every process tree the harness starts; inherited by all descendants, so leftovers can
#: be found in /proc even after they were re-parented. Values are fresh UUID-based strings.
OWNER_VAR = "LORDO_FED_HARNESS_OWNER"
#: The flwr CLI reads this (at import) to choose the local simulation SuperLink's port.
LOCAL_SUPERLINK_PORT_VAR = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"
LOCAL_CONTROL_PORT_VAR = "FLWR_LOCAL_CONTROL_API_PORT"
DEFAULT_LOCAL_SUPERLINK_PORT = 39091
#: Ray puts unix sockets under $RAY_TMPDIR/ray/session_<date>_<pid>/sockets/plasma_store
#: (+66 chars); AF_UNIX paths are limited to 107 bytes.
_MAX_RAY_TMPDIR_LEN = 38

FLOWER_ENV_DEFAULTS = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    # Otherwise every run `uv sync`s the app's dependencies (fails offline, pulls CUDA torch).
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    # How often each `flower-superexec` (one per SuperNode, one for the SuperLink) asks its
    # Runtime API for a task to launch (a ClientApp per message, a ServerApp per run). Flower's
    # default is 1 s: on average 0.5 s more per message and per run start.
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
}
#: Inherited variables that would change what Flower/Ray connect to.
_STRIP_VARS = (
    "FLWR_INTERNAL_GRPC_CONTROL_API",
    "FLWR_INTERNAL_GRPC_FLEET_API",
    "RAY_ADDRESS",
    ENV_ID_VAR,
    OWNER_VAR,
)

_short_dirs: list[str] = []
_fab_sources: dict[Path, Path] = {}  # app dir -> fab_source's copy
_live_deployments: weakref.WeakSet = weakref.WeakSet()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: SIGTERM this child when the thread that spawned it dies (e.g. pytest killed)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _preexec():
    # PDEATHSIG fires when the spawning *thread* exits: only safe from the main thread.
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        return _die_with_parent
    return None


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition") -> float:
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


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest round-tripping form; '1e-05' is valid TOML
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        # Flower splits pairs with the regex (\S+?)=('[^']*'|"[^"]*"|\S+): a quoted value may not
        # contain its own quote character, even escaped.
        if '"' not in text:
            escaped = (
                text.replace("\\", "\\\\")
                .replace("\n", "\\n")
                .replace("\r", "\\r")
                .replace("\t", "\\t")
            )
            if any(ord(c) < 0x20 or ord(c) == 0x7F for c in escaped):
                raise ValueError(f"control characters are not supported in {text!r}")
            return f'"{escaped}"'
        if "'" not in text and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            return f"'{text}'"  # TOML literal string: no escapes
        raise ValueError(f"cannot pass a string with both ' and \" through --run-config: {text!r}")
    raise TypeError(
        f"run-config values must be bool/int/float/str (or nested dicts), got {type(value).__name__}"
    )


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not all(_BARE_KEY.match(p) for p in key.split(".")):
            raise ValueError(f"run-config keys must be [A-Za-z0-9_-] (dotted for nesting): {key!r}")
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, prefix=f"{full}."))
        else:
            flat[full] = value
    return flat


def format_run_config(config: Mapping[str, Any] | None) -> str:
    """Flower's `--run-config` / `--node-config` syntax: space-separated `key=value` pairs with
    TOML values. Strings are double-quoted (single-quoted literal strings when they contain a
    double quote), bools lower-case, floats in round-tripping form; nested dicts become dotted
    keys (Flower flattens `[tool.flwr.app.config]` tables the same way). Lists are rejected
    (Flower's run config has none).

    >>> format_run_config({"num-server-rounds": 3, "lr": 0.01, "name": "a b", "eval": True})
    'num-server-rounds=3 lr=0.01 name="a b" eval=true'
    """
    if not config:
        return ""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in _flatten(config).items())


def _toml_dump_connections(doc: Mapping[str, Any]) -> str:
    """Serialize {'superlink': {'default': str, <name>: {key: str|bool}}} as TOML."""
    superlink = doc.get("superlink", {})
    lines = ["[superlink]"]
    for key, value in superlink.items():
        if not isinstance(value, Mapping):
            lines.append(f"{key} = {_toml_value(value)}")
    for name, conn in superlink.items():
        if isinstance(conn, Mapping):
            lines += ["", f"[superlink.{name}]"]
            for key, value in conn.items():
                if isinstance(value, Mapping):  # e.g. deprecated `options` tables: keep them
                    for sub_key, sub_value in _flatten(value).items():
                        lines.append(f"{key}.{sub_key} = {_toml_value(sub_value)}")
                else:
                    lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def write_flower_config(
    flwr_home: str | os.PathLike,
    connections: Mapping[str, str | Mapping[str, Any] | None] | None = None,
    *,
    default: str = "local",
) -> Path:
    """Write (or update) `$FLWR_HOME/config.toml`.

    `connections` maps a connection name to a SuperLink address `host:port` (an insecure
    deployment connection), to ":local:" (simulation), to a mapping (the connection's table as
    given, e.g. {"address": "127.0.0.1:8000", "root-certificates": "/abs/ca.crt"} for TLS), or to
    None (remove it). A `local` simulation connection is always present. Existing other
    connections are kept.

    Resulting format::

        [superlink]
        default = "local"

        [superlink.local]
        address = ":local:"

        [superlink.deployment]
        address = "127.0.0.1:8000"   # the SuperLink's --host/--port (one HTTP port for all APIs)
        insecure = true
    """
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    doc: dict[str, Any] = {}
    if path.exists():
        with path.open("rb") as f:
            doc = tomllib.load(f)
    superlink = dict(doc.get("superlink", {}))
    superlink.setdefault("local", {"address": ":local:"})
    for name, address in (connections or {}).items():
        if not _BARE_KEY.match(name):
            raise ValueError(f"connection names must be [A-Za-z0-9_-]: {name!r}")
        if address is None:
            superlink.pop(name, None)
        elif isinstance(address, Mapping):
            superlink[name] = dict(address)
        elif address.startswith(":local"):
            superlink[name] = {"address": address}
        else:
            superlink[name] = {"address": address, "insecure": True}
    superlink["default"] = default
    ordered = {"default": superlink.pop("default"), **superlink}
    path.write_text(_toml_dump_connections({"superlink": ordered}), encoding="utf-8")
    return path


def _short_ray_tmpdir(tmp_path: Path) -> str:
    wanted = tmp_path / "ray"
    if len(str(wanted)) <= _MAX_RAY_TMPDIR_LEN:
        wanted.mkdir(parents=True, exist_ok=True)
        return str(wanted)
    short = tempfile.mkdtemp(prefix="lfray-", dir="/tmp")
    _short_dirs.append(short)
    with contextlib.suppress(OSError):
        os.symlink(short, wanted)  # so it can be found from tmp_path
    return short


def cleanup_short_dirs() -> None:
    """Remove the short RAY_TMPDIRs `flower_env` created outside tmp_path and the copies
    `fab_source` made (also at exit)."""
    _fab_sources.clear()
    while _short_dirs:
        shutil.rmtree(_short_dirs.pop(), ignore_errors=True)


def _stop_leftovers() -> None:
    """At interpreter exit: stop Deployments never stopped (a test that forgot `with`)."""
    for deployment in list(_live_deployments):
        with contextlib.suppress(Exception):
            deployment.stop(raise_on_survivors=False)


atexit.register(cleanup_short_dirs)
atexit.register(_stop_leftovers)


def flower_env(
    tmp_path: str | os.PathLike,
    deployment_port: int | None = None,
    *,
    deployment_host: str = "127.0.0.1",
    connection: str = "deployment",
    local_superlink_port: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """An environment for Flower processes: `base` (default os.environ) plus

    - FLWR_HOME=<tmp_path>/flwr_home holding a config.toml with a `local` simulation connection
      and, when `deployment_port` is given, an insecure `<connection>` connection to
      `deployment_host:deployment_port`;
    - RAY_TMPDIR (a short directory: Ray's unix socket paths must stay < 108 bytes);
    - FLWR_TELEMETRY_ENABLED=0, FLWR_DISABLE_UPDATE_CHECK=1,
      FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1, PYTHONUNBUFFERED=1, RAY_USAGE_STATS_ENABLED=0,
      FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1 (Flower's default: 1 s);
    - FLWR_LOCAL_SUPERLINK_HTTP_API_PORT / FLWR_LOCAL_CONTROL_API_PORT: free ports (unless given),
      so the simulation SuperLink of this environment never collides with (or silently reuses)
      another one on the default 39091;
    - PATH starting with this interpreter's bin dir (the CLI spawns `flower-superlink` by name);
    - LORDO_FED_HARNESS_ENV: a fresh id, to find this environment's processes in /proc.
    """
    tmp_path = Path(tmp_path)
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _STRIP_VARS}
    env.update(FLOWER_ENV_DEFAULTS)
    flwr_home = tmp_path / "flwr_home"
    env["FLWR_HOME"] = str(flwr_home)
    env["RAY_TMPDIR"] = _short_ray_tmpdir(tmp_path)
    env[LOCAL_SUPERLINK_PORT_VAR] = str(local_superlink_port or free_port())
    env[LOCAL_CONTROL_PORT_VAR] = str(free_port())
    bin_dir = str(Path(sys.executable).parent)
    path_parts = env.get("PATH", "").split(os.pathsep)
    if bin_dir not in path_parts:
        env["PATH"] = os.pathsep.join([bin_dir, *[p for p in path_parts if p]])
    env[ENV_ID_VAR] = uuid.uuid4().hex
    connections: dict[str, str | None] = {"local": ":local:"}
    if deployment_port is not None:
        connections[connection] = f"{deployment_host}:{deployment_port}"
    write_flower_config(flwr_home, connections)
    return env


def flwr_executable(env: Mapping[str, str], name: str = "flwr") -> str:
    """Absolute path of a Flower console script (this interpreter's bin dir first)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name, path=env.get("PATH"))
    if not found:
        raise FileNotFoundError(f"{name} not found on PATH")
    return found


# --------------------------------------------------------------------------------------------
# processes: /proc inspection and bounded termination
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


def _run_cli(
    cmd: Sequence[str],
    env: Mapping[str, str],
    timeout: float,
    log_path: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run a CLI in its own session; stdout+stderr merged into `.stdout`. On timeout its process
    group is killed and subprocess.TimeoutExpired (with the output so far) is raised."""
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=_preexec(),
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        terminate([proc.pid], [proc.pid], timeout=5)
        out, _ = proc.communicate(timeout=10)
        if log_path:
            Path(log_path).write_text(out or "")
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=out) from None
    finally:
        if proc.poll() is None:  # e.g. KeyboardInterrupt
            terminate([proc.pid], [proc.pid], timeout=5)
            proc.wait(timeout=10)
    if log_path:
        Path(log_path).write_text(out or "")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout=out, stderr=None)


_RUN_ID = re.compile(r"Successfully started run (\d+)")
_EXIT_CODE = re.compile(r"Exit Code: (\d+)")


class FlowerRunError(subprocess.CalledProcessError):
    """`flwr run` failed: non-zero exit, or the streamed log reports a failed ServerApp/simulation
    (`flwr run --stream` itself exits 0 even then)."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n--- output (tail) ---\n{(self.output or '')[-4000:]}"


def run_failure(result: subprocess.CompletedProcess) -> str | None:
    """Why a `flwr run --stream` result failed, or None. `flwr run --stream` exits 0 when the
    ServerApp raises (deployment: Flower exit code 201; simulation: 700): the streamed log then
    contains 'Exit Code: <n>'."""
    if result.returncode != 0:
        return f"flwr exited with {result.returncode}"
    codes = [int(c) for c in _EXIT_CODE.findall(result.stdout or "")]
    if any(codes):
        return f"the run reported Flower exit code {max(codes)}"
    return None


def check_run(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Raise FlowerRunError when `run_failure(result)`; else return `result`."""
    if run_failure(result):
        raise FlowerRunError(result.returncode or 1, result.args, output=result.stdout)
    return result


def parse_run_id(output: str | None) -> int | None:
    """The run id `flwr run` printed ('Successfully started run <id>'), or None."""
    match = _RUN_ID.search(output or "")
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------
# simulation
# --------------------------------------------------------------------------------------------


def local_superlink_pids(env: Mapping[str, str]) -> set[int]:
    """Running simulation SuperLinks (`flower-superlink ... --simulation`) whose FLWR_HOME is
    this environment's."""
    return find_pids({"FLWR_HOME": env["FLWR_HOME"]}, ("flower-superlink", "--simulation"))


def stop_local_superlink(env: Mapping[str, str], timeout: float = 15.0) -> set[int]:
    """Stop the background simulation SuperLink(s) `flwr run ... local` left for this
    environment (matched by FLWR_HOME in /proc/<pid>/environ), their SuperExec/simulation/Ray
    descendants and anything started by `run_simulation` with this environment. Returns the PIDs
    that were found (all gone afterwards, else RuntimeError)."""
    owner = _sim_owner(env)
    roots = local_superlink_pids(env)
    found = roots | descendants(roots) | (find_pids({OWNER_VAR: owner}) if owner else set())
    if not found:
        return set()
    survivors = terminate(found, owner=owner, timeout=timeout)
    if survivors:
        raise RuntimeError(f"processes survived SIGKILL: {sorted(survivors)}")
    return found


def _sim_owner(env: Mapping[str, str]) -> str | None:
    return f"sim-{env[ENV_ID_VAR]}" if ENV_ID_VAR in env else None


def fab_source(app_dir: str | os.PathLike) -> Path:
    """A directory that builds the same FAB as `app_dir`, quickly: for a git checkout, a copy
    (made once per process, removed at exit) of the files git tracks or would track there, else
    `app_dir` itself.

    Why: `flwr run <dir>` reads the path of every file under `dir` (flwr 1.41
    `cli.utils.collect_files`: an `os.walk` plus a `resolve()` per file, the `.venv` that the
    README's install puts in the checkout included) and only then keeps what the FAB holds
    (`.gitignore` and Flower's include patterns): 3.4-4.1 s per `flwr run` on this VM.
    The copy holds `.gitignore` and every file the FAB can include, so Flower's own filter gives
    the same FAB, byte for byte (tests/integration/test_flower_harness.py checks it)."""
    app_dir = Path(app_dir).resolve()
    if app_dir in _fab_sources:
        return _fab_sources[app_dir]
    listed = None
    if (app_dir / ".git").exists():  # the root of a checkout
        with contextlib.suppress(OSError):  # no git: use the directory as it is
            listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                    cwd=app_dir, capture_output=True)
    if listed is None or listed.returncode != 0:
        _fab_sources[app_dir] = app_dir
        return app_dir
    copy = Path(tempfile.mkdtemp(prefix="lffab-", dir="/tmp")) / app_dir.name
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = app_dir / rel
        if src.is_file() and not src.is_symlink():  # deleted or symlinked: Flower skips them too
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / rel)
    _short_dirs.append(str(copy.parent))
    _fab_sources[app_dir] = copy
    return copy


def run_simulation(
    app_dir: str | os.PathLike,
    env: Mapping[str, str],
    num_supernodes: int = 2,
    run_config: Mapping[str, Any] | None = None,
    timeout: float = 300.0,
    cpus_per_client: float = 1,
    *,
    connection: str = "local",
    federation_config: Mapping[str, Any] | None = None,
    log_path: str | os.PathLike | None = None,
    keep_superlink: bool = False,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """`flwr run <app_dir> local --stream --federation-config "num-supernodes=N
    client-resources-num-cpus=C" [--run-config ...]`, then stop the local SuperLink it started
    (unless `keep_superlink`; the next call then reuses it and skips ~1-2 s of startup).

    Returns the CompletedProcess (stdout and stderr merged in `.stdout`; written to `log_path`
    too); with `check`, raises FlowerRunError if the run failed (see `run_failure`: the CLI exits
    0 even when the ServerApp raised). Raises subprocess.TimeoutExpired after `timeout` (the CLI and the SuperLink are killed).
    Refuses to run when the environment's local SuperLink port is held by a process that is not
    this environment's SuperLink (the CLI would silently submit there).
    """
    port = int(env.get(LOCAL_SUPERLINK_PORT_VAR, DEFAULT_LOCAL_SUPERLINK_PORT))
    if port_open(port) and not local_superlink_pids(env):
        raise RuntimeError(
            f"127.0.0.1:{port} is in use by a process that is not this environment's simulation "
            f"SuperLink; `flwr run ... {connection}` would submit to it. Use flower_env(...) "
            "with a free local_superlink_port."
        )
    fed = {"num-supernodes": int(num_supernodes), "client-resources-num-cpus": cpus_per_client}
    fed.update(federation_config or {})
    cmd = [
        flwr_executable(env),
        "run",
        str(fab_source(app_dir)),
        connection,
        "--stream",
        "--federation-config",
        format_run_config(fed),
    ]
    if run_config:
        cmd += ["--run-config", format_run_config(run_config)]
    child_env = dict(env)
    owner = _sim_owner(env)
    if owner:
        child_env[OWNER_VAR] = owner
    try:
        result = _run_cli(cmd, child_env, timeout, log_path)
    finally:
        if not keep_superlink:
            stop_local_superlink(env)
    return check_run(result) if check else result


# --------------------------------------------------------------------------------------------
# deployment
# --------------------------------------------------------------------------------------------


class _Started:
    """A process the Deployment started (own session: pgid == pid)."""

    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path, log_file) -> None:
        self.name, self.popen, self.log_path, self._log_file = name, popen, log_path, log_file

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def close(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        with contextlib.suppress(OSError):
            self._log_file.close()


class Deployment:
    """A real SuperLink plus `num_nodes` SuperNodes on 127.0.0.1, each a subprocess in its own
    session with its own log file under `<tmp_path>/<name>/logs/` (a restarted node gets a new
    log file: supernode-<i>.<start#>.log). Ports are free ports picked at construction:
    `superlink_port` (the SuperLink's one HTTP port: Fleet + Control + Runtime API) and
    `node_ports[i]` (node i's Runtime API).

        with Deployment(tmp_path, num_nodes=2) as dep:      # started, nodes registered
            result = dep.run(app_dir, {"num-server-rounds": 2}, timeout=120)
            dep.kill_node(1); dep.restart_node(1)
        # every process stopped (dep.all_pids() are gone)

    Node i gets `--node-config "partition-id=i num-partitions=N"` (+ `node_configs[i]`) and its
    own FLWR_HOME (the FAB is installed there, as on a separate machine). The `flwr` CLI uses
    `self.env`, whose config.toml has an insecure connection `connection` to the SuperLink.
    `timings` holds measured startup seconds.

    `isolation="process"` starts each SuperNode with `--isolation process` and, next to it, the
    process that launches its ClientApps (`self.executors[i]`, own session, log
    executor-<i>.<start#>.log, stopped with its node): by default a `flower-superexec
    --runtime-api-address <node's Runtime API> --parent-pid <node>`, which is what the SuperNode
    spawns itself in the default `subprocess` mode; it still starts one `flwr-clientapp` process
    per message (flwr 1.41: `flwr-clientapp` takes one task token and exits). `executor_command(i,
    runtime_api_address, supernode_pid)` replaces that command. `supernode_command` replaces the
    `flower-supernode` executable (a list: program and leading arguments).

    Secure mode (flwr 1.41): `tls_dir` holds `ca.crt`, `server.pem`, `server.key`
    (scripts/generate_certs.py): the SuperLink serves HTTPS with them (`--ssl-ca-certfile
    --ssl-certfile --ssl-keyfile` instead of `--insecure`), nodes verify it with
    `--root-certificates ca.crt`, and the CLI connection gets `root-certificates` instead of
    `insecure = true`; each node's config gets `root-certificates` (the CA the gRPC data plane is
    verified with, lordo_fed.transport). `supernode_auth=True` adds `--enable-supernode-auth` (needs `tls_dir`):
    only SuperNodes whose public key was registered (`flwr supernode register`) may connect.
    `node_keys[i]` is node i's private key (OpenSSH format; its public key is `<key>.pub`),
    passed as `--auth-supernode-private-key`; `start()` registers each node's `.pub` after the
    SuperLink is up (node ids in `registered_node_ids`). `start_extra_supernode` starts a
    SuperNode outside the federation (e.g. one with an unregistered key).
    """

    def __init__(
        self,
        tmp_path: str | os.PathLike,
        num_nodes: int = 2,
        *,
        env: Mapping[str, str] | None = None,
        connection: str = "deployment",
        node_configs: Sequence[Mapping[str, Any]] | None = None,
        superlink_args: Sequence[str] = (),
        supernode_args: Sequence[str] = (),
        isolation: str = "subprocess",
        executor_command: Callable[[int, str, int], list[str]] | None = None,
        supernode_command: Sequence[str] | None = None,
        database: bool = True,
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        name: str = "deployment",
        tls_dir: str | os.PathLike | None = None,
        supernode_auth: bool = False,
        node_keys: Sequence[str | os.PathLike | None] | None = None,
    ) -> None:
        self.root = Path(tmp_path) / name
        self.log_dir = self.root / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.num_nodes = num_nodes
        self.connection = connection
        self.superlink_port = free_port()
        self.node_ports = [free_port() for _ in range(num_nodes)]
        self.address = f"127.0.0.1:{self.superlink_port}"
        if env is None:
            self.env = flower_env(self.root / "cli", self.superlink_port, connection=connection)
        else:
            self.env = dict(env)
            write_flower_config(self.env["FLWR_HOME"], {connection: self.address})
        self.tls_dir = Path(tls_dir).resolve() if tls_dir is not None else None
        if supernode_auth and self.tls_dir is None:
            raise ValueError("supernode_auth needs tls_dir (flower-superlink refuses it without TLS)")
        self.supernode_auth = supernode_auth
        self.node_keys = [Path(k).resolve() if k else None for k in (node_keys or [None] * num_nodes)]
        if len(self.node_keys) != num_nodes:
            raise ValueError("node_keys needs one entry (a key path or None) per node")
        self.registered_node_ids: list[int | None] = [None] * num_nodes
        if self.tls_dir is not None:
            for file in ("ca.crt", "server.pem", "server.key"):
                if not (self.tls_dir / file).is_file():
                    raise FileNotFoundError(f"{self.tls_dir / file} (see scripts/generate_certs.py)")
            write_flower_config(
                self.env["FLWR_HOME"],
                {connection: {"address": self.address, "root-certificates": str(self.ca_cert)}},
            )
        self.owner = f"dep-{uuid.uuid4().hex}"
        self.node_configs = [dict(c) for c in (node_configs or [{}] * num_nodes)]
        if len(self.node_configs) != num_nodes:
            raise ValueError("node_configs needs one mapping per node")
        self.superlink_args = list(superlink_args)
        self.supernode_args = list(supernode_args)
        if isolation not in ("subprocess", "process"):
            raise ValueError(f"isolation={isolation!r}: expected 'subprocess' or 'process'")
        if executor_command is not None and isolation != "process":
            raise ValueError("executor_command needs isolation='process'")
        self.isolation = isolation
        self.executor_command = executor_command
        self.supernode_command = list(supernode_command) if supernode_command else None
        self.database = self.root / "superlink.db" if database else None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.superlink: _Started | None = None
        self.nodes: list[_Started | None] = [None] * num_nodes
        self.executors: list[_Started | None] = [None] * num_nodes
        self._starts = [0] * num_nodes
        self._history: list[_Started] = []
        self._seen_pids: set[int] = set()
        self.timings: dict[str, float] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop(raise_on_survivors=exc_info[0] is None)

    def _process_env(self, flwr_home: Path) -> dict[str, str]:
        env = dict(self.env)
        env["FLWR_HOME"] = str(flwr_home)
        env[OWNER_VAR] = self.owner
        flwr_home.mkdir(parents=True, exist_ok=True)
        return env

    def _spawn(self, name: str, cmd: list[str], flwr_home: Path, log_path: Path) -> _Started:
        log_file = open(log_path, "ab")  # noqa: SIM115 (closed in _Started.close)
        log_file.write(f"$ {' '.join(cmd)}\n".encode())
        log_file.flush()
        popen = subprocess.Popen(
            cmd,
            env=self._process_env(flwr_home),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(self.root),
            start_new_session=True,
            preexec_fn=_preexec(),
        )
        started = _Started(name, popen, log_path, log_file)
        self._history.append(started)
        self._seen_pids.add(popen.pid)
        return started

    def start(self) -> Deployment:
        """Start the SuperLink, wait for /health, start every node, wait until all registered."""
        _live_deployments.add(self)
        t0 = time.monotonic()
        self.start_superlink()
        self.timings["superlink_start_s"] = time.monotonic() - t0
        if self.supernode_auth:
            for i, key in enumerate(self.node_keys):
                if key is not None:
                    self.registered_node_ids[i] = self.register_key(key.with_name(key.name + ".pub"))
        t1 = time.monotonic()
        for i in range(self.num_nodes):
            self.start_node(i, wait=False)
        for i in range(self.num_nodes):
            self.wait_node(i)
        self.timings["nodes_start_s"] = time.monotonic() - t1
        self.timings["startup_s"] = time.monotonic() - t0
        return self

    def start_superlink(self) -> None:
        cmd = [
            flwr_executable(self.env, "flower-superlink"),
            *self._superlink_security_args(),
            "--host", "127.0.0.1",
            "--port", str(self.superlink_port),
            "--disable-runtime-dependency-installation",
        ]
        if self.database is not None:
            cmd += ["--database", str(self.database)]
        cmd += self.superlink_args
        self.superlink = self._spawn(
            "superlink", cmd, self.root / "superlink_home", self.log_dir / "superlink.log"
        )
        url = f"{'https' if self.tls_dir else 'http'}://{self.address}/health"

        def ready() -> bool:
            if not self.superlink.alive():
                raise RuntimeError(
                    f"flower-superlink exited with {self.superlink.popen.returncode}:\n"
                    + tail(self.superlink.log_path)
                )
            return http_ok(url, cafile=self.ca_cert)

        try:
            wait_for(ready, self.startup_timeout, what=f"SuperLink {url}")
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{tail(self.superlink.log_path)}") from None

    def node_command(self, i: int) -> list[str]:
        node_config = {"partition-id": i, "num-partitions": self.num_nodes, **self.node_configs[i]}
        if self.tls_dir is not None:  # the data plane's TLS is verified with the SuperLink's CA
            node_config.setdefault("root-certificates", str(self.ca_cert))
        program = self.supernode_command or [flwr_executable(self.env, "flower-supernode")]
        isolation = ["--isolation", "process"] if self.isolation == "process" else []
        key = self.node_keys[i]
        return [
            *program,
            *isolation,
            *self._supernode_security_args(),
            *(["--auth-supernode-private-key", str(key)] if key is not None else []),
            "--superlink", self.address,
            "--node-config", format_run_config(node_config),
            "--host", "127.0.0.1",
            "--port", str(self.node_ports[i]),
            *self.supernode_args,
        ]

    # -- TLS and SuperNode authentication ---------------------------------------------------

    @property
    def ca_cert(self) -> Path | None:
        """The CA certificate that signed the SuperLink's (None without TLS)."""
        return self.tls_dir / "ca.crt" if self.tls_dir is not None else None

    def _superlink_security_args(self) -> list[str]:
        if self.tls_dir is None:
            return ["--insecure"]
        args = [
            "--ssl-ca-certfile", str(self.tls_dir / "ca.crt"),
            "--ssl-certfile", str(self.tls_dir / "server.pem"),
            "--ssl-keyfile", str(self.tls_dir / "server.key"),
        ]
        return args + (["--enable-supernode-auth"] if self.supernode_auth else [])

    def _supernode_security_args(self) -> list[str]:
        return ["--insecure"] if self.tls_dir is None else ["--root-certificates", str(self.ca_cert)]

    def register_key(self, public_key: str | os.PathLike, timeout: float = 60.0) -> int:
        """`flwr supernode register <public_key> <connection> --format json` (an OpenSSH EC
        public key): the node id the SuperLink assigned; RuntimeError when refused."""
        res = self.flwr(
            "supernode", "register", str(public_key), self.connection, "--format", "json",
            timeout=timeout,
        )
        match = re.search(r'"node-id":\s*"?(\d+)', res.stdout)
        if res.returncode != 0 or not match:
            raise RuntimeError(f"flwr supernode register failed ({res.returncode}):\n{res.stdout}")
        return int(match.group(1))

    def start_extra_supernode(
        self,
        name: str,
        *,
        key: str | os.PathLike | None = None,
        insecure: bool = False,
        extra_args: Sequence[str] = (),
    ) -> _Started:
        """Start a SuperNode that is not one of the federation's nodes (stopped with the
        deployment): TLS like the others unless `insecure`, with private key `key` if given,
        node config "partition-id=0 num-partitions=<N>", its own free port, FLWR_HOME and log
        `<name>.log`. Returns at once; see `.alive()`, `.popen.returncode`, `.log_path`."""
        security = ["--insecure"] if insecure else self._supernode_security_args()
        cmd = [
            flwr_executable(self.env, "flower-supernode"),
            *security,
            *(["--auth-supernode-private-key", str(Path(key).resolve())] if key else []),
            "--superlink", self.address,
            "--node-config", format_run_config({"partition-id": 0, "num-partitions": self.num_nodes}),
            "--host", "127.0.0.1",
            "--port", str(free_port()),
            *extra_args,
        ]
        return self._spawn(name, cmd, self.root / f"{name}_home", self.log_dir / f"{name}.log")

    def start_node(self, i: int, wait: bool = True) -> None:
        """Start SuperNode i (must not be running); `wait` until it registered."""
        if self.nodes[i] is not None and self.nodes[i].alive():
            raise RuntimeError(f"node {i} is already running (pid {self.nodes[i].pid})")
        self._starts[i] += 1
        log_path = self.log_dir / f"supernode-{i}.{self._starts[i]}.log"
        self.nodes[i] = self._spawn(
            f"supernode-{i}", self.node_command(i), self.root / f"node{i}_home", log_path
        )
        if self.isolation == "process":
            self.executors[i] = self._spawn(
                f"executor-{i}",
                self.executor_cmd(i, self.nodes[i].pid),
                self.root / f"node{i}_home",
                self.log_dir / f"executor-{i}.{self._starts[i]}.log",
            )
        if wait:
            self.wait_node(i)

    def executor_cmd(self, i: int, supernode_pid: int) -> list[str]:
        """The command that launches node i's ClientApps (isolation='process' only)."""
        address = f"127.0.0.1:{self.node_ports[i]}"
        if self.executor_command is not None:
            return list(self.executor_command(i, address, supernode_pid))
        return [
            flwr_executable(self.env, "flower-superexec"),
            "--insecure",
            "--runtime-api-address", address,
            "--parent-pid", str(supernode_pid),
        ]

    def node_id(self, i: int) -> int | None:
        """The SuperNode ID node i logged once registered (None before)."""
        node = self.nodes[i]
        if node is None:
            return None
        match = re.search(r"SuperNode ID: (\d+)", node.log_path.read_text(errors="replace"))
        return int(match.group(1)) if match else None

    def wait_node(self, i: int, timeout: float | None = None) -> float:
        """Wait until node i logged its SuperNode ID (registered with the SuperLink)."""
        node = self.nodes[i]
        assert node is not None

        def ready() -> bool:
            if not node.alive():
                raise RuntimeError(
                    f"{node.name} exited with {node.popen.returncode}:\n" + tail(node.log_path)
                )
            return self.node_id(i) is not None

        try:
            return wait_for(ready, timeout or self.startup_timeout, what=f"{node.name} to register")
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{tail(node.log_path)}") from None

    def node_alive(self, i: int) -> bool:
        node = self.nodes[i]
        return node is not None and node.alive()

    def node_pids(self, i: int) -> set[int]:
        """SuperNode i, its SuperExec and running ClientApp processes (with isolation='process':
        its executor and the executor's children)."""
        roots = {s.pid for s in (self.nodes[i], self.executors[i]) if s is not None and s.alive()}
        return roots | descendants(roots) if roots else set()

    def kill_node(self, i: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Stop node i with its whole process group and descendants.

        SIGKILL (default) is a crash: the SuperLink keeps listing the node as 'online' (and
        `grid.get_node_ids()` keeps returning it) for ~60 s, until its heartbeats are missed;
        messages sent to it meanwhile come back as errors only then. SIGTERM is a graceful leave:
        the node is 'unregistered' at once. With isolation='process' its executor goes too."""
        node = self.nodes[i]
        if node is None:
            return
        started = [s for s in (node, self.executors[i]) if s is not None]
        pids = [s.pid for s in started]
        survivors = terminate(pids, pids, sig=sig, timeout=timeout)
        for s in started:
            s.close()
        if survivors:
            raise RuntimeError(f"{node.name}: processes survived SIGKILL: {sorted(survivors)}")

    def restart_node(self, i: int, wait: bool = True, sig: int = signal.SIGTERM) -> None:
        """Stop node i if it runs (`sig`: SIGTERM = clean leave, SIGKILL = crash, see
        `kill_node`), start it again: a new SuperNode ID, empty Context.state, same partition."""
        if self.node_alive(i):
            self.kill_node(i, sig=sig)
        self.start_node(i, wait=wait)

    def all_pids(self) -> set[int]:
        """Every PID started or seen by this deployment (for 'nothing survives' assertions)."""
        self._refresh_seen()
        return set(self._seen_pids)

    def _refresh_seen(self) -> None:
        roots = {s.pid for s in self._history if s.alive()}
        self._seen_pids |= roots | descendants(roots) | find_pids({OWNER_VAR: self.owner})

    def stop(self, raise_on_survivors: bool = True) -> None:
        """SIGTERM every process group started (all at once), wait up to `stop_timeout`, SIGKILL
        what is left, reap. Idempotent."""
        self._refresh_seen()
        survivors = terminate(
            self._seen_pids,
            {s.pid for s in self._history},
            timeout=self.stop_timeout,
            owner=self.owner,
        )
        for started in self._history:
            started.close()
        _live_deployments.discard(self)
        if survivors and raise_on_survivors:
            raise RuntimeError(f"processes survived SIGKILL: {sorted(survivors)}")

    # -- CLI ------------------------------------------------------------------------------------

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run `flwr <args>` with this deployment's environment (output merged in .stdout)."""
        return _run_cli([flwr_executable(self.env), *args], self.env, timeout)

    def list_nodes(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """`flwr supernode list <connection> --format json` -> the 'nodes' entries (each has
        'node-id' and 'status', e.g. 'online'). About 1-2 s (a CLI start)."""
        res = self.flwr("supernode", "list", self.connection, "--format", "json", timeout=timeout)
        start = res.stdout.find("{")
        if res.returncode != 0 or start < 0:
            raise RuntimeError(f"flwr supernode list failed ({res.returncode}):\n{res.stdout}")
        return list(json.loads(res.stdout[start:]).get("nodes", []))

    def run(
        self,
        app_dir: str | os.PathLike,
        run_config: Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        *,
        log_path: str | os.PathLike | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """`flwr run <app_dir> <connection> --stream [--run-config ...]` (output merged in
        .stdout; `parse_run_id(result.stdout)` gives the run id). With `check`, raises
        FlowerRunError when the run failed (the CLI exits 0 even then). On timeout the CLI is
        killed, the run is stopped with `flwr stop <run-id>`, and subprocess.TimeoutExpired is
        raised."""
        cmd = [
            flwr_executable(self.env),
            "run",
            str(fab_source(app_dir)),
            self.connection,
            "--stream",
        ]
        if run_config:
            cmd += ["--run-config", format_run_config(run_config)]
        try:
            result = _run_cli(cmd, self.env, timeout, log_path)
        except subprocess.TimeoutExpired as err:
            run_id = parse_run_id(err.output if isinstance(err.output, str) else None)
            if run_id is not None:
                with contextlib.suppress(Exception):
                    self.flwr("stop", str(run_id), self.connection, timeout=30)
            raise
        return check_run(result) if check else result

    def run_info(self, run_id: int, timeout: float = 60.0) -> dict[str, Any]:
        """`flwr ls <connection> --run-id <id> --format json` -> that run's entry: 'status' is
        e.g. 'finished:completed', 'finished:failed', 'finished:stopped', 'running';
        'status-details' holds the ServerApp's exception message."""
        res = self.flwr(
            "ls", self.connection, "--run-id", str(run_id), "--format", "json", timeout=timeout
        )
        start = res.stdout.find("{")
        if res.returncode != 0 or start < 0:
            raise RuntimeError(f"flwr ls failed ({res.returncode}):\n{res.stdout}")
        runs = json.loads(res.stdout[start:]).get("runs", [])
        if not runs:
            raise RuntimeError(f"run {run_id} not found:\n{res.stdout}")
        return dict(runs[0])


# --------------------------------------------------------------------------------------------
# a minimal app for harness tests
# --------------------------------------------------------------------------------------------

_APP_PYPROJECT = """\
[project]
name = {name}
version = "0.1.0"
description = {description}
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "lordofed"

[tool.flwr.app.components]
serverapp = "{module}.server_app:app"
clientapp = "{module}.client_app:app"

[tool.flwr.app.config]
"""


def start_node_worker(sock: str | os.PathLike, log_path: str | os.PathLike, timeout: float = 60.0,
                      ranks: int = 1, intra_node: str = "ddp") -> subprocess.Popen:
    """A node worker (`python -m lordo_fed.node`) listening on the unix socket `sock`, in its own
    session (stop it with `stop_process`), started once its socket exists; its output goes to
    `log_path`. Give the node the node-config key `node-worker = "unix://<sock>"`. With `ranks` > 1,
    a node of that many ranks under torchrun (gloo on this CPU), sharing gradients by `intra_node`.

    Every process of the worker carries OWNER_VAR=<the returned Popen's `owner`> (torchrun starts
    each rank in a session of its own, so its process group does not reach them: `node_worker_ranks`
    finds them by it)."""
    sock = Path(sock)
    root = Path(__file__).resolve().parents[1]
    owner = f"node-worker-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONPATH=str(root), **{OWNER_VAR: owner})
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(ranks)]
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()  # a killed worker's socket: its existence would not say that the new one listens
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*launcher, "-m", "lordo_fed.node", "--listen", f"unix://{sock}",
                                 "--intra-node", intra_node], cwd=root,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.owner, proc.ranks = owner, ranks  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if proc.poll() is not None:
            stop_process(proc)  # ranks that outlived their torchrun
            raise RuntimeError(f"node worker exited ({proc.returncode}):\n{tail(log_path)}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise TimeoutError(f"node worker did not listen on {sock} within {timeout:.0f}s:\n{tail(log_path)}")
        time.sleep(0.1)
    return proc


def node_worker_ranks(proc: subprocess.Popen) -> set[int]:
    """The live rank processes of a node worker that `start_node_worker` started, wherever they
    were re-parented (found by its OWNER_VAR; torchrun itself is not one; a node of one rank is
    the worker process itself)."""
    found = find_pids({OWNER_VAR: proc.owner}, ("lordo_fed.node",))
    return found - {proc.pid} if proc.ranks > 1 else found


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> set[int]:
    """Stop a process this module started in its own session and everything it started. First
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


def flower_app_pyproject(name: str, module: str, description: str, config: Mapping[str, Any]) -> str:
    """The pyproject.toml of a throwaway Flower app: project `name`, its ServerApp and ClientApp
    at `<module>.server_app:app` / `<module>.client_app:app`, run-config defaults `config` (TOML
    values as in `format_run_config`: strings quoted, numbers as they are)."""
    head = _APP_PYPROJECT.format(name=_toml_value(name), description=_toml_value(description), module=module)
    return head + "".join(f"{k} = {_toml_value(v)}\n" for k, v in _flatten(config).items())


_ECHO_CONFIG = {"num-server-rounds": 2, "result-path": "", "min-nodes": 1, "node-wait-timeout": 60.0,
                "round-timeout": 120.0, "fail-on-round": 0}

_ECHO_SERVER = '''\
"""ServerApp: wait for min-nodes, then each round send one train message per connected node
and record who answered; write a JSON summary to run_config["result-path"]."""

import json
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    t_start = time.monotonic()
    min_nodes = int(cfg["min-nodes"])
    while len(list(grid.get_node_ids())) < min_nodes:
        if time.monotonic() - t_start > float(cfg["node-wait-timeout"]):
            raise RuntimeError(f"fewer than {min_nodes} nodes connected")
        time.sleep(0.1)
    out = {"node_wait_s": time.monotonic() - t_start, "rounds": []}
    for rnd in range(1, int(cfg["num-server-rounds"]) + 1):
        if rnd == int(cfg["fail-on-round"]):
            raise RuntimeError(f"fail-on-round={rnd}")
        t0 = time.monotonic()
        node_ids = sorted(grid.get_node_ids())
        messages = [
            Message(
                content=RecordDict({"config": ConfigRecord({"round": rnd})}),
                message_type=MessageType.TRAIN,
                dst_node_id=node_id,
                group_id=str(rnd),
            )
            for node_id in node_ids
        ]
        replies = list(grid.send_and_receive(messages, timeout=float(cfg["round-timeout"])))
        ok = [m for m in replies if not m.has_error()]
        metrics = [m.content["metrics"] for m in ok]
        out["rounds"].append({
            "round": rnd,
            "node_ids": [int(n) for n in node_ids],
            "partition_ids": sorted(int(m["partition-id"]) for m in metrics),
            "echo_rounds": sorted(int(m["round"]) for m in metrics),
            "client_pids": sorted(int(m["pid"]) for m in metrics),
            "errors": len(replies) - len(ok),
            "seconds": time.monotonic() - t0,
        })
    out["total_s"] = time.monotonic() - t_start
    with open(cfg["result-path"], "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
'''

_ECHO_CLIENT = '''\
"""ClientApp: echo partition-id (node config) and the round back in a MetricRecord."""

import os

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    metrics = MetricRecord({
        "partition-id": int(context.node_config["partition-id"]),
        "round": int(msg.content["config"]["round"]),
        "pid": os.getpid(),
    })
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
'''


def write_echo_app(app_dir: str | os.PathLike, name: str = "lordofed-echo") -> Path:
    """Write a minimal Flower app (echo ServerApp/ClientApp, see the strings above) into
    `app_dir`; returns it. Run config: num-server-rounds, result-path (absolute), min-nodes,
    node-wait-timeout, round-timeout, fail-on-round (0 = never)."""
    app_dir = Path(app_dir)
    module = name.replace("-", "_")
    (app_dir / module).mkdir(parents=True, exist_ok=True)
    (app_dir / "pyproject.toml").write_text(flower_app_pyproject(
        name, module, "Throwaway Flower app for lordo-fed harness tests", _ECHO_CONFIG))
    (app_dir / module / "__init__.py").write_text("")
    (app_dir / module / "server_app.py").write_text(_ECHO_SERVER)
    (app_dir / module / "client_app.py").write_text(_ECHO_CLIENT)
    return app_dir
