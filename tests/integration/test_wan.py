"""Wide-area links (lordo_fed.wan): link rates, the link-bound ideal, network namespaces with tc
shaping, and `lordo-emulate`, a real deployment over shaped links on one machine.

The namespace tests need root and iproute2 (`ip`, `tc`); they skip with the reason otherwise.
Every address they use lives inside namespaces the test creates and deletes. Time is only
bounded from below (bytes / rate): a noisy machine can make a transfer slower, never faster than
its link.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lordo_fed.wan.links import NodeLink, format_rate, ideal_round_seconds, parse_links, parse_rate
from lordo_fed.wan.netns import PREFIX, EmulationError, Topology, check_host, exec_prefix, stale_namespaces

ROOT = Path(__file__).resolve().parents[2]


def _namespaces_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    return None


needs_netns = pytest.mark.skipif(bool(_namespaces_unavailable()), reason=_namespaces_unavailable() or "")


def _tag() -> str:
    return "t" + uuid.uuid4().hex[:7]


# ----------------------------------------------------------------------------- rates and ideal
def test_rates_use_tc_units():
    assert parse_rate("1gbit") == 125e6
    assert parse_rate("100mbit") == 12.5e6
    assert parse_rate("500kbit") == 62.5e3
    assert parse_rate("25mbps") == 25e6  # tc: bytes per second
    assert parse_rate("8000") == 1000.0  # a bare number is bits per second, as for tc
    assert parse_rate(8e6) == 1e6
    assert parse_rate(" 2.5Gbit ") == 312.5e6
    assert format_rate(125e6) == "1gbit" and format_rate(12.5e6) == "100mbit" and format_rate(1000.0) == "8kbit"
    for bad in ("fast", "10 furlongs", "-1mbit", "0gbit", "", True, "nan"):
        with pytest.raises(ValueError, match="link rate"):
            parse_rate(bad)


def test_links_per_node():
    assert parse_links("1gbit", 3) == [125e6] * 3
    assert parse_links("node0=1gbit,node1=100mbit", 2) == [125e6, 12.5e6]
    assert parse_links("node1=100mbit,default=1gbit", 3) == [125e6, 12.5e6, 125e6]
    with pytest.raises(ValueError, match=r"no rate for \['node1'\]"):
        parse_links("node0=1gbit", 2)
    with pytest.raises(ValueError, match="there are 2 nodes"):
        parse_links("node0=1gbit,node5=1gbit,default=1gbit", 2)
    with pytest.raises(ValueError, match="expected nodeI=RATE"):
        parse_links("site0=1gbit", 1)
    with pytest.raises(ValueError, match="twice"):
        parse_links("node0=1gbit,node0=2gbit", 1)


def test_ideal_round_is_the_slowest_node_plus_aggregation():
    # node 0: (100 + 300) MB at 100 MB/s = 4 s + 1 s training = 5 s; node 1: (100 + 300) MB at
    # 200 MB/s = 2 s + 2.5 s = 4.5 s. Ideal: 5 s + 0.5 s aggregation, bound by node 0.
    nodes = {0: NodeLink(100_000_000, 300_000_000, 100e6, 1.0), 1: NodeLink(100_000_000, 300_000_000, 200e6, 2.5)}
    assert ideal_round_seconds(nodes, 0.5) == (5.5, 0)
    nodes[1] = NodeLink(100_000_000, 300_000_000, 200e6, 3.5)  # now node 1: 2 + 3.5 = 5.5 s
    assert ideal_round_seconds(nodes, 0.5) == (6.0, 1)
    with pytest.raises(ValueError):
        ideal_round_seconds({}, 0.0)


def test_the_emulator_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationError, match="needs root"):
        check_host()


def test_emulator_options_are_checked(tmp_path):
    from lordo_fed.wan.emulate import EmulationConfig

    for kw, match in (({"nodes": 0}, "--nodes 0"), ({"threads": -1}, "--threads -1"), ({"port": 70000}, "--port"),
                      ({"link": "node0=1gbit"}, "no rate for"), ({"app": tmp_path}, "no pyproject.toml"),
                      ({"timeout": 0}, "--timeout"), ({"ranks_per_node": 0}, "--ranks-per-node 0"),
                      ({"ranks_per_node": 2, "node_workers": False}, "--ranks-per-node 2: expected >= 1, and node workers"),
                      ({"node_config": ["2:slowdown=4"]}, "--node-config '2:slowdown=4': expected 'I:key=value ...' "
                                                          "with I a node index in 0..1"),
                      ({"node_config": ["slowdown=4"]}, "--node-config 'slowdown=4'")):
        with pytest.raises(ValueError, match=match):
            EmulationConfig(app=ROOT, **kw).validate() if "app" not in kw else EmulationConfig(**kw).validate()
    proc = subprocess.run([sys.executable, "-m", "lordo_fed.wan.emulate", "--link", "warp9", "--app", str(ROOT)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "link rate 'warp9'" in proc.stderr, proc.stderr
    cfg = EmulationConfig(app=ROOT, nodes=3, node_config=["0:slowdown=4", "2:local-steps=8", "0:data-path='/d'"]).validate()
    assert cfg.extra_node_config() == {0: "slowdown=4 data-path='/d'", 2: "local-steps=8"}


# ----------------------------------------------------------------------------- namespaces and links
_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5001)); s.listen()
print("ready", flush=True)
c, _ = s.accept(); n = 0; t = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t = t or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t, flush=True)
"""
_SEND = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5001)); s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


