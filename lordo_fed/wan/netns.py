"""Network namespaces joined by one switch, each node's link shaped with `tc tbf`: a WAN on one machine.

    coordinator ns ──veth── ┐
    node0 ns ──veth (tbf both ways)── bridge (switch ns)
    node1 ns ──veth (tbf both ways)── ┘

Every address lives inside the namespaces made here (one private /24 on the switch); the host's
own namespace gets no address, route or device, so nothing outside the emulation is reachable
from it or touched by it. A node's uplink is shaped on its own end of its veth (egress), its
downlink on the switch's end (egress toward the node): `tc` shapes what leaves an interface, so
the two ends give both directions. The coordinator's link is not shaped (a datacenter uplink).

`tbf` lets `burst` bytes through at line rate before the rate applies; transfers that measure the
link should be larger than that (`Topology.burst_bytes`). The kernel here has no `netem`, so the
links have no added latency.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

#: Every namespace made here starts with this, so `cleanup_stale` finds those a killed run left.
PREFIX = "lfemu-"
_TAG = re.compile(r"^[a-z0-9]{1,12}$")


class EmulationError(RuntimeError):
    """The machine cannot host the emulation (not root, no `ip`/`tc`), or a command failed."""


def check_host() -> None:
    """Raise EmulationError naming what is missing: root (namespaces and tc need it), `ip`, `tc`."""
    if os.geteuid() != 0:
        raise EmulationError("lordo-emulate needs root to make network namespaces and shape links with tc: "
                             "run it with sudo (it changes nothing outside the namespaces it creates)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise EmulationError(f"'{tool}' not found on PATH: install {package}")


def run(*cmd: str) -> str:
    """Run one `ip`/`tc` command; EmulationError with its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def exec_prefix(namespace: str) -> list[str]:
    """Prepend to a command to run it inside `namespace` (`ip netns exec` execs it: same PID)."""
    return ["ip", "netns", "exec", namespace]


def tbf_burst(rate: float) -> int:
    """tbf's bucket for a rate in bytes/s: at least one timer tick of data (rate/100 covers HZ >= 100)
    and 128 KiB, so that a 64 KiB GSO segment always fits (a packet larger than the bucket is dropped)."""
    return max(int(rate / 100), 128 * 1024)


@dataclass
class Topology:
    """The namespaces of one emulation. `rates[i]` is node i's link rate in bytes/s each way
    (None: unshaped). Use as a context manager: `delete()` runs on exit, also after errors."""

    tag: str
    rates: list[float | None]
    subnet: str = "10.213.0"
    """First three octets of the /24 inside the switch: coordinator .1, node i .(10 + i)."""
    made: list[str] = field(default_factory=list)
    """Namespaces created so far (what `delete` removes)."""

    def __post_init__(self) -> None:
        if not _TAG.match(self.tag):
            raise ValueError(f"tag {self.tag!r}: expected 1-12 lowercase letters or digits")
        if not 1 <= len(self.rates) <= 200:
            raise ValueError(f"{len(self.rates)} nodes: expected 1..200")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets):
            raise ValueError(f"subnet {self.subnet!r}: expected three octets such as '10.213.0'")

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.tag}-sw"

    @property
    def coordinator(self) -> str:
        return f"{PREFIX}{self.tag}-coord"

    def node(self, i: int) -> str:
        return f"{PREFIX}{self.tag}-node{i}"

    @property
    def coordinator_address(self) -> str:
        return f"{self.subnet}.1"

    def node_address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def burst_bytes(self, i: int) -> int:
        """Bytes node i's link lets through at line rate before its rate applies (0: unshaped)."""
        rate = self.rates[i]
        return 0 if rate is None else tbf_burst(rate)

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Each node's bytes through its veth so far, as the kernel counts them (headers, TLS, Flower's
        own traffic and all): {node namespace: {"rx_bytes": received, "tx_bytes": sent}}."""
        out = {}
        for i in range(len(self.rates)):
            stats = [int(run(*exec_prefix(self.node(i)), "cat", f"/sys/class/net/wan0/statistics/{k}").strip())
                     for k in ("rx_bytes", "tx_bytes")]
            out[self.node(i)] = {"rx_bytes": stats[0], "tx_bytes": stats[1]}
        return out

    # ---------------------------------------------------------------- create / delete
    def create(self) -> "Topology":
        check_host()
        try:
            self._add_namespace(self.switch)
            run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.switch, "link", "set", "br0", "up")
            self._attach(self.coordinator, "coord", self.coordinator_address, None)
            for i, rate in enumerate(self.rates):
                self._attach(self.node(i), f"n{i}", self.node_address(i), rate)
        except BaseException:
            self.delete()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        if os.path.exists(f"/run/netns/{name}"):
            raise EmulationError(f"network namespace {name} exists already: another emulation with tag "
                                 f"{self.tag!r} runs, or one was killed (lordo-emulate --cleanup removes it)")
        run("ip", "netns", "add", name)
        self.made.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def _attach(self, namespace: str, port: str, address: str, rate: float | None) -> None:
        """A namespace with one veth ('wan0') whose other end ('port') is on the switch's bridge."""
        self._add_namespace(namespace)
        run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "wan0", "netns", namespace)
        run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "wan0")
        run("ip", "-n", namespace, "link", "set", "wan0", "up")
        if rate is not None:
            for ns, dev in ((namespace, "wan0"), (self.switch, port)):  # uplink, downlink
                run(*exec_prefix(ns), "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate * 8)}bit",
                    "burst", str(tbf_burst(rate)), "latency", "100ms")

    def delete(self, grace: float = 5.0) -> None:
        """Stop every process still inside the namespaces (SIGTERM, then SIGKILL after `grace`
        seconds), then delete them; deleting a namespace removes its veths and qdiscs. Safe to call
        twice."""
        names = [n for n in self.made if os.path.exists(f"/run/netns/{n}")]
        kill_namespaces(names, grace)
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made = []

    def __enter__(self) -> "Topology":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.delete()


def namespace_pids(name: str) -> set[int]:
    """PIDs of the processes inside network namespace `name`."""
    proc = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return {int(p) for p in proc.stdout.split()} if proc.returncode == 0 else set()


def kill_namespaces(names: list[str], grace: float = 5.0) -> None:
    """SIGTERM every process inside the namespaces, SIGKILL those left after `grace` seconds."""
    sig, deadline = signal.SIGTERM, time.monotonic() + grace
    while True:
        pids = set().union(*(namespace_pids(n) for n in names)) if names else set()
        pids.discard(os.getpid())
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL and time.monotonic() > deadline + 5:
            raise EmulationError(f"processes {sorted(pids)} survived SIGKILL in namespaces {names}")
        time.sleep(0.2)
        if time.monotonic() > deadline:
            sig = signal.SIGKILL


def stale_namespaces() -> list[str]:
    """Namespaces an emulation made (name starts with PREFIX) that still exist."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def cleanup_stale() -> list[str]:
    """Remove every namespace an emulation left behind (a run killed with SIGKILL): their processes
    are stopped first. Returns the names removed."""
    names = stale_namespaces()
    kill_namespaces(names)
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return names
