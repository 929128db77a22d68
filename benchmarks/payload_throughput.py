"""Effective payload throughput of a Flower deployment on 127.0.0.1: a ~200 MB fp32 pseudo-gradient
down (server -> client) and back up (client -> server), encoded exactly as the app does.

A dedicated minimal Flower app (harness/apps/payload_bench/, copied to a temporary directory) runs
on a real SuperLink and one SuperNode (harness/deployment.Deployment). Each exchange: the
ServerApp encodes a random fp32 tensor as a `lordo_fed.v1.GlobalState`
(lordo_fed.wire.encode.encode_global_state), wraps it with lordo_fed.app.records.payload_record,
pushes it (grid.push_messages) and polls for the reply every 20 ms; the ClientApp unwraps and
decodes it, encodes a random fp32 Δ of the same size as a `WorkerUpdate` (encode_update +
payload_record) and replies; the server unwraps and decodes that.
Random data, a new draw per exchange: Flower sends identical 5 MB chunks once.

Timestamps on both sides (same machine, time.time()) give, per direction:
- encode / decode seconds (codec + record wrapping/unwrapping), measured where they run;
- `down_seconds`: the server's push start -> the ClientApp handler starts (server -> SuperLink ->
  SuperNode -> ClientApp process, plus the SuperNode's poll wait and the ClientApp process start);
  `up_seconds`: the handler returns -> the server holds the reply (ClientApp -> SuperNode ->
  SuperLink -> server, plus the SuperNode's 0.5 s reply poll);
- `push_seconds` (grid.push_messages: server -> SuperLink) and `pull_seconds` (the pull_messages
  call that returned the reply: SuperLink -> server) alone.
Each big exchange is paired with a tiny one (same path, ~0 bytes): the effective throughput is
size / (big - tiny), i.e. the time the bytes add, with fixed latencies (polls, process start)
subtracted; end-to-end MB/s (size / big) are reported too. The SuperNode's hard-coded 3 s poll
puts up to 3 s of random wait on every downlink; a second run with that wait capped at 0.1 s
(benchmarks/flower_shims.py: same data path, not stock Flower; skip with --no-shim) removes that
noise. The ServerApp retries not-yet-uploaded reply chunks after 50 ms as the app does
(lordo_fed.app.records.shorten_pull_backoff).

    python benchmarks/payload_throughput.py            # 200 MB, 2 repeats, stock + poll-shim SuperNode
    python benchmarks/payload_throughput.py --quick    # 20 MB, 1 repeat (< 60 s)
Writes benchmarks/results/payload_throughput.json (or --out). Peak memory: ~3 GB at 200 MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info  # noqa: E402
from harness.apps import copy_app  # noqa: E402
from harness.deployment import Deployment  # noqa: E402
from harness.flower import flower_env  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TINY_MB = 0.001


def local_codec(mb: float, repeats: int) -> dict[str, float]:
    """Encode/decode alone, in this process (no Flower transport): seconds, median of `repeats`."""
    import numpy as np
    import torch

    from lordo_fed.wire.decode import decode_global_state
    from lordo_fed.wire.encode import encode_global_state
    from lordo_fed.app.records import payload_bytes, payload_record
    from lordo_fed.wire.messages import GlobalState

    n = int(mb * 1e6 / 4)
    theta = torch.from_numpy(np.random.default_rng(0).standard_normal(n, dtype=np.float32))
    times: dict[str, list[float]] = {"encode_s": [], "record_s": [], "unwrap_s": [], "decode_s": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = encode_global_state(GlobalState(round=1, params={"w": theta}), "payloadbench", "fp32")
        t1 = time.perf_counter()
        record = payload_record(data)
        t2 = time.perf_counter()
        del data
        back = payload_bytes(record)
        t3 = time.perf_counter()
        state = decode_global_state(back, expected_model_id="payloadbench")
        t4 = time.perf_counter()
        assert torch.equal(state.params["w"], theta)
        del record, back, state
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k].append(v)
    out = {k: round(statistics.median(v), 4) for k, v in times.items()}
    total = sum(out.values())
    out["mb_per_s_encode_and_wrap"] = round(mb / (out["encode_s"] + out["record_s"]), 1)
    out["mb_per_s_unwrap_and_decode"] = round(mb / (out["unwrap_s"] + out["decode_s"]), 1)
    out["total_s"] = round(total, 4)
    return out


def summarize(rows: list[dict], size_mb: float) -> dict[str, Any]:
    big = [r for r in rows if r["size_mb"] == size_mb]
    tiny = [r for r in rows if r["size_mb"] == TINY_MB]

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    def direction(keys_big: list[str], keys_codec: list[str]) -> dict[str, float]:
        transport_big = sum(med(big, k) for k in keys_big)
        transport_tiny = sum(med(tiny, k) for k in keys_big) if tiny else 0.0
        codec = sum(med(big, k) for k in keys_codec)
        added = transport_big - transport_tiny
        return {
            "transport_s": round(transport_big, 3), "transport_tiny_payload_s": round(transport_tiny, 3),
            "transport_added_by_payload_s": round(added, 3), "encode_decode_s": round(codec, 3),
            "end_to_end_s": round(transport_big + codec, 3),
            "effective_mb_per_s": round(size_mb / (added + codec), 1) if added + codec > 0 else None,
            "end_to_end_mb_per_s": round(size_mb / (transport_big + codec), 1),
        }

    down = direction(["down_s"], ["server_encode_s", "server_record_s", "client_unwrap_s", "client_decode_s"])
    up = direction(["up_s"], ["client_encode_s", "client_record_s", "server_unwrap_s", "server_decode_s"])
    down["push_server_to_superlink_s"] = round(med(big, "push_s"), 3)
    down["push_mb_per_s"] = round(size_mb / med(big, "push_s"), 1)
    up["pull_superlink_to_server_s"] = round(med(big, "pull_s"), 3)
    up["pull_mb_per_s"] = round(size_mb / med(big, "pull_s"), 1)
    return {
        "size_mb": size_mb, "payload_bytes_down": big[0]["down_bytes"], "payload_bytes_up": big[0]["up_bytes"],
        "repeats": len(big), "downlink": down, "uplink": up,
        "peak_rss_mb": {"server": round(max(r["server_peak_rss_mb"] for r in big)),
                        "client": round(max(r["client_peak_rss_mb"] for r in big))},
    }


def run(work: Path, app_dir: Path, size_mb: float, repeats: int, shim: bool) -> dict[str, Any]:
    env = flower_env(work / "cli")
    kwargs: dict[str, Any] = {}
    settings = "stock flower-supernode (3 s poll of the SuperLink), FLWR_SUPEREXEC_TASK_POLL_INTERVAL=" + \
        env.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "1 (default)")
    if shim:
        from benchmarks.flower_shims import supernode_command

        kwargs["supernode_command"] = supernode_command(0.1)
        settings = "SuperNode waits capped at 0.1 s (benchmarks/flower_shims.py; same data path), " + \
            settings.split(", ", 1)[1]
    sizes = [TINY_MB, size_mb] * repeats
    result_path = work / "rows.jsonl"
    with Deployment(work, num_nodes=1, env=env, **kwargs) as dep:
        dep.run(app_dir, {"sizes-mb": ",".join(str(s) for s in sizes), "result-path": str(result_path)},
                timeout=120 + 60 * len(sizes) * max(1.0, size_mb / 100), check=True, log_path=work / "run.log")
    rows = [json.loads(line) for line in result_path.read_text().splitlines()]
    return {"settings": settings, **summarize(rows, size_mb),
            "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 MB, 1 repeat")
    parser.add_argument("--size-mb", type=float, default=None, help="payload size in MB (default 200; quick 20)")
    parser.add_argument("--repeats", type=int, default=None, help="big exchanges (default 2; quick 1)")
    parser.add_argument("--no-shim", action="store_true", help="skip the run with the poll-capped SuperNode")
    parser.add_argument("--out", type=Path, default=RESULTS / "payload_throughput.json")
    args = parser.parse_args(argv)
    size_mb = args.size_mb or (20.0 if args.quick else 200.0)
    repeats = args.repeats or (1 if args.quick else 2)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "payload_throughput", "machine": machine_info(),
        "config": {"quick": args.quick, "size_mb": size_mb, "repeats": repeats, "tiny_mb": TINY_MB, "nodes": 1,
                   "encoding": "lordo_fed.wire.codec (protobuf lordo_fed.v1) + lordo_fed.app.records.payload_record",
                   "data": "random fp32 (np.random standard normal), a new draw per exchange"},
        "local_codec": local_codec(size_mb, 1 if args.quick else 3),
        "deployment": {},
    }
    print(f"[payload_throughput] local codec: {result['local_codec']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="payload-") as tmp:
        app_dir = copy_app("payload_bench", Path(tmp) / "app")
        variants = [("stock-supernode", False)] + ([] if args.no_shim else [("poll-capped-supernode", True)])
        for name, shim in variants:
            print(f"[payload_throughput] {name} ...", flush=True)
            entry = run(Path(tmp) / name, app_dir, size_mb, repeats, shim)
            result["deployment"][name] = entry
            print(f"[payload_throughput] {name}: down {entry['downlink']} up {entry['uplink']}", flush=True)
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[payload_throughput] wrote {args.out} ({result['total_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
