"""A real Flower deployment from tests and benchmarks: one `flower-superlink` plus N
`flower-supernode` subprocesses on 127.0.0.1 (`Deployment`), with free ports, a private FLWR_HOME
per process, a log file each, TLS and SuperNode authentication when asked, and every process
stopped on exit (harness/processes.py), a node killed or restarted when a test asks.

Facts about flwr this relies on (read from the installed package, checked on this machine with 1.41.0,
the defaults, sleeps and code paths named here re-read in 1.42.0's source;
the process trees and `flwr run` are in harness/flower.py):

- The SuperLink serves ONE HTTP port (`--host`/`--port`, default 127.0.0.1:8000) that carries the
  Fleet API (SuperNodes), the Control API (`flwr` CLI) and the Runtime API (its SuperExec /
  ServerApp). `--control-api-address` / `--fleet-api-address` are deprecated and not opened
  (unless FLWR_INTERNAL_GRPC_CONTROL_API/FLWR_INTERNAL_GRPC_FLEET_API=1, which `flower_env`
  strips). A `--insecure` SuperLink answers `GET http://host:port/health` with 200 once up.
- A SuperNode opens one HTTP port of its own (`--host`/`--port`, default 127.0.0.1:9094: the
  Runtime API for its SuperExec / ClientApp processes); two SuperNodes on one host need distinct
  `--port`. It logs `SuperNode ID: <id>` once it is registered with the SuperLink.
  A SuperNode sleeps a hard-coded 3 s after every empty pull of the SuperLink and checks for its
  ClientApp's reply every 0.5 s (flwr/supernode/start_client_internal.py; no flag or variable).
- `flower-supernode --isolation process` does not spawn the SuperExec: something else must serve
  its Runtime API (`Deployment(isolation="process")` starts a `flower-superexec` next to it). A
  `flwr-clientapp` process still handles exactly one message (one task token) and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.flower import (
    check_run,
    fab_source,
    flower_env,
    flwr_executable,
    format_run_config,
    parse_run_id,
    run_cli,
    write_flower_config,
)
from harness.processes import (
    OWNER_VAR,
    child_preexec,
    descendants,
    find_pids,
    free_port,
    http_ok,
    tail,
    terminate,
    wait_for,
)

_live_deployments: weakref.WeakSet = weakref.WeakSet()


def _stop_leftovers() -> None:
    """At interpreter exit: stop Deployments never stopped (a test that forgot `with`)."""
    for deployment in list(_live_deployments):
        with contextlib.suppress(Exception):
            deployment.stop(raise_on_survivors=False)


atexit.register(_stop_leftovers)


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
    per message (flwr 1.41, 1.42: `flwr-clientapp` takes one task token and exits). `executor_command(i,
    runtime_api_address, supernode_pid)` replaces that command. `supernode_command` replaces the
    `flower-supernode` executable (a list: program and leading arguments).

    Secure mode (checked with flwr 1.41.0): `tls_dir` holds `ca.crt`, `server.pem`, `server.key`
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
            preexec_fn=child_preexec(),
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
        return run_cli([flwr_executable(self.env), *args], self.env, timeout)

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
            result = run_cli(cmd, self.env, timeout, log_path)
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