def _transfer(topo: Topology, src: str, dst: str, dst_address: str, size: int) -> float:
    sink = subprocess.Popen(exec_prefix(dst) + [sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        subprocess.run(exec_prefix(src) + [sys.executable, "-c", _SEND, dst_address, str(size)], check=True, timeout=60)
        received, seconds = sink.stdout.readline().split()
        assert int(received) == size
        return float(seconds)
    finally:
        sink.kill()
        sink.wait()


@needs_netns
def test_each_node_link_is_shaped_both_ways_and_removed_after():
    rate = parse_rate("40mbit")  # 5 MB/s; 3 MB takes >= (3 MB - burst) / rate
    size = 3_000_000
    topo = Topology(_tag(), [rate, None])
    with topo:
        assert set(stale_namespaces()) >= {topo.switch, topo.coordinator, topo.node(0), topo.node(1)}
        bound = (size - topo.burst_bytes(0)) / rate
        up = _transfer(topo, topo.node(0), topo.coordinator, topo.coordinator_address, size)
        down = _transfer(topo, topo.coordinator, topo.node(0), topo.node_address(0), size)
        assert up >= bound and down >= bound, (up, down, bound)
        free = _transfer(topo, topo.coordinator, topo.node(1), topo.node_address(1), size)  # node1 unshaped
        assert free < bound, (free, bound)
        # The host's own namespace got no address of the emulation.
        assert topo.subnet not in subprocess.run(["ip", "addr"], capture_output=True, text=True).stdout
        sleeper = subprocess.Popen(exec_prefix(topo.node(1)) + ["sleep", "600"])
    sleeper.wait(timeout=15)  # delete() stopped what was still running inside
    assert not {topo.switch, topo.coordinator, topo.node(0), topo.node(1)} & set(stale_namespaces())
    with pytest.raises(ValueError, match="tag"):
        Topology("Bad-Tag", [rate])


# ----------------------------------------------------------------------------- lordo-emulate
def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting to be reaped by init has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


SUDO_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""sudo's `secure_path` (Debian's and Ubuntu's sudoers): the caller's PATH is not kept."""


def _emulate(tmp_path: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lordo_fed.wan.emulate", "--app", str(ROOT), "--dir",
                             str(tmp_path / "emu"), "--tag", _tag(), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path, **popen)


@needs_netns
@pytest.mark.slow
def test_a_deployment_over_shaped_links_is_link_bound_and_exact(tmp_path):
    """Two nodes at 8 Mbit/s (1 MB/s): each ~0.75 MB transfer takes at least (bytes - burst) / rate,
    the run ends at the reference trainer's θ bit for bit, and nothing of the emulation remains.
    Started as `sudo .venv/bin/lordo-emulate` starts it (docs/deployment.md): with sudo's PATH, which
    holds neither the environment's Flower CLIs nor what Flower starts by name."""
    from lordo_fed.checkpoint import load_checkpoint
    from tests.integration.test_flower_app import reference_theta, server_records, tiny_run_config

    cfg = tiny_run_config(tmp_path)  # 2 rounds: round 2 sends θ
    overrides = [f"{k}={json.dumps(v)}" for k, v in cfg.items() if k not in ("output-dir", "threads")]
    before = set(stale_namespaces())
    proc = _emulate(tmp_path, "--nodes", "2", "--link", "8mbit", "--threads", "1", "--timeout", "300", "--", *overrides,
                    env={**os.environ, "PATH": SUDO_PATH})
    out, _ = proc.communicate(timeout=420)
    assert proc.returncode == 0, out[-4000:]
    assert "round/ideal" in out
    assert set(stale_namespaces()) == before, "namespaces left behind"
    records = server_records(tmp_path / "emu" / "out")
    assert [r["round"] for r in records] == [0, 1, 2]
    rate, burst = parse_rate("8mbit"), max(int(parse_rate("8mbit") / 100), 128 * 1024)
    for r in records[1:]:
        assert r["clients_ok"] == 2 and r["ideal_seconds"] > 0 and r["round_over_ideal"] >= 1.0, r
        assert set(r["links"]) == {"0", "1"}
        for link in r["links"].values():
            assert link["rate"] == rate
            assert link["upload_seconds"] >= (link["up_bytes"] - burst) / rate, (r["round"], link)
            if link["down_bytes"] > burst:  # round 1 sends no θ (both sides build θ0 from the seed)
                # from its first byte: before it, the node waited for the server to publish the round
                streamed = link["download_seconds"] - link["download_wait_seconds"]
                assert streamed >= (link["down_bytes"] - burst) / rate, (r["round"], link)
    assert records[2]["links"]["0"]["down_bytes"] > 5 * burst  # the link was really exercised
    assert (tmp_path / "emu" / "out" / "link.png").stat().st_size > 0  # rounds against their ideal, plotted
    tensors, _ = load_checkpoint(tmp_path / "emu" / "out" / "checkpoints")
    theta = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
    reference = reference_theta(cfg, workers=2)
    worst = max((theta[n] - reference[n]).abs().max().item() for n in reference)
    assert worst == 0.0, f"max |θ_emulated − θ_reference| = {worst}"


@needs_netns
@pytest.mark.slow
@pytest.mark.extended  # the CI lane runs the emulator's deployment above and its cleanup after a finished run
def test_ctrl_c_and_a_failed_run_leave_nothing_behind(tmp_path):
    before = set(stale_namespaces())
    # Ctrl-C once the nodes are up and the run was submitted.
    proc = _emulate(tmp_path, "--nodes", "2", "--link", "100mbit", "--", 'preset="quickstart"', "num-server-rounds=50")
    deadline = time.monotonic() + 120
    while not (tmp_path / "emu" / "run.log").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    pids = {int(p) for ns in set(stale_namespaces()) - before
            for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()}
    assert pids, "nothing ran inside the namespaces"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out, out[-3000:]
    assert set(stale_namespaces()) == before
    assert not [p for p in pids if _running(p)], "processes survived"
    # A run that fails (an unknown preset): exit 1, nothing left.
    proc = _emulate(tmp_path, "--nodes", "1", "--link", "100mbit", "--", 'preset="no-such-preset"')
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1 and "FAILED" in out, out[-3000:]
    assert set(stale_namespaces()) == before


@needs_netns
@pytest.mark.slow
@pytest.mark.extended
def test_wan_rounds_benchmark_quick(tmp_path):
    """benchmarks/wan_rounds.py --quick: one emulated deployment with overlapped rounds (K = 3, τ = 2),
    its rounds against the synchronous ideal and against max(compute, link)."""
    out = tmp_path / "wan.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wan_rounds.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    assert [r["round"] for r in case["rounds"]] == [1, 2, 3]
    med = case["median_rounds_2_to_n"]
    assert case["run_config"] == {"local-steps": 3, "overlap-delay": 2}
    assert med["ideal_seconds"] > med["link_seconds"] > 0
    # the round's transfers take at least bytes / rate, overlapped or not (the link dominates here)
    assert med["round_seconds"] >= med["link_seconds"] and med["round_over_bound"] > 0
    assert all(r["round_over_bound"] is not None for r in case["rounds"])
    # the kernel's count on each node's veth holds the app's payload bytes and the traffic around them
    assert len(case["veth_bytes"]) == 2 and all(0.2 < share <= 1.0 for share in case["app_over_veth"].values()), case
    assert out.with_suffix(".png").exists()
