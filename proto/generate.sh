#!/usr/bin/env bash
# Regenerate the Python bindings of the lordo_fed wire format and data plane (run from anywhere;
# needs grpcio-tools in the active Python). Output: lordo_fed/v1/wire_pb2.py(i),
# lordo_fed/v1/{dataplane,node}_pb2.py(i) and lordo_fed/v1/{dataplane,node}_pb2_grpc.py.
# tests/integration/test_proto.py fails when the committed bindings differ from what this produces.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. proto/lordo_fed/v1/wire.proto
"$PYTHON" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/lordo_fed/v1/dataplane.proto
"$PYTHON" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/lordo_fed/v1/node.proto
echo "generated lordo_fed/v1/{wire,dataplane,node}_pb2.py(i), {dataplane,node}_pb2_grpc.py ($("$PYTHON" -m grpc_tools.protoc --version))"
