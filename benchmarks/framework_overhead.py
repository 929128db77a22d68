"""Framework overhead: where a Flower round's time goes, against the reference trainer doing the same work.

The same LoRDO-Global work (small preset, 2 clients, K local steps of batch B x T per round, one
thread per client) runs three ways:

- reference: `lordo_fed.trainer` in one process, the 2 workers in turn (no Flower, no
  serialization). The ideal parallel round is one worker's training plus the aggregation:
  (round - aggregation) / M + aggregation.
- reference-concurrent: two reference trainers with one worker each, started together: one
  worker's K steps when two train at once on this machine (the contention every deployment
  here has: 2 cores for 2 clients, the server, the SuperLink and SuperNodes).
- simulation: `flwr run . local` (Flower's simulation engine, Ray, 2 virtual clients with 1 CPU each).
- deployment: a real SuperLink and 2 SuperNodes on 127.0.0.1 (harness/deployment.Deployment).
- node-workers: the same deployment with a long-lived node worker beside each SuperNode
  (lordo_fed.node: the model and state stay in memory; payloads on the gRPC data plane).

Per Flower round, from server.jsonl (the app measures each part; medians of rounds 2..N):

| part | what | where it is measured |
|---|---|---|
| client compute | the K local steps | `client_train_seconds` (slowest client) |
| client other | worker state load/save, data shard, runtime lookup | `client_seconds - client_train_seconds - client_codec_seconds` |
| serialization | server encode + client decode/encode + server decode | `server_encode_seconds + client_codec_seconds + server_decode_seconds` |
| aggregation | Δ̄, outer step, projection refit (SVD), moment rotation | `aggregation_seconds - server_decode_seconds` |
| transport + Flower | push, scheduling, ClientApp start, pull | `round_seconds - server_encode - client_seconds - aggregation_seconds` |
| eval + checkpoint | the server's validation and checkpoint between rounds | `cycle - round_seconds` |

    python benchmarks/framework_overhead.py           # 5 rounds each of reference, simulation, deployment (~2.5 min)
    python benchmarks/framework_overhead.py --quick   # tiny preset, 2 rounds, reference + simulation (~1 min)
    python benchmarks/framework_overhead.py --preset 16m --modes reference,deployment,node-workers \
        --out benchmarks/results/framework_overhead_16m.json   # the issue's 16m round against the ideal
    (add reference-concurrent to the modes for the contended ideal)
Writes benchmarks/results/framework_overhead.json and .png.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    make_parser, median_rounds_2_to_n, new_figure, png_path, result_header, write_json)
from harness.processes import checkout_env  # noqa: E402

PARTS = ("client compute", "client other", "serialization", "aggregation", "transport + Flower", "eval + checkpoint")


def work(quick: bool, rounds: int, preset: str | None = None) -> dict[str, Any]:
    """The work of one run, as Flower run-config values (the reference trainer gets the same)."""
    return {"variant": "lordo_global", "model-preset": preset or ("tiny" if quick else "small"), "num-server-rounds": rounds,
            "local-steps": 4 if quick else 16, "batch-size": 4 if quick else 16, "seq-len": 32 if quick else 64,
            "rank": 8 if quick else 16, "threads": 1, "eval-every": 1, "eval-batches": 2, "min-clients": 2,
            "warmup-steps": 2, "seed": 0}


def trainer_overrides(cfg: dict[str, Any], out_dir: Path, workers: int = 2) -> list[str]:
    """The reference trainer's Hydra overrides for the same work."""
    return [f"methods=[{cfg['variant']}]", f"workers={workers}", f"model.preset={cfg['model-preset']}",
            f"total_steps={cfg['local-steps'] * cfg['num-server-rounds']}", f"rounds.local_steps={cfg['local-steps']}",
            f"data.batch_size={cfg['batch-size']}", f"data.seq_len={cfg['seq-len']}", f"inner.rank={cfg['rank']}",
            f"inner.warmup_steps={cfg['warmup-steps']}", "threads=1", "eval_every=1", "eval_batches=2",
            f"seed={cfg['seed']}", f"out_dir={out_dir}", "progress=false"]


