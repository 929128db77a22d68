"""The committed protobuf bindings are what proto/generate.sh produces from wire.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO = "proto/lordo_fed/v1/wire.proto"
GENERATED = ("lordo_fed/v1/wire_pb2.py", "lordo_fed/v1/wire_pb2.pyi")


def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools")
    # The same command as proto/generate.sh, with the output redirected to tmp_path.
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", PROTO]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rel in GENERATED:
        fresh = (tmp_path / rel).read_bytes()
        committed = (ROOT / rel).read_bytes()
        assert fresh == committed, f"{rel} is stale: run proto/generate.sh"


def test_generate_script_runs_the_same_command():
    script = (ROOT / "proto" / "generate.sh").read_text()
    assert f"-m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. {PROTO}" in script


def test_package_matches_schema_version():
    from lordo_fed import codec
    from lordo_fed.v1 import wire_pb2

    assert wire_pb2.DESCRIPTOR.package == codec.SCHEMA == "lordo_fed.v1"
    assert wire_pb2.DESCRIPTOR.name == PROTO.removeprefix("proto/")
    assert {m for m in wire_pb2.DESCRIPTOR.message_types_by_name} == {"Tensor", "GlobalState",
                                                                      "WorkerUpdate"}
