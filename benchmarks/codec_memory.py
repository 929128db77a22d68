"""Peak memory and time of encoding and decoding one large `WorkerUpdate`: the protobuf-message
path the codec used to take (kept as `lordo_fed.wire.encode.encode_update_reference` /
`lordo_fed.wire.decode.decode_update_reference`) against the direct encoder and in-place decoder (`encode_update`,
`encode_update_into`, `decode_update`).

The update is a model-like set of fp32 tensors (eight 2-D matrices of 1024 columns holding
almost all the bytes, eight small vectors, one metric) of `--mb` MB, encoded with payload dtype
fp32 (a payload of the same size) and bf16 (half). For each path a fresh interpreter builds the
update and runs, for each payload dtype, one after the other:

- `encode`:        encode to a bytes-like object in memory;
- `encode_file`:   encode into a file opened for writing (old: encode, then write the bytes;
                   new: `encode_update_into(update, model_id, file)`, sequential writes);
- `decode`:        decode the payload held in memory as `bytes`;
- `decode_mmap`:   decode the payload from an mmap of its file (old: `memoryview(mm)`, the
                   protobuf path's only way to read it without `bytes(...)`; new: the mmap).

Peak extra memory of a step: VmHWM - VmRSS, the high-water mark reset to the current RSS just
before the step (Linux: `/proc/self/clear_refs`), so the update and the payload that exist
before the step do not count, and the output it builds does. glibc's malloc is told to serve
every allocation over 64 kB with mmap (MALLOC_MMAP_THRESHOLD_), so freed buffers go back to the
system and a later step cannot reuse pages already resident. `decode_mmap` counts the file's
pages mapped in (page cache, reclaimable), as VmHWM does: about one payload on both paths.
Seconds: the fastest of `--repeats` runs of the step; peak: the largest. One torch thread.

    python benchmarks/codec_memory.py           # 200 MB update, 3 repeats
    python benchmarks/codec_memory.py --quick   # 16 MB update, 1 repeat (~10 s)
Writes benchmarks/results/codec_memory.json (or --out). Linux only (VmHWM and its reset).
"""

from __future__ import annotations

import gc
import json
import mmap
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

try:
    from benchmarks.common import human_bytes, make_parser, print_rows, result_header, write_json
    from benchmarks.common import run_child as common_run_child
except ImportError:  # run as `python benchmarks/codec_memory.py` without the repo root on sys.path
    from common import human_bytes, make_parser, print_rows, result_header, write_json
    from common import run_child as common_run_child

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("old", "new")
PAYLOAD_DTYPES = ("fp32", "bf16")
STEPS = ("encode", "encode_file", "decode", "decode_mmap")
MODEL_ID = "codecmemory0000"


# ---------------------------------------------------------------------------------------------
# the child: one path, every payload dtype and step