def run_reference(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run the reference trainer in a subprocess (its own torch threads) and split its rounds."""
    import subprocess

    out = tmp / "reference"
    proc = subprocess.run([sys.executable, "-m", "lordo_fed.trainer.cli", *trainer_overrides(cfg, out)],
                          env=checkout_env(OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"reference trainer failed ({proc.returncode}): {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / f"{cfg['variant']}.jsonl").read_text().splitlines()]
    rows = []
    for rec in records:
        if rec.get("round", 0) < 1 or "round_seconds" not in rec:
            continue
        agg = rec["aggregation_seconds"]
        per_worker = (rec["round_seconds"] - agg) / 2
        rows.append({"round": rec["round"], "round_seconds": rec["round_seconds"], "client compute": per_worker,
                     "aggregation": agg, "ideal_parallel_round_seconds": per_worker + agg})
    return {"rounds": rows, "median_rounds_2_to_n": median_rounds_2_to_n(rows)}


def run_reference_concurrent(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Two reference trainers with one worker each, started together (one thread each): what
    two clients' K local steps cost when they run at the same time on this machine, as they do
    in a deployment here (the ideal parallel round assumes each worker has the machine to itself)."""
    import subprocess

    env = checkout_env(OMP_NUM_THREADS="1")
    outs = [tmp / f"reference-concurrent-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "lordo_fed.trainer.cli", *trainer_overrides(cfg, out, workers=1)],
                              env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for out in outs]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"reference trainer failed ({proc.returncode}): {err[-2000:]}")
    per_proc = []
    for out in outs:
        records = [json.loads(line) for line in (out / f"{cfg['variant']}.jsonl").read_text().splitlines()]
        per_proc.append({rec["round"]: rec["round_seconds"] - rec["aggregation_seconds"] for rec in records
                         if rec.get("round", 0) >= 1 and "round_seconds" in rec})
    rows = [{"round": r, "client compute": max(p[r] for p in per_proc)} for r in sorted(per_proc[0])
            if all(r in p for p in per_proc)]
    return {"rounds": rows, "median_rounds_2_to_n": median_rounds_2_to_n(rows)}


def split_flower(out_dir: Path) -> dict[str, Any]:
    """Per-round parts of a Flower run from its server.jsonl."""
    records = [json.loads(line) for line in (out_dir / "server.jsonl").read_text().splitlines()]
    rows, prev = [], None
    for rec in records:
        if rec.get("round", 0) < 1:
            prev = rec.get("elapsed_seconds", prev)
            continue
        client, train, codec = rec["client_seconds"], rec["client_train_seconds"], rec["client_codec_seconds"]
        enc, dec, agg = rec["server_encode_seconds"], rec["server_decode_seconds"], rec["aggregation_seconds"]
        row = {
            "round": rec["round"], "round_seconds": rec["round_seconds"],
            "client compute": train, "client other": client - train - codec,
            "serialization": enc + codec + dec, "aggregation": agg - dec,
            "transport + Flower": rec["round_seconds"] - enc - client - agg,
            "bytes_down": rec["bytes_sent_per_client"], "bytes_up": rec["bytes_received_per_client"],
        }
        if prev is not None:
            row["cycle_seconds"] = rec["elapsed_seconds"] - prev
            row["eval + checkpoint"] = row["cycle_seconds"] - rec["round_seconds"]
        prev = rec["elapsed_seconds"]
        rows.append(row)
    return {"rounds": rows, "median_rounds_2_to_n": median_rounds_2_to_n(rows)}


