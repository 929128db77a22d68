"""The codec's peak memory, measured in a fresh process (lordo_fed/wire/encode.py, decode.py): the
direct paths need about the payload, the protobuf paths several times it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


MEMORY_PROBE = r"""
import gc, json, sys
import torch
from lordo_fed.wire.decode import decode_update, decode_update_reference
from lordo_fed.wire.encode import encode_update, encode_update_reference
from lordo_fed.wire.messages import WorkerUpdate

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def extra(fn, *args):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    out = fn(*args)
    peak = status("VmHWM") - base
    del out
    return peak

torch.set_num_threads(1)
n = int(sys.argv[1])
update = WorkerUpdate(0, 1, {"w": torch.randn(n // 4 - 64), "b": torch.randn(64)}, {}, 1, 1)
result = {"encode_new": extra(encode_update, update, "m"),
          "encode_old": extra(encode_update_reference, update, "m")}
data = bytes(encode_update(update, "m"))
del update
result["decode_new"] = extra(decode_update, data, "m")
result["decode_old"] = extra(decode_update_reference, data, "m")
print(json.dumps(result))
"""


def test_peak_memory_of_encoding_and_decoding(tmp_path):
    """Peak extra resident memory of one 64 MB fp32 update (fresh process, VmHWM reset before
    each step): about the payload (the output) for the direct paths, where the protobuf paths
    need ~4x (encoding) and ~2-3x (decoding); the latter are measured too, so the test would
    fail against them."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    n = 64 * 2 ** 20
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(n)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = {k: v / n for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert peak["encode_new"] < 1.25 and peak["decode_new"] < 1.25, peak
    assert peak["encode_old"] > 2.5 and peak["decode_old"] > 1.75, peak  # the measurement discriminates
