"""A secure deployment for real: TLS and SuperNode authentication (checked with flwr 1.41.0).

`scripts/generate_certs.py` makes a CA, the SuperLink's certificate (SAN 127.0.0.1/localhost)
and three ECDSA node keys. The SuperLink serves HTTPS only and runs with
`--enable-supernode-auth`; two node keys are registered with `flwr supernode register`, their
SuperNodes connect with `--root-certificates` and `--auth-supernode-private-key`, and the app
trains 2 rounds over TLS on the data plane, to the reference trainer's θ bit for bit. Refused
meanwhile: a SuperNode with the third (unregistered) key, a SuperNode without a key (it would
self-register if authentication were off), a plain-HTTP SuperNode, a plain-HTTP client and a
client that does not trust the CA.

In the extended lane, `test_asynchronous_sessions_over_tls` runs asynchronous rounds over the
same TLS data plane, and `test_scripts_secure_mode` drives the same setup through the shell
scripts (start_superlink.sh --tls --node-auth, register_supernodes.sh, start_supernodes.sh
--root-certificates --auth-keys, submit_run.sh --root-certificates, stop_all.sh) with a throwaway
echo app.
"""

import json
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.apps import write_echo_app
from harness.deployment import Deployment
from harness.flower import flower_env, write_flower_config
from harness.processes import (
    OWNER_VAR,
    alive,
    find_pids,
    free_port,
    http_ok,
    terminate,
    wait_for,
)
from lordo_fed.checkpoint import load_checkpoint
from tests.integration.test_flower_app import APP, reference_theta, server_records, tiny_run_config

SCRIPTS = APP / "scripts"
GENERATE_CERTS = SCRIPTS / "generate_certs.py"
pytestmark = pytest.mark.slow


