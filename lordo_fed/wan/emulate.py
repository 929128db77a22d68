"""`lordo-emulate`: a real geo-distributed deployment on one machine, over shaped links.

One network namespace holds the coordinator (SuperLink, the ServerApp it starts, the ServerApp's
gRPC data plane and the `flwr run` that submits), one per node holds its SuperNode and node worker
(lordo_fed.wan.netns). Each node's link is shaped to its own rate both ways, so a round costs what
it would cost across sites with those links, and the server's `round_over_ideal` (server.jsonl)
says how far the framework is from the link's own limit. The run's log streams to the terminal;
every process, namespace and link is removed at the end, on Ctrl-C and on failure.

    sudo .venv/bin/lordo-emulate --nodes 2 --link 1gbit -- preset=\\"quickstart\\" num-server-rounds=3
    sudo .venv/bin/lordo-emulate --nodes 3 --link node0=1gbit,node1=1gbit,node2=100mbit
    sudo .venv/bin/lordo-emulate --cleanup          # what a SIGKILLed emulation left behind

Emulated nodes share this machine's cores: each node's processes get `--threads` torch threads
(default: the cores split evenly between the nodes and the coordinator), so training is not
slowed by more than its share. Docs: docs/deployment.md, "Try a geo-distributed deployment".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lordo_fed.wan.links import LINK_RATE_KEY, format_rate, parse_links
from lordo_fed.wan.netns import EmulationError, Topology, check_host, cleanup_stale, exec_prefix

#: Environment of every Flower process (as scripts/_common.sh): offline, no dependency installs.
FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
              "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
              "PYTHONUNBUFFERED": "1"}
_PROBE = ("import sys, urllib.request\n"
          "try:\n    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=1).status < 300 else 1)\n"
          "except Exception:\n    sys.exit(1)\n")


def tool_path(path: str | None = None) -> str:
    """PATH for processes that start Flower's CLIs by name: this interpreter's bin folder (not
    resolved: a virtual environment's python is a link out of it) first, then `path` (default: this
    process's PATH)."""
    here = str(Path(sys.executable).parent)
    rest = os.environ.get("PATH", "") if path is None else path
    return os.pathsep.join([here, *(p for p in rest.split(os.pathsep) if p and p != here)])


@dataclass
class EmulationConfig:
    """What `lordo-emulate` starts (each field is a command-line flag)."""

    nodes: int = 2
    """Number of nodes (SuperNode + node worker each, one partition each)."""
    link: str = "1gbit"
    """Link rate of every node (`1gbit`), or per node (`node0=1gbit,node1=100mbit[,default=RATE]`)."""
    app: Path = Path(".")
    """The Flower app directory (its pyproject.toml) that `flwr run` submits."""
    run_config: list[str] = field(default_factory=list)
    """Run-config overrides, TOML `key=value` (as `flwr run --run-config`)."""
    out_dir: Path = Path("run/emulate")
    """Where logs, the node workers' sockets and the run's outputs go."""
    node_workers: bool = True
    """A long-lived node worker beside each SuperNode (the model stays in memory between rounds)."""
    threads: int = 0
    """torch threads per node and for the server (0: the cores split between nodes and server)."""
    ranks_per_node: int = 1
    """Ranks of each node worker (torchrun --nproc-per-node; gloo on CPU): a site of several GPUs."""
    port: int = 8000
    """The SuperLink's port inside the coordinator's namespace."""
    timeout: float = 3600.0
    """Seconds the run may take before it is stopped."""
    tag: str = ""
    """Names this emulation's namespaces (lfemu-TAG-*); '' = a fresh random tag."""
    node_config: list[str] = field(default_factory=list)
    """More node-config keys of one node, `I:key=value ...` (e.g. `0:slowdown=4`: node 0 four times slower)."""

    def validate(self) -> "EmulationConfig":
        if not 1 <= self.nodes <= 200:
            raise ValueError(f"--nodes {self.nodes}: expected 1..200")
        if self.threads < 0:
            raise ValueError(f"--threads {self.threads}: expected >= 0 (0 = automatic)")
        if self.ranks_per_node < 1 or (self.ranks_per_node > 1 and not self.node_workers):
            raise ValueError(f"--ranks-per-node {self.ranks_per_node}: expected >= 1, and node workers (ranks are "
                             "node-worker processes)")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: expected 1..65535")
        if not self.timeout > 0:
            raise ValueError(f"--timeout {self.timeout}: expected seconds > 0")
        if not (self.app / "pyproject.toml").is_file():
            raise ValueError(f"--app {self.app}: no pyproject.toml there (expected a Flower app directory)")
        parse_links(self.link, self.nodes)
        self.extra_node_config()
        return self

    def extra_node_config(self) -> dict[int, str]:
        """`node_config` by node index (ValueError naming an entry that is not `I:key=value` with I a node)."""
        extra: dict[int, list[str]] = {}
        for entry in self.node_config:
            index, sep, keys = entry.partition(":")
            if not sep or not index.strip().isdigit() or int(index) >= self.nodes or "=" not in keys:
                raise ValueError(f"--node-config {entry!r}: expected 'I:key=value ...' with I a node index in "
                                 f"0..{self.nodes - 1}, e.g. '0:slowdown=4'")
            extra.setdefault(int(index), []).append(keys.strip())
        return {i: " ".join(keys) for i, keys in extra.items()}


@dataclass
class Emulation:
    """A running emulation: its topology and processes. `start()` brings everything up; `submit()`
    runs the app to its end; `stop()` (also on exit of the `with` block) removes all of it."""

    cfg: EmulationConfig
    topology: Topology = field(init=False)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cfg.validate()
        self.rates = parse_links(self.cfg.link, self.cfg.nodes)
        self.topology = Topology(self.cfg.tag or uuid.uuid4().hex[:8], list(self.rates))
        self.dir = self.cfg.out_dir.resolve()
        self.threads = self.cfg.threads or max(1, (os.cpu_count() or 1) // (self.cfg.nodes + 1))

    # ------------------------------------------------------------------ processes
    def _env(self, home: str) -> dict[str, str]:
        """Every spawned process's environment. PATH starts with this interpreter's bin folder:
        `sudo .venv/bin/lordo-emulate` runs with sudo's own PATH, without the environment's, and
        Flower's CLIs and the processes they start (flower-superexec, flwr-serverapp) are found by
        name there."""
        return {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(self.dir / home), "OMP_NUM_THREADS": str(self.threads),
                "PATH": tool_path()}

    def _node_launcher(self) -> list[str]:
        """How a node worker starts: python, or torchrun for a node of several ranks."""
        n = self.cfg.ranks_per_node
        return [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                "--nproc-per-node", str(n)]

    def _spawn(self, name: str, namespace: str, cmd: list[str], home: str) -> subprocess.Popen:
        log_path = self.dir / f"{name}.log"
        with open(log_path, "ab") as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(exec_prefix(namespace) + cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=self._env(home), start_new_session=True)
        self.procs[name], self.logs[name] = proc, log_path
        return proc

    def _wait_log(self, name: str, text: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.logs[name].read_text(errors="replace"):
            if self.procs[name].poll() is not None:
                raise EmulationError(f"{name} exited ({self.procs[name].returncode}); log {self.logs[name]}:\n"
                                     + _tail(self.logs[name]))
            if time.monotonic() > deadline:
                raise EmulationError(f"{name} not ready after {timeout:.0f} s; log {self.logs[name]}:\n"
                                     + _tail(self.logs[name]))
            time.sleep(0.2)

    def start(self) -> "Emulation":
        check_host()
        for tool in ("flower-superlink", "flower-supernode", "flwr"):
            if shutil.which(tool, path=tool_path()) is None:
                raise EmulationError(f"'{tool}' not found beside {sys.executable} nor on PATH: install lordo-fed "
                                     "(pip install -e .) and run lordo-emulate from that environment "
                                     "(sudo .venv/bin/lordo-emulate ...)")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.topology.create()
        topo, port = self.topology, self.cfg.port
        self._spawn("superlink", topo.coordinator,
                    ["flower-superlink", "--insecure", "--host", "0.0.0.0", "--port", str(port),
                     "--database", ":flwr-in-memory:", "--disable-runtime-dependency-installation"], "superlink.home")
        self._wait_health()
        extra = self.cfg.extra_node_config()
        for i in range(self.cfg.nodes):
            node_config = f"partition-id={i} num-partitions={self.cfg.nodes} {LINK_RATE_KEY}=\"{format_rate(self.rates[i])}\""
            if i in extra:
                node_config += f" {extra[i]}"
            if self.cfg.node_workers:
                sock = self.dir / f"node-worker-{i}.sock"
                self._spawn(f"node-worker-{i}", topo.node(i),
                            [*self._node_launcher(), "-m", "lordo_fed.node", "--listen", f"unix://{sock}"],
                            f"node-{i}.home")
                node_config += f" node-worker=\"unix://{sock}\""
            self._spawn(f"supernode-{i}", topo.node(i),
                        ["flower-supernode", "--insecure", "--superlink", f"{topo.coordinator_address}:{port}",
                         "--node-config", node_config, "--host", "127.0.0.1", "--port", "9094"], f"node-{i}.home")
        for i in range(self.cfg.nodes):
            if self.cfg.node_workers:
                self._wait_log(f"node-worker-{i}", "listening on")
            self._wait_log(f"supernode-{i}", "SuperNode ID:")
        return self

    def _wait_health(self, timeout: float = 90.0) -> None:
        url = f"http://127.0.0.1:{self.cfg.port}/health"
        deadline = time.monotonic() + timeout
        probe = exec_prefix(self.topology.coordinator) + [sys.executable, "-c", _PROBE, url]
        while subprocess.run(probe, capture_output=True).returncode != 0:
            if self.procs["superlink"].poll() is not None or time.monotonic() > deadline:
                raise EmulationError(f"the SuperLink did not come up; log {self.logs['superlink']}:\n"
                                     + _tail(self.logs["superlink"]))
            time.sleep(0.3)

    def run_config(self) -> list[str]:
        """`--run-config` arguments: the data plane on the coordinator's address (plaintext, inside
        the emulation), outputs under the emulation's directory, threads; then the user's own."""
        ours = (f'data-plane="grpc" data-plane-bind="0.0.0.0" data-plane-address="{self.topology.coordinator_address}" '
                f'data-plane-insecure=true output-dir="{self.dir / "out"}" threads={self.threads}')
        return ["--run-config", ours] + [a for rc in self.cfg.run_config for a in ("--run-config", rc)]

    def submit(self, stream: IO[str] | None = None) -> int:
        """`flwr run APP emulated --stream` inside the coordinator's namespace; its output goes to
        `stream` (and run.log). Returns 0 when the run finished, 1 when it failed, 124 on timeout."""
        home = self.dir / "cli.home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "emulated"\n\n[superlink.emulated]\naddress = "127.0.0.1:{self.cfg.port}"\n'
            "insecure = true\n")
        cmd = exec_prefix(self.topology.coordinator) + ["flwr", "run", str(self.cfg.app.resolve()), "emulated",
                                                        "--stream", *self.run_config()]
        log_path = self.dir / "run.log"
        out = []
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=self._env("cli.home"), start_new_session=True)
            self.procs["flwr-run"] = proc
            timer = threading.Timer(self.cfg.timeout, proc.kill)
            timer.start()
            try:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    out.append(line)
                    if stream is not None:
                        stream.write(line)
                        stream.flush()
                proc.wait()
            finally:
                timer.cancel()
        if proc.returncode in (-signal.SIGKILL, 137):
            return 124
        text = "".join(out)
        if proc.returncode != 0 or any(f"Exit Code: {c}" in text for c in range(1, 256)):
            return 1
        return 0

    def stop(self) -> None:
        """Every process (by PID, then whatever else is inside the namespaces), then the namespaces."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self.topology.delete()

    def __enter__(self) -> "Emulation":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def summary(out_dir: Path) -> str:
    """Per round: time, the link-bound ideal and their ratio, from the run's server.jsonl."""
    path = out_dir / "server.jsonl"
    if not path.exists():
        return f"(no {path})"
    rows = ["round  round_s  ideal_s  round/ideal  link_s  train_s  agg_s"]
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("round", 0) < 1 or "ideal_seconds" not in r:
            continue
        bound = r["links"][str(r["link_bound_client"])]
        rows.append(f"{r['round']:>5}  {r['round_seconds']:7.2f}  {r['ideal_seconds']:7.2f}  {r['round_over_ideal']:11.2f}"
                    f"  {r['link_seconds']:6.2f}  {bound['train_seconds']:7.2f}  {r['aggregation_seconds']:5.2f}")
    return "\n".join(rows)


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join("    " + line for line in path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "    (no log)"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, EmulationConfig]:
    defaults = EmulationConfig()
    p = argparse.ArgumentParser(prog="lordo-emulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Arguments after -- are run-config overrides (key=value, TOML values).")
    p.add_argument("--nodes", type=int, default=defaults.nodes, help="number of nodes (default 2)")
    p.add_argument("--link", default=defaults.link,
                   help="every node's link rate (1gbit, 100mbit) or per node: node0=1gbit,node1=100mbit[,default=RATE]")
    p.add_argument("--app", type=Path, default=defaults.app, help="Flower app directory (default .)")
    p.add_argument("--run-config", "-c", action="append", default=[], help="run-config overrides 'k=v ...' (repeatable)")
    p.add_argument("--dir", type=Path, default=defaults.out_dir, help="logs, sockets and outputs (default run/emulate)")
    p.add_argument("--no-node-workers", action="store_true", help="train in the ClientApp process (no node workers)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per node and server (default: cores split)")
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks of each node worker (torchrun; a site of several GPUs, gloo here)")
    p.add_argument("--port", type=int, default=defaults.port, help="SuperLink port in the coordinator namespace")
    p.add_argument("--timeout", type=float, default=defaults.timeout, help="stop the run after this many seconds")
    p.add_argument("--tag", default="", help="namespace names lfemu-TAG-* (default: random)")
    p.add_argument("--node-config", action="append", default=[], metavar="I:KEYS",
                   help="more node-config keys of node I, e.g. '0:slowdown=4' (repeatable)")
    p.add_argument("--cleanup", action="store_true", help="remove what killed emulations left (lfemu-* namespaces) and exit")
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg = EmulationConfig(nodes=args.nodes, link=args.link, app=args.app,
                          run_config=args.run_config + ([" ".join(args.overrides)] if args.overrides else []),
                          out_dir=args.dir, node_workers=not args.no_node_workers, threads=args.threads,
                          ranks_per_node=args.ranks_per_node,
                          port=args.port, timeout=args.timeout, tag=args.tag, node_config=args.node_config)
    return args, cfg


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    try:
        if args.cleanup:
            check_host()
            removed = cleanup_stale()
            print(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
            return 0
        cfg.validate()
        emulation = Emulation(cfg)
    except (ValueError, EmulationError) as err:
        print(f"lordo-emulate: {err}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM end the run; the `with` block's exit removes everything. SIGINT is set
    # explicitly: a shell without job control starts background commands with it ignored, and
    # Python keeps an inherited SIG_IGN.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    links = ", ".join(f"node{i} {format_rate(r)}" for i, r in enumerate(emulation.rates))
    try:
        with emulation:
            print(f"lordo-emulate: {cfg.nodes} nodes ({links}), coordinator {emulation.topology.coordinator_address}, "
                  f"logs {emulation.dir}", flush=True)
            status = emulation.submit(sys.stdout)
    except EmulationError as err:
        print(f"lordo-emulate: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lordo-emulate: interrupted; processes and namespaces removed", file=sys.stderr)
        return 130
    print(summary(emulation.dir / "out"))
    print(f"lordo-emulate: run {'finished' if status == 0 else 'FAILED' if status == 1 else 'timed out'}; "
          f"logs {emulation.dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