def run_simulation_mode(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from harness.flower import flower_env, run_simulation

    out = tmp / "sim-out"
    run_simulation(ROOT, flower_env(tmp / "sim"), num_supernodes=2, run_config={**cfg, "output-dir": str(out)},
                   timeout=900, check=True, log_path=tmp / "sim.log")
    return split_flower(out)


def run_deployment_mode(cfg: dict[str, Any], tmp: Path, node_workers: bool = False) -> dict[str, Any]:
    from harness.deployment import Deployment
    from harness.node_workers import start_node_worker
    from harness.processes import stop_process

    name = "nw" if node_workers else "dep"
    out = tmp / f"{name}-out"
    workers, kwargs = [], {}
    if node_workers:
        socks = [tmp / f"{name}{i}.sock" for i in range(2)]
        workers = [start_node_worker(sock, tmp / f"node-worker-{i}.log") for i, sock in enumerate(socks)]
        kwargs["node_configs"] = [{"node-worker": f"unix://{sock}"} for sock in socks]
    try:
        with Deployment(tmp / name, num_nodes=2, **kwargs) as dep:
            dep.run(ROOT, {**cfg, "output-dir": str(out), "data-plane-insecure": True}, timeout=1800, check=True,
                    log_path=tmp / f"{name}.log")
    finally:
        for proc in workers:
            stop_process(proc)
    return split_flower(out)


def plot(result: dict, path: Path) -> None:
    fig = new_figure(9, 5)
    ax = fig.add_subplot(1, 1, 1)
    modes = [m for m in ("reference", "simulation", "deployment", "node-workers") if m in result["modes"]]
    bottoms = [0.0] * len(modes)
    for part in PARTS:
        ys = [result["modes"][m]["median_rounds_2_to_n"].get(part, 0.0) for m in modes]
        ax.bar(modes, ys, bottom=bottoms, label=part)
        bottoms = [b + y for b, y in zip(bottoms, ys)]
    for i, m in enumerate(modes):
        ax.text(i, bottoms[i], f"{bottoms[i]:.2f} s", ha="center", va="bottom")
    ax.set(ylabel="seconds per round (median of rounds 2..N)",
           title="Where a round goes (reference: one worker's share of the training + aggregation)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = make_parser("framework_overhead", __doc__, "tiny preset, 2 rounds, reference + simulation only")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 5; --quick 2)")
    parser.add_argument("--modes", default=None,
                        help="comma-separated subset of reference,simulation,deployment,node-workers")
    parser.add_argument("--preset", default=None, help="model preset (default small; --quick tiny)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    modes = (args.modes or ("reference,simulation" if args.quick else "reference,simulation,deployment")).split(",")
    cfg = work(args.quick, rounds, args.preset)
    tmp = Path(tempfile.mkdtemp(prefix="framework-overhead-"))
    started = time.perf_counter()
    load_before = os.getloadavg()
    runners = {"reference": run_reference, "reference-concurrent": run_reference_concurrent,
               "simulation": run_simulation_mode, "deployment": run_deployment_mode,
               "node-workers": lambda cfg, tmp: run_deployment_mode(cfg, tmp, node_workers=True)}
    results: dict[str, Any] = {}
    try:
        for mode in modes:
            t0 = time.perf_counter()
            results[mode] = runners[mode](cfg, tmp)
            results[mode]["wall_seconds"] = time.perf_counter() - t0
            print(f"[framework_overhead] {mode}: {json.dumps(results[mode]['median_rounds_2_to_n'])}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref = results.get("reference", {}).get("median_rounds_2_to_n", {})
    for mode in ("simulation", "deployment", "node-workers"):
        if mode in results and ref:
            med = results[mode]["median_rounds_2_to_n"]
            med["ratio_to_ideal_parallel_round"] = med["round_seconds"] / ref["ideal_parallel_round_seconds"]
            med["overhead_vs_reference_seconds"] = med["round_seconds"] - ref["ideal_parallel_round_seconds"]
            both = results.get("reference-concurrent", {}).get("median_rounds_2_to_n", {})
            if both:  # the ideal round with the two workers' steps slowed as they are when run together here
                contended = both["client compute"] + ref["aggregation"]
                med["contended_ideal_round_seconds"] = contended
                med["ratio_to_contended_ideal_round"] = med["round_seconds"] / contended
    if ref and "reference-concurrent" in results:
        both = results["reference-concurrent"]["median_rounds_2_to_n"]
        both["slowdown_of_two_at_once"] = both["client compute"] / ref["client compute"]
    header = result_header("framework_overhead", args.quick, {
        "run_config": cfg, "clients": 2, "rounds": rounds, "modes": modes,
        "reference": "lordo-train " + " ".join(trainer_overrides(cfg, Path("<tmp>"))),
        "summary": "median over rounds 2..N",
    })
    result = {**header, "seconds": time.perf_counter() - started, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "modes": results}
    out = write_json(result, args.out)
    plot(result, png_path(out))
    print(f"wrote {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
