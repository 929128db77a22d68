#!/usr/bin/env bash
# Regenerate the Python bindings of the lordo_fed wire format (run from anywhere; needs
# grpcio-tools in the active Python). Output: lordo_fed/v1/wire_pb2.py and wire_pb2.pyi.
# tests/test_proto.py fails when the committed bindings differ from what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. proto/lordo_fed/v1/wire.proto
echo "generated lordo_fed/v1/wire_pb2.py lordo_fed/v1/wire_pb2.pyi ($("$PYTHON" -m grpc_tools.protoc --version))"