def generate_certs(out: Path, nodes: int) -> None:
    res = subprocess.run([sys.executable, str(GENERATE_CERTS), str(out), "--nodes", str(nodes)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def wait_exit(proc, timeout: float = 90.0) -> int:
    wait_for(lambda: not proc.alive(), timeout, what=f"{proc.name} to exit")
    return proc.popen.returncode


def test_tls_run_with_registered_supernodes_and_intruders_refused(tmp_path):
    t0 = time.monotonic()
    certs = tmp_path / "certs"
    generate_certs(certs, nodes=3)
    keys = certs / "nodes"
    for secret in (certs / "ca.key", certs / "server.key", keys / "node-0", keys / "node-2"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    # The generator never overwrites a key silently.
    again = subprocess.run([sys.executable, str(GENERATE_CERTS), str(certs)], capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr

    with Deployment(tmp_path, num_nodes=2, tls_dir=certs, supernode_auth=True,
                    node_keys=[keys / "node-0", keys / "node-1"]) as dep:
        host = dep.address
        # HTTPS with the CA only: a plain-HTTP request gets no answer.
        assert http_ok(f"https://{host}/health", cafile=certs / "ca.crt")
        assert not http_ok(f"http://{host}/health")

        # The federation is exactly the two registered keys, both online under the registered ids.
        registered = dep.registered_node_ids
        assert all(registered) and [dep.node_id(i) for i in range(2)] == registered
        assert {int(n["node-id"]): n["status"] for n in dep.list_nodes()} == dict.fromkeys(registered, "online")

        # Intruders, started while the run goes on.
        unregistered = dep.start_extra_supernode("unregistered-key", key=keys / "node-2")
        anonymous = dep.start_extra_supernode("no-key")
        plain = dep.start_extra_supernode("plain-http", insecure=True, extra_args=["--max-retries", "2"])

        t_run = time.monotonic()
        # The data plane serves TLS with the SuperLink's certificate; nodes verify it with the CA.
        tls = {"data-plane-certfile": str(certs / "server.pem"), "data-plane-keyfile": str(certs / "server.key")}
        run = dep.run(APP, tiny_run_config(tmp_path, **tls), timeout=240, check=True)
        t_run = time.monotonic() - t_run
        assert re.search(r"data plane: serving on 127\.0\.0\.1:\d+ \(TLS\)", run.stdout or "")
        records = server_records(tmp_path / "out")
        assert [r["round"] for r in records] == [0, 1, 2]
        assert all(r["clients_ok"] == 2 and r["clients_missing"] == 0 for r in records[1:])
        assert records[-1]["val_loss"] < records[0]["val_loss"]
        assert "upload_seconds" in records[1]  # the payloads went over the data plane
        # round 2's tickets went out while round 1 ran
        assert [r["phase_seconds"].get("announced", 0) < 0 for r in records[1:]] == [False, True], records
        tensors, _ = load_checkpoint(tmp_path / "out" / "checkpoints")
        theta = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
        # θ0 is the seeded init both sides build: round 1 sends no θ, round 2 sends θ
        theta_bytes = 4 * sum(t.numel() for t in theta.values())
        assert records[1]["bytes_sent_per_client"] < theta_bytes <= records[2]["bytes_sent_per_client"], records
        assert not list((tmp_path / "out" / "dataplane_spool").glob("*")), "spooled replies left behind"

        # A key the operator did not register: activation refused, the SuperNode exits.
        assert wait_exit(unregistered) != 0
        log = unregistered.log_path.read_text(errors="replace")
        assert "Failed to activate SuperNode" in log and "SuperNode ID:" not in log
        # No key: self-registration is what authentication turns off (without
        # --enable-supernode-auth this node would register and get an id).
        assert wait_exit(anonymous) != 0
        log = anonymous.log_path.read_text(errors="replace")
        assert "SuperNode authentication is enabled. All SuperNodes must be registered" in log
        assert "SuperNode ID:" not in log
        superlink_log = dep.superlink.log_path.read_text(errors="replace")
        assert "[/v1/fleet/register-node][ApiError:2001]" in superlink_log
        assert "No SuperNode found with the given public key" in superlink_log
        # Plain HTTP to the TLS port: never connects, gives up.
        assert wait_exit(plain) != 0
        assert "SuperNode ID:" not in plain.log_path.read_text(errors="replace")

        # Still exactly the two registered nodes.
        assert {int(n["node-id"]) for n in dep.list_nodes()} == set(registered)

        # The CLI: plain HTTP, or TLS without trusting our CA, cannot reach the Control API.
        write_flower_config(dep.env["FLWR_HOME"], {
            "plain": {"address": host, "insecure": True},
            "untrusted": {"address": host},  # TLS, system trust store
        })
        for connection in ("plain", "untrusted"):
            res = dep.flwr("supernode", "list", connection, "--format", "json")
            reply = json.loads(res.stdout[res.stdout.find("{"):])  # exit status 0 even on failure
            assert reply["success"] is False and "nodes" not in reply, res.stdout
            assert "Connection to the SuperLink is unavailable" in reply["error-message"]
        pids = dep.all_pids()
    assert not alive(pids)
    # The run ends at the reference trainer's θ, bit for bit (the data plane's default transport: the
    # plaintext one and Flower's messages are tests/integration/test_flower_app.py's).
    reference = reference_theta(tiny_run_config(tmp_path), workers=2)
    worst = max((theta[n] - reference[n]).abs().max().item() for n in reference)
    assert worst == 0.0, f"max |θ_TLS deployment − θ_reference| = {worst}"
    print(f"secure deployment: startup {dep.timings['startup_s']:.1f} s (registration included), "
          f"2-round run {t_run:.1f} s, all {time.monotonic() - t0:.1f} s")


@pytest.mark.extended  # the CI lane runs asynchronous sessions on the plaintext data plane (test_async_flower.py)
def test_asynchronous_sessions_over_tls(tmp_path):
    """Asynchronous rounds over the TLS data plane: each node's rounds are one session there, opened by
    one Flower message, then uploads and start points on the data plane alone."""
    certs = tmp_path / "certs"
    generate_certs(certs, nodes=2)
    tls = {"data-plane-certfile": str(certs / "server.pem"), "data-plane-keyfile": str(certs / "server.key")}
    with Deployment(tmp_path, num_nodes=2, tls_dir=certs) as dep:
        t_async = time.monotonic()
        run = dep.run(APP, tiny_run_config(tmp_path, variant="heloco_lordo", **tls,
                                           **{"output-dir": str(tmp_path / "out-async")}), timeout=240, check=True)
        t_async = time.monotonic() - t_async
        pids = dep.all_pids()
    assert not alive(pids)
    assert re.search(r"data plane: serving on 127\.0\.0\.1:\d+ \(TLS\)", run.stdout or "")
    records = server_records(tmp_path / "out-async")
    assert records[-1]["pushes"] == 4 and records[-1]["train_messages"] == 2, records[-1]
    assert all(sum(r["pushes_by_worker"][p] for r in records[1:]) >= 1 for p in (0, 1)), records
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    print(f"asynchronous sessions over TLS: {t_async:.1f} s")


def free_port_pair() -> int:
    """A port P with P and P+1 free (start_supernodes.sh binds --port-base + i)."""
    return free_port(span=2)


@pytest.mark.extended  # the scripts' path of the TLS deployment the CI lane runs above
def test_scripts_secure_mode(tmp_path):
    certs = tmp_path / "certs"
    generate_certs(certs, nodes=3)
    keys = certs / "nodes"
    run_dir = tmp_path / "run"
    env = flower_env(tmp_path)
    owner = f"scripts-{env['LORDO_FED_HARNESS_ENV']}"
    env.update({OWNER_VAR: owner, "FLOWER_RUN_DIR": str(run_dir)})
    port = free_port()
    link = f"127.0.0.1:{port}"

    def script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPTS / name), *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=timeout)

    try:
        res = script("start_superlink.sh", "--port", str(port), "--tls", str(certs), "--node-auth", "--wait", "90")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"https://127.0.0.1:{port}" in res.stdout and "SuperNode authentication on" in res.stdout
        cmdline = (run_dir / "superlink.log").read_text().splitlines()[0]
        assert "--enable-supernode-auth" in cmdline and "--insecure" not in cmdline

        res = script("register_supernodes.sh", "--superlink", link, "--root-certificates", str(certs / "ca.crt"),
                     str(keys / "node-0.pub"), str(keys / "node-1.pub"))
        assert res.returncode == 0, res.stdout + res.stderr
        registered = {int(i) for i in re.findall(r"registered .*: node id (\d+)", res.stdout)}
        assert len(registered) == 2
        again = script("register_supernodes.sh", str(keys / "node-0.pub"))
        assert again.returncode == 0 and "already registered" in again.stdout, again.stdout + again.stderr

        res = script("start_supernodes.sh", "2", link, "--root-certificates", str(certs / "ca.crt"),
                     "--auth-keys", str(keys), "--num-partitions", "2", "--port-base", str(free_port_pair()),
                     "--wait", "90")
        assert res.returncode == 0, res.stdout + res.stderr
        assert {int(i) for i in re.findall(r"SuperNode ID: (\d+)", res.stdout)} == registered

        # node-2.pub was never registered: the script reports the refusal and fails.
        res = script("start_supernodes.sh", "1", link, "--root-certificates", str(certs / "ca.crt"),
                     "--auth-keys", str(keys), "--first-partition", "2", "--num-partitions", "3",
                     "--port-base", str(free_port()), "--wait", "90")
        assert res.returncode == 1, res.stdout + res.stderr
        assert "refused?" in res.stderr and "Failed to activate SuperNode" in res.stderr

        app = write_echo_app(tmp_path / "echo")
        res = script("submit_run.sh", "--superlink", link, "--root-certificates", str(certs / "ca.crt"),
                     "--app", str(app), "--timeout", "180", "--run-config",
                     f'num-server-rounds=1 min-nodes=2 result-path="{tmp_path / "echo.json"}"', timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        result = json.loads((tmp_path / "echo.json").read_text())
        assert set(result["rounds"][0]["node_ids"]) == registered
        assert result["rounds"][0]["partition_ids"] == [0, 1]
    finally:
        stop = script("stop_all.sh", "--dir", str(run_dir))
        leftovers = terminate(find_pids({OWNER_VAR: owner}), owner=owner, timeout=10)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert not leftovers and not find_pids({OWNER_VAR: owner})
