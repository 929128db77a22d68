"""Per-round overhead of a Flower round on 127.0.0.1 with a tiny payload: stock Flower against this app.

Configurations, each on a real SuperLink + 2 SuperNodes (harness/deployment.Deployment) and in
the simulation engine (run_simulation, 2 virtual nodes with 1 CPU each):

- stock: a minimal stock Flower app (harness/apps/stock_bench/: a torch ClientApp with @app.train
  and @app.evaluate, a ServerApp running `FedAvg.start()`: a train phase and an evaluate phase per
  round, each through `grid.send_and_receive`, which polls every 3 s), under Flower's defaults.
  The "before" of the issue.
- app-default-poll: this app (server/, client/) with the tiny model preset, local-steps=1 (a
  ~0.75 MB payload each way), under Flower's defaults (each SuperExec polls for work every 1 s).
- app: the same with FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1, which harness/flower.flower_env
  and scripts/_common.sh now set: the "after" with stock Flower components.
- app-node-workers: stock Flower processes; each node's rounds run in a long-lived node worker
  (`python -m lordo_fed.node`, lordo_fed/node/) that the ClientApp (which then does not import
  torch) hands them to, payloads on the gRPC data plane. Breakdown per round: Flower (push,
  SuperNode polls, ClientApp process start, reply) = round - client handler; the handler =
  data plane (download + upload) + training + the rest (codec, state).
- EXPERIMENTS, not stock Flower (full mode; benchmarks/flower_shims.py):
  app-fastpoll: SuperNodes whose hard-coded waits (3 s between polls of the SuperLink, 0.5 s
  between checks for the ClientApp's reply) are capped at 0.1 s;
  app-persistent: `flower-supernode --isolation process` served by one long-lived ClientApp
  runner per node instead of a new `flwr-clientapp` process per message;
  app-persistent-fastpoll: both.
- startup (full mode): what one fresh ClientApp process spends on its own: interpreter start,
  Flower's imports, torch, our client module, an uncached Hydra compose, and the torch._dynamo
  import that the handler used to trigger (client/app.py now avoids it and caches the config).

Per round: wall time, client compute (max over clients of the ClientApp handler's own time; for
the app also the local training alone: client_train_seconds), overhead = round - client compute.
Summaries are medians over rounds 2..N (round 1 includes warm-up). For the app `round_seconds` is
what server.jsonl records (the round's push to the last reply) and `cycle_seconds` the time between
the ends of consecutive rounds (adds the server's evaluation, checkpoint and encoding: the real
period); for the stock app the round covers both phases and the aggregation between them.

    python benchmarks/round_overhead.py            # 6 rounds per configuration, all of the above (~7 min)
    python benchmarks/round_overhead.py --quick    # ~55 s: stock (1 round) and app (2), one deployment
    python benchmarks/round_overhead.py --app-dir DIR --label before --only deployment:before-default-poll
                                                   # another copy of the app (e.g. `git archive` of a commit)
Writes benchmarks/results/round_overhead.json (or --out). The machine's load average is recorded:
on a shared 2-core machine other processes move these numbers by a second or more.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, median_rounds_2_to_n  # noqa: E402
from harness.apps import copy_app  # noqa: E402
from harness.deployment import Deployment  # noqa: E402
from harness.flower import flower_env, run_simulation  # noqa: E402
from harness.processes import checkout_env  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
POLL_VAR = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"

# ------------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------------


_STARTUP_SNIPPET = """
import json, time
t0 = time.perf_counter()
import flwr.supernode.cli  # what `flwr-clientapp` imports before it loads the ClientApp
t1 = time.perf_counter()
import torch
t2 = time.perf_counter()
import client.app as ca
import lordo_fed.node.runtime
t3 = time.perf_counter()
from lordo_fed.app.config import PRESET_DIR, flat_defaults, load_app_config
load_app_config({**flat_defaults(), "preset": "quickstart"}, PRESET_DIR)
t4 = time.perf_counter()
import torch._dynamo
t5 = time.perf_counter()
print(json.dumps({"import_flwr_clientapp_s": t1 - t0, "import_torch_s": t2 - t1, "import_client_app_s": t3 - t2,
                  "hydra_compose_uncached_s": t4 - t3, "import_torch_dynamo_s": t5 - t4}))
