"""The ServerApp's peak memory in a real deployment at M = 2, 4, 8 nodes with a 125m-size payload.

benchmarks/server_memory.py measures the aggregation alone (library level). This runs the product
ServerApp (server/app.py: the LoRDO strategy, the gRPC data plane, checkpoints, evaluation) on a
real SuperLink with M SuperNodes on 127.0.0.1, and reads the `server_peak_rss_bytes` it records
in server.jsonl every round (VmHWM of the ServerApp process, read after the round's aggregation,
before its evaluation).

The nodes run a stand-in ClientApp (harness/apps/server_memory_bench/, next to the real ServerApp,
copied to a temporary directory with the product's run-config defaults): it receives the round's
state exactly as the product client does (`client.app.receive_state`: the data-plane ticket,
download, size and sha256 checked), decodes it, and answers with a reply of random tensors of the
shapes a LoRDO-Global worker sends that round
(`benchmarks.server_memory.random_update`: Δ of every parameter plus the due moments, or the
round-0 gradients), sent as the product client sends it (`client.app.send_reply`: upload, sha256
in the reply). No training: eight real 125m workers do not fit these 2 cores and 24 GB, and the
server's memory does not depend on what the numbers are. The server screens and aggregates them
like any reply (norms on arrival, token-weighted running sums, replies past
`data-plane-memory-mb` spilled to disk).

Settings: model preset 125m with the byte vocabulary (85 M parameters), rank 96, LoRDO-Global
with the round-0 gradient exchange, 2 rounds, evaluation on 1 batch of 1 x 64 tokens at the end,
default `data-plane-memory-mb` (1024). `--flower` adds the same deployment on Flower's own path
(payloads inside the messages) at the smallest M, for contrast.

    python benchmarks/server_memory_deployment.py            # 125m, M = 2, 4, 8 (~10 min)
    python benchmarks/server_memory_deployment.py --quick    # 16m, M = 2
Writes benchmarks/results/server_memory_deployment.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import human_bytes, make_parser, print_rows, result_header, write_json  # noqa: E402


def app_defaults() -> dict[str, Any]:
    """The product app's run-config keys and defaults (pyproject.toml)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"]["config"]


def run_config(preset: str, rank: int, nodes: int, out: Path, plane: str) -> dict[str, Any]:
    return {"model-preset": preset, "rank": rank, "num-server-rounds": 2, "local-steps": 32, "batch-size": 1,
            "seq-len": 64, "eval-every": 100, "eval-batches": 1, "min-clients": nodes, "threads": 1,
            "output-dir": str(out), "data-plane": plane, "data-plane-insecure": True, "round-timeout": 900.0}


def one_deployment(work: Path, app_dir: Path, preset: str, rank: int, nodes: int, plane: str) -> dict[str, Any]:
    from benchmarks.flower_shims import supernode_command
    from harness.deployment import Deployment
    from harness.flower import flower_env

    out = work / "out"
    started = time.perf_counter()
    with Deployment(work, num_nodes=nodes, env=flower_env(work / "cli"), supernode_command=supernode_command(0.1)) as dep:
        dep.run(app_dir, run_config(preset, rank, nodes, out, plane), timeout=1800, check=True,
                log_path=work / "run.log")
    records = [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r.get("round", 0) >= 1]
    if not rounds or any(r["clients_ok"] != nodes for r in rounds):
        raise RuntimeError(f"M={nodes} ({plane}): rounds without every client: "
                           f"{[(r['round'], r['clients_ok'], r.get('missing'), r.get('dropped')) for r in rounds]}")
    return {
        "M": nodes, "data_plane": plane, "seconds": round(time.perf_counter() - started, 1),
        "server_peak_rss_bytes": max(r["server_peak_rss_bytes"] for r in rounds),
        "per_round": [{k: r.get(k) for k in ("round", "server_peak_rss_bytes", "round_seconds", "aggregation_seconds",
                                             "bytes_received_per_client", "bytes_sent_per_client", "clients_ok")}
                      for r in rounds],
    }


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("server_memory_deployment", __doc__, "16m preset, M = 1 and 2")
    parser.add_argument("--flower", action="store_true", help="also Flower's own path at the smallest M")
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != str(ROOT)])  # Flower's processes import server/, client/, lordo_fed from here
    from benchmarks.common import BYTE_VOCAB, RANKS
    from harness.apps import copy_app
    from lordo_fed.model import ModelConfig, build_model, count_parameters

    preset, ms = ("16m", (2,)) if args.quick else ("125m", (2, 4, 8))  # quick: one deployment (~25 s in CI)
    import torch

    with torch.device("meta"):
        params = count_parameters(build_model(ModelConfig(preset=preset), BYTE_VOCAB))
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="srvmem_") as tmp:
        app_dir = copy_app("server_memory_bench", Path(tmp) / "app", config=app_defaults())
        plan = [(m, "grpc") for m in ms] + ([(ms[0], "flower")] if args.flower else [])
        for m, plane in plan:
            row = one_deployment(Path(tmp) / f"{plane}-{m}", app_dir, preset, RANKS[preset], m, plane)
            rows.append(row)
            print(f"[server_memory_deployment] M={m} {plane}: server peak {row['server_peak_rss_bytes'] / 1e6:.0f} MB "
                  f"({row['seconds']} s)", flush=True)
    reply = max(r["per_round"][-1]["bytes_received_per_client"] for r in rows)
    config = {"preset": preset, "vocab_size": BYTE_VOCAB, "num_params": params, "model_bytes": 4 * params,
              "rank": RANKS[preset], "M": list(ms), "reply_bytes": reply, "rounds": 2,
              "data_plane_memory_mb": app_defaults()["data-plane-memory-mb"],
              "notes": ["server_peak_rss_bytes: the ServerApp's VmHWM as server.jsonl records it after each "
                        "round's aggregation (before evaluation); the max over rounds 1-2 (round 0's gradient "
                        "exchange included)",
                        "stand-in clients: the product's receive_state/send_reply, random replies of a worker's "
                        "shapes, no training"]}
    result = result_header("server_memory_deployment", args.quick, config)
    result["seconds"] = time.perf_counter() - t0
    result["rows"] = rows
    grpc_rows = [r for r in rows if r["data_plane"] == "grpc"]
    result["summary"] = {"server_peak_mb": {f"{r['data_plane']} M={r['M']}": round(r["server_peak_rss_bytes"] / 1e6)
                                            for r in rows},
                         "growth_largest_vs_smallest_M_mb": round((grpc_rows[-1]["server_peak_rss_bytes"]
                                                                   - grpc_rows[0]["server_peak_rss_bytes"]) / 1e6),
                         "model_mb": 4 * params / 1e6, "reply_mb": reply / 1e6}
    out = write_json(result, args.out)
    print(f"model (fp32 θ): {human_bytes(4 * params)}; one reply: {human_bytes(reply)}")
    print_rows(f"{'path':7} {'M':>2} {'server peak':>12} {'x model':>8} {'seconds':>8}",
               (f"{r['data_plane']:7} {r['M']:>2} {r['server_peak_rss_bytes'] / 1e6:9.0f} MB "
                f"{r['server_peak_rss_bytes'] / (4 * params):8.2f} {r['seconds']:8.1f}" for r in rows))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