def _status_bytes(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    """VmHWM := VmRSS for this process (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _measure(step: Callable[[], Any]) -> tuple[int, float]:
    """(peak extra bytes, seconds) of one call; what it returns is dropped after the reading."""
    gc.collect()
    _reset_peak()
    base = _status_bytes("VmRSS")
    t0 = time.perf_counter()
    out = step()
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM") - base
    del out
    gc.collect()
    return peak, seconds


def make_update(total_bytes: int):
    """Eight [rows, 1024] fp32 matrices holding ~all of `total_bytes`, eight 1024-vectors, one metric."""
    import torch

    from lordo_fed.wire.messages import WorkerUpdate

    g = torch.Generator().manual_seed(0)
    rows = max(1, (total_bytes - 8 * 4096) // (8 * 4096))
    delta = {f"blocks.{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(8)}
    delta.update({f"blocks.{i}.bias": torch.randn(1024, generator=g) for i in range(8)})
    return WorkerUpdate(worker_id=0, round=1, delta=delta, moments={}, tokens=4096, opt_step=32,
                        metrics={"train_loss": 2.5})


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    return {pd: child_steps(spec, pd) for pd in spec["payload_dtypes"]}


def child_steps(spec: dict, pd: str) -> dict:
    import torch

    from lordo_fed.wire.decode import decode_update, decode_update_reference
    from lordo_fed.wire.encode import encode_update, encode_update_into, encode_update_reference

    old = spec["path"] == "old"
    update = make_update(spec["bytes"])
    spool = Path(spec["tmp"]) / f"{spec['path']}_{pd}.bin"
    encode = encode_update_reference if old else encode_update
    decode = decode_update_reference if old else decode_update

    def encode_file() -> int:
        with open(spool, "wb") as f:
            if old:
                return f.write(encode(update, MODEL_ID, pd))
            return encode_update_into(update, MODEL_ID, f, pd)

    def decode_mmap():
        with open(spool, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if old:
                view = memoryview(mm)
                try:
                    return decode(view, MODEL_ID)
                finally:
                    view.release()
            return decode(mm, MODEL_ID)

    rows: dict[str, dict] = {}

    def run(name: str, step: Callable[[], Any]) -> None:
        samples = [_measure(step) for _ in range(spec["repeats"])]
        rows[name] = {"peak_extra_bytes": max(p for p, _ in samples), "seconds": min(s for _, s in samples),
                      "samples": [{"peak_extra_bytes": p, "seconds": s} for p, s in samples]}

    run("encode", lambda: encode(update, MODEL_ID, pd))
    run("encode_file", encode_file)
    data = bytes(encode_update(update, MODEL_ID, pd))
    if spool.read_bytes() != data:
        raise AssertionError(f"{spec['path']}/{pd}: the spooled file differs from the encoded payload")
    reference = decode(data, MODEL_ID)
    for name, t in update.delta.items():
        want = t if pd == "fp32" else t.to(torch.bfloat16).float()
        if not torch.equal(reference.delta[name], want):
            raise AssertionError(f"{spec['path']}/{pd}: {name} does not decode to what was sent")
    update = reference = None  # the tensors released before the decode steps (the closures above ran already)
    run("decode", lambda: decode(data, MODEL_ID))
    run("decode_mmap", decode_mmap)
    spool.unlink()
    return {"payload_bytes": len(data), "steps": rows}


# ---------------------------------------------------------------------------------------------
# the parent


def run_child(spec: dict) -> dict:
    return common_run_child(__file__, spec, f"child {spec['path']}", timeout=1200,
                            env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = make_parser("codec_memory", __doc__, "a 16 MB update, one repeat")
    parser.add_argument("--mb", type=float, default=None, help="update size in MB of fp32 tensors "
                        "(default 200, 16 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per step (default 3, 1 with --quick)")
    args = parser.parse_args()
    try:
        _reset_peak()
    except OSError as exc:
        sys.exit(f"codec_memory needs Linux's /proc/self/clear_refs to reset the peak RSS ({exc})")
    mb = args.mb if args.mb is not None else (16.0 if args.quick else 200.0)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    total = int(mb * 1e6)
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in PATHS:
            spec = {"path": path, "payload_dtypes": PAYLOAD_DTYPES, "bytes": total, "repeats": repeats, "tmp": tmp}
            for pd, out in run_child(spec).items():
                for step in STEPS:
                    r = out["steps"][step]
                    rows.append({"step": step, "payload_dtype": pd, "path": path, "payload_bytes": out["payload_bytes"],
                                 "peak_extra_bytes": r["peak_extra_bytes"],
                                 "peak_over_payload": r["peak_extra_bytes"] / out["payload_bytes"],
                                 "seconds": r["seconds"], "samples": r["samples"]})
    by = {(r["step"], r["payload_dtype"], r["path"]): r for r in rows}
    summary = [{"step": step, "payload_dtype": pd, "payload_bytes": by[(step, pd, "new")]["payload_bytes"],
                "old_peak_extra_bytes": by[(step, pd, "old")]["peak_extra_bytes"],
                "new_peak_extra_bytes": by[(step, pd, "new")]["peak_extra_bytes"],
                "old_seconds": by[(step, pd, "old")]["seconds"], "new_seconds": by[(step, pd, "new")]["seconds"]}
               for pd in PAYLOAD_DTYPES for step in STEPS]
    config = {"update_bytes_fp32": total, "tensors": "8 x [rows, 1024] + 8 x [1024] fp32, one metric",
              "repeats": repeats, "torch_threads": 1, "malloc_mmap_threshold": 65536,
              "notes": ["peak_extra_bytes: VmHWM - VmRSS with the high-water mark reset just before the step "
                        "(/proc/self/clear_refs); the update and the payload that exist before it do not count",
                        "decode of bf16 builds fp32 tensors: twice the payload is the output itself",
                        "decode_mmap counts the mapped file pages (page cache) too: about one payload",
                        "seconds: fastest of the repeats; peak: largest"]}
    result = result_header("codec_memory", args.quick, config)
    result["seconds"] = time.perf_counter() - t0
    result["rows"] = rows
    result["summary"] = summary
    out_path = write_json(result, args.out)
    print_rows(f"{'step':12} {'payload':>14} {'old peak':>10} {'new peak':>10} {'old/new':>7} {'old s':>7} {'new s':>7}",
               (f"{s['step']:12} {s['payload_dtype']:>4} {human_bytes(s['payload_bytes']):>9} "
                f"{human_bytes(s['old_peak_extra_bytes']):>10} {human_bytes(s['new_peak_extra_bytes']):>10} "
                f"{s['old_peak_extra_bytes'] / max(s['new_peak_extra_bytes'], 1):7.2f} "
                f"{s['old_seconds']:7.3f} {s['new_seconds']:7.3f}" for s in summary))
    print(f"written {out_path}")


if __name__ == "__main__":
    main()
