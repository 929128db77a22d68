"""The committed protobuf bindings are what proto/generate.sh produces from wire.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = "proto/lordo_fed/v1/wire.proto"
DATAPLANE_PROTO = "proto/lordo_fed/v1/dataplane.proto"
GENERATED = ("lordo_fed/v1/wire_pb2.py", "lordo_fed/v1/wire_pb2.pyi")
DATAPLANE_GENERATED = ("lordo_fed/v1/dataplane_pb2.py", "lordo_fed/v1/dataplane_pb2.pyi",
                       "lordo_fed/v1/dataplane_pb2_grpc.py")
NODE_PROTO = "proto/lordo_fed/v1/node.proto"
NODE_GENERATED = ("lordo_fed/v1/node_pb2.py", "lordo_fed/v1/node_pb2.pyi", "lordo_fed/v1/node_pb2_grpc.py")


@pytest.mark.parametrize("proto,generated,grpc_out", [(PROTO, GENERATED, False),
                                                      (DATAPLANE_PROTO, DATAPLANE_GENERATED, True),
                                                      (NODE_PROTO, NODE_GENERATED, True)])
def test_generated_code_is_current(tmp_path, proto, generated, grpc_out):
    pytest.importorskip("grpc_tools")
    # The same command as proto/generate.sh, with the output redirected to tmp_path.
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", *([f"--grpc_python_out={tmp_path}"] if grpc_out else []), proto]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rel in generated:
        fresh = (tmp_path / rel).read_bytes()
        committed = (ROOT / rel).read_bytes()
        assert fresh == committed, f"{rel} is stale: run proto/generate.sh"


def test_generate_script_runs_the_same_command():
    script = (ROOT / "proto" / "generate.sh").read_text()
    assert f"-m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. {PROTO}" in script
    for proto in (DATAPLANE_PROTO, NODE_PROTO):
        assert f"-m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. {proto}" in script


def test_package_matches_schema_version():
    from lordo_fed.wire import codec
    from lordo_fed.v1 import wire_pb2

    assert wire_pb2.DESCRIPTOR.package == codec.SCHEMA == "lordo_fed.v1"
    assert wire_pb2.DESCRIPTOR.name == PROTO.removeprefix("proto/")
    assert {m for m in wire_pb2.DESCRIPTOR.message_types_by_name} == {"Tensor", "GlobalState",
                                                                      "WorkerUpdate"}


def test_data_plane_service_shape():
    """The data plane streams the existing payloads: down a server stream, up a client stream."""
    from lordo_fed.v1 import dataplane_pb2

    service = dataplane_pb2.DESCRIPTOR.services_by_name["DataPlane"]
    assert dataplane_pb2.DESCRIPTOR.package == "lordo_fed.v1"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {"Download": (False, True), "Upload": (True, False)}
