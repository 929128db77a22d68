"""Run a Flower app from tests and benchmarks: the environment every Flower process gets
(`flower_env`: a private FLWR_HOME, its own local SuperLink port), the `flwr` CLI and its exit
codes, and simulation (`run_simulation`: `flwr run <app> local`). A real deployment (one
`flower-superlink` plus N `flower-supernode` subprocesses on 127.0.0.1) is harness/deployment.py;
stopping what they start, harness/processes.py.

Plain functions, no pytest fixtures. Every process this module starts is stopped by PID (process
groups plus their descendants, SIGTERM then SIGKILL, bounded waits).

Facts about flwr this relies on (read from the installed package, checked on this machine with 1.41.0;
the constants and code paths named here read the same in 1.42.0's source):

- Process trees: `flower-superlink` spawns `flower-superexec` in a NEW session (so killing the
  SuperLink's process group misses it; it exits ~0.2 s after its parent dies) which spawns
  `flwr-serverapp` / `flwr-simulation` (+ Ray). `flower-supernode` spawns `flower-superexec` in its
  own process group, which spawns one `flwr-clientapp` per message. Each `flower-superexec` asks
  for work every FLWR_SUPEREXEC_TASK_POLL_INTERVAL seconds (default 1; `flower_env` sets 0.1).
- `flwr run <app> local` reads `$FLWR_HOME/config.toml`; `address = ":local:"` makes the CLI start
  (if `GET 127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT/health` fails; default port 39091) a
  detached `flower-superlink --simulation` that keeps running after the run. It reuses ANY
  SuperLink answering on that port, even one started with another FLWR_HOME: `flower_env` gives
  each environment its own free port through FLWR_LOCAL_SUPERLINK_HTTP_API_PORT.
- `flwr run --stream` exits 0 even when the ServerApp raised: `run_failure` reads the streamed
  'Exit Code: <n>' instead.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from harness.machine import Machine, machine_report
from harness.processes import OWNER_VAR, child_preexec, descendants, find_pids, free_port, port_open, terminate
from lordo_fed.wan.emulate import tool_path

#: Set by `flower_env`; identifies one environment (and its FLWR_HOME).
ENV_ID_VAR = "LORDO_FED_HARNESS_ENV"
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

# --------------------------------------------------------------------------------------------
# run config and the CLI's config.toml
# --------------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_value(value: Any) -> str:
    """One run-config or pyproject value in TOML, in the form Flower's `--run-config` parser
    accepts (its pair regex is stricter than TOML: see the string branch)."""
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


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys, as Flower flattens `[tool.flwr.app.config]`; keys checked to
    be bare TOML keys (Flower's parser takes no quoted ones)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not all(_BARE_KEY.match(p) for p in key.split(".")):
            raise ValueError(f"run-config keys must be [A-Za-z0-9_-] (dotted for nesting): {key!r}")
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, prefix=f"{full}."))
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
    return " ".join(f"{k}={toml_value(v)}" for k, v in flatten_config(config).items())


def _toml_dump_connections(doc: Mapping[str, Any]) -> str:
    """Serialize {'superlink': {'default': str, <name>: {key: str|bool}}} as TOML."""
    superlink = doc.get("superlink", {})
    lines = ["[superlink]"]
    for key, value in superlink.items():
        if not isinstance(value, Mapping):
            lines.append(f"{key} = {toml_value(value)}")
    for name, conn in superlink.items():
        if isinstance(conn, Mapping):
            lines += ["", f"[superlink.{name}]"]
            for key, value in conn.items():
                if isinstance(value, Mapping):  # e.g. deprecated `options` tables: keep them
                    for sub_key, sub_value in flatten_config(value).items():
                        lines.append(f"{key}.{sub_key} = {toml_value(sub_value)}")
                else:
                    lines.append(f"{key} = {toml_value(value)}")
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


atexit.register(cleanup_short_dirs)


# --------------------------------------------------------------------------------------------
# environments
# --------------------------------------------------------------------------------------------


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
    env["PATH"] = tool_path(env.get("PATH", ""))
    env[ENV_ID_VAR] = uuid.uuid4().hex
    connections: dict[str, str | None] = {"local": ":local:"}
    if deployment_port is not None:
        connections[connection] = f"{deployment_host}:{deployment_port}"
    write_flower_config(flwr_home, connections)
    return env


def flwr_executable(env: Mapping[str, str], name: str = "flwr") -> str:
    """Absolute path of a Flower console script (this interpreter's bin dir first)."""
    found = shutil.which(name, path=tool_path(env.get("PATH", "")))
    if not found:
        raise FileNotFoundError(f"{name} not found on PATH")
    return found


# --------------------------------------------------------------------------------------------
# the flwr CLI
# --------------------------------------------------------------------------------------------


def run_cli(
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
        preexec_fn=child_preexec(),
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


#: Separates a failed simulation's own output from what `run_simulation` appends to it.
DIAGNOSIS_MARK = "\n=== diagnosis: Ray's logs and sessions, the machine during the run ===\n"


class FlowerRunError(subprocess.CalledProcessError):
    """`flwr run` failed: non-zero exit, or the streamed log reports a failed ServerApp/simulation
    (`flwr run --stream` itself exits 0 even then)."""

    def __str__(self) -> str:
        # The run's own output and the diagnosis `run_simulation` appends each keep their ends: the
        # Ray log tails alone could push the error that stopped the run out of a single tail.
        output, mark, diagnosis = (self.output or "").partition(DIAGNOSIS_MARK)
        text = f"{super().__str__()}\n--- output (tail) ---\n{output[-4000:]}"
        return text + (f"\n{mark}{diagnosis[-4000:]}" if mark else "")


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
    descendants, anything started by `run_simulation` with this environment, and any other process
    that carries this environment's id (ENV_ID_VAR): a `flwr run` started by a script or a shell with
    this environment leaves Ray workers that have lost their parent and are no one's descendants
    while they wind down. Returns the PIDs that were found (all gone afterwards, else RuntimeError)."""
    owner = _sim_owner(env)
    roots = local_superlink_pids(env)
    found = roots | descendants(roots) | (find_pids({OWNER_VAR: owner}) if owner else set())
    if ENV_ID_VAR in env:
        found |= find_pids({ENV_ID_VAR: env[ENV_ID_VAR]})
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

    Why: `flwr run <dir>` reads the path of every file under `dir` (flwr 1.41, 1.42
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
    before = Machine.now()
    try:
        result = run_cli(cmd, child_env, timeout, log_path)
    finally:
        if not keep_superlink:
            stop_local_superlink(env)
    if run_failure(result):
        # Ray's own logs go with the short RAY_TMPDIR at exit: keep their tails with the run's output,
        # so a failure inside Ray (a raylet that never registered) names its cause, and what the
        # machine did meanwhile last, where the end of a failure's message is what a CI log shows.
        ray_tmpdir = env.get("RAY_TMPDIR")
        sessions = _ray_session_logs(ray_tmpdir)  # each log read once, for its tail and its line count
        result.stdout = ((result.stdout or "") + DIAGNOSIS_MARK + ray_log_tails(ray_tmpdir, 8, sessions)
                         + ray_sessions(ray_tmpdir, sessions)
                         + machine_report(before, tuple(filter(None, ("/tmp", ray_tmpdir)))) + "\n")
        if log_path:
            Path(log_path).write_text(result.stdout)
    return check_run(result) if check else result


RAY_LOGS = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err", "runtime_env_agent.log")


def _ray_session_logs(ray_tmpdir: str | None) -> list[tuple[Path, dict[str, list[str] | None]]]:
    """Every Ray session under `ray_tmpdir` (the sessions of one environment's runs), in order, with the
    lines of each log in RAY_LOGS (None where the log is absent)."""
    found = []
    for session in sorted(Path(ray_tmpdir).glob("ray/session_2*")) if ray_tmpdir else ():
        logs: dict[str, list[str] | None] = {}
        for name in RAY_LOGS:
            try:
                logs[name] = (session / "logs" / name).read_text(errors="replace").splitlines()
            except OSError:
                logs[name] = None
        found.append((session, logs))
    return found


def ray_log_tails(ray_tmpdir: str | None, lines: int = 15,
                  sessions: list[tuple[Path, dict[str, list[str] | None]]] | None = None) -> str:
    """The last `lines` lines of each Ray log in RAY_LOGS, for every Ray session under `ray_tmpdir`
    (or of `sessions`, as `_ray_session_logs` read them), or "" when there are none."""
    out = [f"--- {session.name}/{name} (tail) ---\n" + "\n".join(text[-lines:])
           for session, logs in (_ray_session_logs(ray_tmpdir) if sessions is None else sessions)
           for name, text in logs.items() if text]
    return "\n" + "\n".join(out) + "\n" if out else ""


_PORT_FILE = re.compile(r"^(.+)_port_[0-9a-f]+$")


def ray_sessions(ray_tmpdir: str | None,
                 sessions: list[tuple[Path, dict[str, list[str] | None]]] | None = None) -> str:
    """One line per Ray session under `ray_tmpdir` (or of `sessions`): how many lines each log in RAY_LOGS
    holds (0 when Ray created it and its process wrote nothing; 'absent' when its process never started)
    and the port files written, i.e. how far start-up got (a GCS that never wrote its port file leaves
    'gcs_server' out)."""
    out = []
    for session, logs in _ray_session_logs(ray_tmpdir) if sessions is None else sessions:
        counts = [f"{name} {'absent' if text is None else len(text)}" for name, text in logs.items()]
        ports = sorted(m.group(1) for p in session.iterdir() if (m := _PORT_FILE.match(p.name)))
        out.append(f"ray {session.name}: {', '.join(counts)}; port files: {', '.join(ports) or 'none'}")
    return "\n".join(out) + "\n" if out else ""