"""


def startup_breakdown(repeats: int = 3) -> dict[str, Any]:
    """What a fresh ClientApp process spends before and around our handler (one process alone,
    median of `repeats`): interpreter start, Flower's own imports, torch, our client module,
    an uncached Hydra compose, and the torch._dynamo import the handler now avoids."""
    rows = []
    env = checkout_env()
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, env=env, timeout=60)
        python_start = time.perf_counter() - t
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _STARTUP_SNIPPET], capture_output=True, text=True, cwd=ROOT,
                             env=env, timeout=300, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row.update(python_start_s=python_start, process_wall_s=time.perf_counter() - t)
        rows.append(row)
    summary = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    summary["note"] = ("one process alone; in a deployment round both nodes start such a process at once "
                       "on this 2-core machine, and each then takes longer")
    return summary


def app_run_config(out_dir: Path, rounds: int) -> dict[str, Any]:
    """The app with the tiny model preset, one local step per round: a tiny round."""
    return {"preset": "quickstart", "num-server-rounds": rounds, "local-steps": 1, "batch-size": 4,
            "seq-len": 32, "eval-batches": 2, "threads": 1, "min-clients": 2, "output-dir": str(out_dir),
            "data-plane-insecure": True}  # a deployment on 127.0.0.1: plaintext gRPC data plane


def summarize_app(out_dir: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (out_dir / "server.jsonl").read_text().splitlines()]
    rows = []
    prev_wall = None
    for rec in records:
        if rec.get("round", 0) < 1:
            prev_wall = rec.get("elapsed_seconds", prev_wall)
            continue
        row = {
            "round": rec["round"], "clients_ok": rec["clients_ok"],
            "round_seconds": rec["round_seconds"], "client_seconds": rec["client_seconds"],
            "overhead_seconds": rec["overhead_seconds"],
            "bytes_down": rec["bytes_sent_per_client"], "bytes_up": rec["bytes_received_per_client"],
        }
        if "client_train_seconds" in rec:
            row["client_train_seconds"] = rec["client_train_seconds"]
            row["overhead_vs_train_seconds"] = rec["round_seconds"] - rec["client_train_seconds"]
        if "client_transfer_seconds" in rec:  # the breakdown: Flower / data plane / training / the rest
            row["flower_seconds"] = rec["round_seconds"] - rec["client_seconds"]
            row["data_plane_seconds"] = rec["client_transfer_seconds"]
            row["client_other_seconds"] = (rec["client_seconds"] - rec["client_transfer_seconds"]
                                           - rec.get("client_train_seconds", 0.0))
        if "elapsed_seconds" in rec and prev_wall is not None:
            row["cycle_seconds"] = rec["elapsed_seconds"] - prev_wall
            row["cycle_overhead_seconds"] = row["cycle_seconds"] - rec["client_seconds"]
        prev_wall = rec.get("elapsed_seconds")
        rows.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    return {"rounds": rows, "median_rounds_2_to_n": _summary(rows)}


def summarize_stock(result_path: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in result_path.read_text().splitlines()]
    prev = None
    for row in rows:
        row["overhead_seconds"] = row["round_seconds"] - row["client_seconds"]
        if prev is not None:
            row["cycle_seconds"] = row["t_end"] - prev
        prev = row.pop("t_end")
    rows = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    return {"rounds": rows, "median_rounds_2_to_n": _summary(rows)}


def _summary(rows: list[dict]) -> dict[str, float]:
    """Medians of rounds 2..N, to the millisecond."""
    return {k: round(v, 3) for k, v in median_rounds_2_to_n(rows, skip=("round", "clients_ok")).items()}


def run_app_deployment(dep: Deployment, app_dir: Path, tmp: Path, name: str, rounds: int) -> dict[str, Any]:
    out = tmp / f"out-{name}"
    t0 = time.perf_counter()
    dep.run(app_dir, app_run_config(out, rounds), timeout=120 + 30 * rounds, check=True,
            log_path=tmp / f"{name}.log")
    return {"run_seconds": round(time.perf_counter() - t0, 2), **summarize_app(out)}


def run_stock_deployment(dep: Deployment, stock_dir: Path, tmp: Path, name: str, rounds: int) -> dict[str, Any]:
    result = tmp / f"{name}.jsonl"
    t0 = time.perf_counter()
    dep.run(stock_dir, {"num-server-rounds": rounds, "result-path": str(result)}, timeout=120 + 60 * rounds,
            check=True, log_path=tmp / f"{name}.log")
    return {"run_seconds": round(time.perf_counter() - t0, 2), **summarize_stock(result)}


def deployment_env(tmp: Path, poll: str | None) -> dict[str, str]:
    env = flower_env(tmp / "cli")
    env.pop(POLL_VAR, None)
    if poll is not None:
        env[POLL_VAR] = poll
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="stock (1 round) and app (2 rounds) in one deployment (~55 s)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 6; quick: 1 stock, 2 app)")
    parser.add_argument("--out", type=Path, default=RESULTS / "round_overhead.json")
    parser.add_argument("--app-dir", type=Path, default=ROOT, help="the app to measure (default: this repository)")
    parser.add_argument("--label", default="app", help="name of the app's configurations in the output")
    parser.add_argument("--only", default="", help="comma-separated configurations to run (default: all of the mode)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 6)
    stock_rounds = args.rounds or (1 if args.quick else 6)
    fast_poll = "0.1"
    full_plan = ["startup:client-process", "deployment:stock", f"deployment:{args.label}-default-poll",
                 f"deployment:{args.label}", f"deployment:{args.label}-node-workers", f"deployment:{args.label}-fastpoll", f"deployment:{args.label}-persistent",
                 f"deployment:{args.label}-persistent-fastpoll", "simulation:stock", f"simulation:{args.label}"]
    if args.only:
        wanted = set(args.only.split(","))
        plan = [p for p in full_plan if p in wanted or p.split(":", 1)[1] in wanted]
    elif args.quick:
        # ~55 s idle: both apps in one Deployment (FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1), the stock
        # app for 1 round (every deployment round starts new client processes: no warm-up to skip),
        # this app for 2; no simulation (~22 s more: --quick --only simulation:app)
        plan = [f"deployment:stock+{args.label}"]
    else:
        plan = full_plan

    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "round_overhead", "machine": machine_info(),
        "config": {"quick": args.quick, "rounds": rounds, "stock_rounds": stock_rounds, "nodes": 2,
                   "app_dir": str(args.app_dir), "app_run_config": app_run_config(Path("<tmp>/out"), rounds),
                   "summary": "median over rounds 2..N (all rounds when N = 1)", "fast_superexec_poll_s": float(fast_poll)},
        "deployment": {}, "simulation": {}, "startup": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="round-overhead-"))
    try:
        stock_dir = copy_app("stock_bench", tmp / "stockapp")
        for item in plan:
            mode, name = item.split(":", 1)
            t_item = time.perf_counter()
            print(f"[round_overhead] {item} ...", flush=True)
            work = tmp / name / mode
            work.mkdir(parents=True, exist_ok=True)
            if mode == "startup":
                result["startup"][name] = startup_breakdown()
                print(f"[round_overhead] {item}: {json.dumps(result['startup'][name])}", flush=True)
                continue
            if mode == "simulation":
                env = flower_env(work)
                if name == "stock":
                    res = tmp / f"sim-{name}.jsonl"
                    run_simulation(stock_dir, env, num_supernodes=2, run_config={"num-server-rounds": stock_rounds,
                                   "result-path": str(res)}, timeout=300, check=True, log_path=work / "sim.log")
                    entry = summarize_stock(res)
                else:
                    out = work / "out"
                    run_simulation(args.app_dir, env, num_supernodes=2, run_config=app_run_config(out, rounds),
                                   timeout=300, check=True, log_path=work / "sim.log")
                    entry = summarize_app(out)
                entry["settings"] = "flwr run <app> local: 2 supernodes, 1 CPU each (Ray)"
            elif name == f"stock+{args.label}":
                with Deployment(work, num_nodes=2, env=deployment_env(work, fast_poll)) as dep:
                    for sub in ("stock", args.label):
                        t_sub = time.perf_counter()
                        if sub == "stock":
                            entry = run_stock_deployment(dep, stock_dir, work, sub, stock_rounds)
                        else:
                            entry = run_app_deployment(dep, args.app_dir, work, sub, rounds)
                        entry["settings"] = f"{POLL_VAR}={fast_poll} (quick: one Deployment for both)"
                        entry["wall_seconds"] = round(time.perf_counter() - t_sub, 1)
                        result[mode][sub] = entry
                        print(f"[round_overhead] {mode}:{sub}: {json.dumps(entry['median_rounds_2_to_n'])}",
                              flush=True)
                continue
            else:
                entry = _run_deployment(name, args.label, stock_dir, args.app_dir, work, rounds, stock_rounds,
                                        fast_poll)
            entry["wall_seconds"] = round(time.perf_counter() - t_item, 1)
            result[mode][name] = entry
            print(f"[round_overhead] {item}: {json.dumps(entry['median_rounds_2_to_n'])}", flush=True)
    finally:
        if args.keep:
            print(f"[round_overhead] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[round_overhead] wrote {args.out} ({result['total_seconds']} s)")
    return 0


def _run_deployment(name: str, label: str, stock_dir: Path, app_dir: Path, work: Path, rounds: int,
                    stock_rounds: int, fast_poll: str) -> dict[str, Any]:
    variant = name.removeprefix(label) if name != "stock" else ""
    kwargs: dict[str, Any] = {}
    poll = None if name == "stock" or variant == "-default-poll" else fast_poll
    settings = [f"{POLL_VAR}={poll}" if poll else "Flower defaults (SuperExec polls every 1 s)"]
    if "persistent" in variant or "fastpoll" in variant:
        from benchmarks.flower_shims import persistent_executor_command, supernode_command

        settings.insert(0, "EXPERIMENT, not stock Flower (benchmarks/flower_shims.py)")
        if "persistent" in variant:
            kwargs.update(isolation="process", executor_command=persistent_executor_command)
            settings.append("--isolation process with one long-lived ClientApp runner per node")
        if "fastpoll" in variant:
            kwargs["supernode_command"] = supernode_command(0.1)
            settings.append("SuperNode waits (3 s fleet poll, 0.5 s reply poll) capped at 0.1 s")
    workers = []
    if variant == "-node-workers":
        from harness.node_workers import start_node_worker

        socks = [work / f"nw{i}.sock" for i in range(2)]
        workers = [start_node_worker(sock, work / f"node-worker-{i}.log") for i, sock in enumerate(socks)]
        kwargs["node_configs"] = [{"node-worker": f"unix://{sock}"} for sock in socks]
        settings.append("a node worker per node (lordo_fed.node), payloads on the gRPC data plane")
    env = deployment_env(work, poll)
    try:
        with Deployment(work, num_nodes=2, env=env, **kwargs) as dep:
            if name == "stock":
                entry = run_stock_deployment(dep, stock_dir, work, name, stock_rounds)
            else:
                entry = run_app_deployment(dep, app_dir, work, name, rounds)
            entry["startup"] = {k: round(v, 2) for k, v in dep.timings.items()}
    finally:
        from harness.processes import stop_process

        for proc in workers:
            stop_process(proc)
    entry["settings"] = "; ".join(settings)
    return entry


if __name__ == "__main__":
    sys.exit(main())
