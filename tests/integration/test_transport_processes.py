"""The data plane against real processes: a node killed mid-upload leaves nothing, and TLS with the
certificates scripts/generate_certs.py makes."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time

import pytest

from lordo_fed.transport import client
from lordo_fed.transport.server import DataPlaneServer
from lordo_fed.v1 import dataplane_pb2 as pb
from tests.unit.test_transport import MB, NODE, OTHER, ROOT, plane, publish  # noqa: F401 (plane: a fixture)


def test_a_node_killed_mid_upload_leaves_nothing(plane, caplog):
    caplog.set_level(logging.WARNING, "lordo_fed.dataplane")
    _, tickets = publish(plane, max_upload=8 * MB)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_UPLOADER, plane.address, tickets[NODE].upload_token],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        deadline = time.monotonic() + 10
        while plane._memory_used == 0 and time.monotonic() < deadline:  # the server took the header
            time.sleep(0.01)
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while not any("refused upload of node 11" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)
    # A killed peer reads as a stream that ends early (or, on some gRPC versions, a cancellation).
    assert any(re.search(r"refused upload of node 11 \(round 1\): (stream ended after 1048576 of the 4194304 "
                         r"declared bytes \(truncated\)|connection lost mid-upload)", r.getMessage())
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    deadline = time.monotonic() + 10
    while plane._memory_used and time.monotonic() < deadline:  # released as the handler unwinds
        time.sleep(0.01)
    assert plane._memory_used == 0
    assert plane.upload(NODE, 1) is None and not list(plane.spool_dir.glob("*"))


def test_tls_with_the_deployments_certificates(tmp_path):
    """The data plane serves TLS with the SuperLink's server.pem/server.key; a node verifies it
    with ca.crt, and cannot talk to it without the CA or in plaintext."""
    certs = tmp_path / "certs"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "generate_certs.py"), str(certs), "--nodes", "0"],
                   check=True, capture_output=True, timeout=60)
    tls = ((certs / "server.pem").read_bytes(), (certs / "server.key").read_bytes())
    with DataPlaneServer(tmp_path / "spool", tls=tls) as server:
        state, tickets = publish(server)
        assert tickets[NODE].tls
        assert client.download(tickets[NODE], NODE, certs / "ca.crt") == state
        client.upload(tickets[NODE], NODE, b"reply", certs / "ca.crt")
        assert bytes(server.upload(NODE, 1).buffer()) == b"reply"
        with pytest.raises(client.DataPlaneError, match="serves TLS but this node has no CA certificate"):
            client.download(tickets[NODE], NODE)
        plain = pb.Ticket()
        plain.CopyFrom(tickets[OTHER])
        plain.tls = False
        with pytest.raises(client.DataPlaneError, match="UNAVAILABLE"):
            client.download(plain, OTHER, timeout=5)


_KILLED_UPLOADER = """
import sys, time
import grpc
from lordo_fed.v1 import dataplane_pb2 as pb, dataplane_pb2_grpc as pb_grpc
address, token = sys.argv[1], sys.argv[2]
def chunks():
    yield pb.UploadChunk(token=token, node_id=11, size=4 << 20, data=b"x" * (1 << 20), checksum="xxh3")
    print("streaming", flush=True)
    time.sleep(60)  # killed here, mid-upload
with grpc.insecure_channel(address) as ch:
    pb_grpc.DataPlaneStub(ch).Upload(chunks())
"""
