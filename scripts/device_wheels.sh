#!/usr/bin/env bash
# Wheels a lent GPU machine lacks, for benchmarks/gpu_check.py (run there with PYTHONPATH=<repo>).
#
# The GPU machines of this workplace have Python 3.12 with torch, numpy, grpcio, protobuf,
# safetensors, tokenizers, tensorboard, matplotlib, tqdm, rich, pyarrow and pytest, and no network
# (/work/.library/device/KINDS.md). What lordo-fed needs beyond that (Flower without Ray, Hydra,
# and the protobuf/grpcio versions its generated code was made with) travels as wheels in .whl/
# (ignored by git; about 25 MB, under the 64 MiB a call may carry):
#
#   scripts/device_wheels.sh                       # here, once: fills .whl/
#   # there, in each call that carries .whl:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
exclude="$(git rev-parse --git-path info/exclude)"; mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"

PLATFORMS=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
WHEELS=(
  flwr==1.42.0 protobuf==6.33.6 grpcio==1.85.3 grpcio-health-checking==1.81.1
  hydra-core==1.3.8 omegaconf==2.3.1
  alembic mako sqlalchemy greenlet fastapi==0.138.2 starlette==1.3.1 pydantic pydantic-core annotated-types typing-inspection
  uvicorn iterators prompt-toolkit wcwidth pycryptodome tomli tomli-w cryptography cffi pycparser
)
for wheel in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$wheel"
done
# Published as a source distribution only: build its (pure-Python) wheel here.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
du -sh .whl
