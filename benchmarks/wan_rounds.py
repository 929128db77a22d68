"""Rounds over shaped links against the link's own limit: `lordo-emulate` deployments, side by side.

Each configuration is a real deployment on this machine (lordo_fed.wan.emulate: SuperLink and
ServerApp in a coordinator namespace, each node's SuperNode and node worker in its own namespace,
the node's link shaped with tc tbf both ways). The server records every round's link-bound ideal
(lordo_fed.wan.links: max over nodes of (down + up bytes) / rate + the node's training, plus
aggregation); this reports round_seconds / ideal, the median over rounds 2..N (round 1 sends no
θ: both sides build θ0 from the seed).

Overlapped rounds (`--overlap`, `OVERLAP_CASES`): the same deployment with K local steps, once
synchronous and once with `overlap-delay` = τ, each round also against max over nodes of
max(compute, link time), the bound no schedule beats.

Compressed payloads (`--compression`, `COMPRESSION_CASES`): the 125m-size DiLoCo with fp32 and with
every tensor top-k 2-bit both ways, at 100 Mb/s and 10 Mb/s, synchronous and overlapped; each case
also counts every node's bytes on its veth (the kernel's counters) against the app's own count.

Unequal nodes (`--hetero`, `--scenario`, `HETERO_SCENARIOS`): 4 nodes, one on 10 Mbit/s and the
others at 1 Gbit/s (`link`), or all at 1 Gbit/s and one four times slower (`compute`); non-IID data,
one source per node (verse, verse, code, code). DiLoCo and LoRDO-Global synchronous, LoRDO-Global
overlapped, and the asynchronous methods (each node's rounds a session on the data plane) on the same
tokens (`HETERO_CASES`; `--cases a,b`: a subset by name; `--seed`: another θ0 and data order;
`--async-rounds N`: the asynchronous cases train N rounds' tokens, their own schedule that long): the
validation loss against wall-clock, each run's wall-clock to reach the synchronous LoRDO-Global final
loss and its final loss at equal tokens, the staleness histograms and pushes per node against the
virtual clock's prediction for the speeds the deployment showed.

Full run (the issue's table): 125m-size model (byte vocabulary, 85 M parameters, 341 MB of fp32
θ), DiLoCo (θ down, Δ up: the largest payload per parameter with no moments), one local step of
2 x 128 tokens so the link dominates, 1 torch thread per process; 2 and 4 nodes at 1 Gb/s and
100 Mb/s on the gRPC data plane, and the 2-node 1 Gb/s case on Flower's own path for contrast.
Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/wan_rounds.py            # ~25 min on 2 cores
    sudo .venv/bin/python benchmarks/wan_rounds.py --overlap --out benchmarks/results/wan_overlap.json  # ~10 min
    sudo .venv/bin/python benchmarks/wan_rounds.py --hetero --scenario link --out benchmarks/results/wan_hetero_link.json  # ~20 min
    python benchmarks/wan_rounds.py --hetero --virtual 2.3,1,1,1 --cases synchronous,async --out ...  # its virtual twin, minutes
    sudo .venv/bin/python benchmarks/wan_rounds.py --compression --rounds 3 --out benchmarks/results/wan_compression.json  # ~10 min
    sudo .venv/bin/python benchmarks/wan_rounds.py --presets --rounds 3 --out benchmarks/results/wan_presets.json
    sudo .venv/bin/python benchmarks/wan_rounds.py --relay --rounds 3 --out benchmarks/results/wan_relay.json  # ~15 min
    sudo .venv/bin/python benchmarks/wan_rounds.py --relay --pick 2,4 --rounds 3 ...  # two of them: relay, option A at 10 Mb/s
    sudo .venv/bin/python benchmarks/wan_rounds.py --recipe --rounds 3 --out benchmarks/results/wan_recipe.json  # ~10 min
    sudo .venv/bin/python benchmarks/wan_rounds.py --quick    # tiny model, 2 nodes at 8 Mbit/s, overlapped, seconds
Writes benchmarks/results/wan_rounds.json and .png.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.async_rounds import non_iid_corpus  # noqa: E402
from benchmarks.common import make_parser, new_figure, png_path, print_rows, result_header, write_json  # noqa: E402
from lordo_fed.wan.emulate import Emulation, EmulationConfig  # noqa: E402
from lordo_fed.wan.links import parse_rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

FULL_MODEL = {"preset": "diloco", "model-preset": "125m", "local-steps": 1, "batch-size": 2, "seq-len": 128,
              "eval-batches": 1, "eval-every": 1000, "warmup-steps": 0, "min-clients": 0}
QUICK_MODEL = {"preset": "quickstart", "local-steps": 3, "batch-size": 4, "seq-len": 32, "eval-batches": 2}
FULL_CASES = [  # (nodes, link, data plane[, K, overlap delay τ])
    (2, "1gbit", "grpc"), (2, "100mbit", "grpc"), (4, "1gbit", "grpc"), (4, "100mbit", "grpc"), (2, "1gbit", "flower")]
BALANCED = {"model-preset": "16m", "batch-size": 16}
"""16m preset (byte vocabulary: 3.3 M parameters, 13 MB of fp32 θ), 16 x 128 tokens a step."""
OVERLAP_CASES = [(2, "20mbit", "grpc", 44, 0, BALANCED), (2, "20mbit", "grpc", 44, 24, BALANCED),
                 (2, "1gbit", "grpc", 4, 0), (2, "1gbit", "grpc", 4, 3)]
"""--overlap: synchronous and overlapped rounds side by side. A 16m-size model over 20 Mbit/s links,
where a round's transfers (10.5 s) are half its compute (44 steps) and hardly use the CPU, τ = 24
steps while the link works; and the 125m-size model at 1 Gb/s (5.5 s of link a round, 4 steps of
~1.8 s), τ = 3, where moving 341 MB each way at 125 MB/s keeps these 2 cores busy too."""
HETERO_SCENARIOS = {
    # (b) 4 nodes of equal compute, one on 10 Mbit/s, the others at 1 Gbit/s
    "link": {"nodes": 4, "link": "node0=10mbit,default=1gbit", "node_config": []},
    # (a) 4 nodes at 1 Gbit/s, node 0 four times slower (it sleeps 3x its local steps' time after them)
    "compute": {"nodes": 4, "link": "1gbit", "node_config": ["0:slowdown=4"]},
    # results section 18's first setting: 3 nodes, one at a tenth of the others' 100 Mbit/s
    "link3": {"nodes": 3, "link": "node0=10mbit,default=100mbit", "node_config": []},
}
"""--hetero --scenario: the nodes, their links and more node config."""
HETERO_MODEL = {"preset": "quickstart", "model-preset": "small", "rank": 16, "local-steps": 32, "batch-size": 8,
                "seq-len": 64, "eval-batches": 4, "eval-every": 1, "warmup-steps": 16, "data-plane": "grpc"}
"""The small preset, K = 32 steps of 8 x 64 tokens (section 18's first table used batches of 16: with 4
nodes on 2 cores a round of those took ~12 s, ~48 s for the slowed node)."""
HETERO_CASES = {  # name -> run config on top of HETERO_MODEL; asynchronous ones get ρ = 1/√M unless they say
    "diloco": {"variant": "diloco"},
    "synchronous": {"variant": "lordo_global"},
    "overlap": {"variant": "lordo_global", "overlap-delay": 24},
    "lookahead": {"variant": "async_lookahead"},
    "heloco": {"variant": "heloco"},
    "async": {"variant": "async_lordo"},  # each node's rounds as one session on the data plane
    "heloco-lordo": {"variant": "heloco_lordo"},
    "heloco-lordo-staleness": {"variant": "heloco_lordo", "async-staleness-exponent": 0.5},  # ρ·(1+s)^-0.5
    "heloco-lordo-grace": {"variant": "heloco_lordo", "async-grace": 2.0},  # arrivals within 2 s pull together
    # the grace window of 1 s and ρ·(1+s)^-0.5 together (section 18's best on the virtual clock)
    "async-grace-staleness": {"variant": "async_lordo", "async-grace": 1.0, "async-staleness-exponent": 0.5},
    "heloco-lordo-grace-staleness": {"variant": "heloco_lordo", "async-grace": 1.0, "async-staleness-exponent": 0.5},
    "heloco-lordo-match": {"variant": "heloco_lordo", "async-match-speed": True},  # steps from measured speed
    # the server keeps every node's latest Δ and steps on their mean calibrated by the arrival (CA²FL)
    "async-grace-staleness-ca2fl": {"variant": "async_lordo", "async-grace": 1.0, "async-staleness-exponent": 0.5,
                                    "async-cache": "ca2fl"},
    # int8 both ways (the slow link's transfers 3.3x shorter; asynchronous: each pull the change from the node's copy)
    "synchronous-int8": {"variant": "lordo_global", "payload-dtype": "int8"},
    "heloco-lordo-grace-int8": {"variant": "heloco_lordo", "async-grace": 2.0, "payload-dtype": "int8"},
    "async-grace-staleness-int8": {"variant": "async_lordo", "async-grace": 1.0, "async-staleness-exponent": 0.5,
                                   "payload-dtype": "int8"},
    # async LoRDO inside Flower's messages (a message per round: the SuperNode's 3 s poll, a ClientApp per message)
    "async-flower": {"variant": "async_lordo", "data-plane": "flower"},
}
ASYNC_VARIANTS = ("async_diloco", "async_lookahead", "heloco", "async_lordo", "heloco_lordo")
HETERO_DEFAULT = ("diloco", "synchronous", "overlap", "lookahead", "heloco", "async", "heloco-lordo")
"""--hetero without --cases: the issue's methods (DiLoCo and LoRDO-Global synchronous, LoRDO-Global
overlapped, async look-ahead, HeLoCo, async LoRDO, HeLoCo-LoRDO)."""
WIDE = {"payload-dtype": "topk2bit-both-wide", "wire-ef-decay": 0.95, "sparse-mean": "contributors"}
"""--compression: SparseLoCo's wire on DiLoCo (every tensor top-k 2-bit, θ down top-k at 12%; issue 30)."""
COMPRESSION_CASES = [(2, "100mbit", "grpc", 4, 0, {}), (2, "100mbit", "grpc", 4, 0, WIDE),
                     (2, "100mbit", "grpc", 4, 3, WIDE), (2, "10mbit", "grpc", 4, 0, WIDE),
                     (2, "10mbit", "grpc", 4, 3, WIDE)]
"""--compression: the 125m-size DiLoCo (FULL_MODEL, K = 4) with fp32 and with `WIDE` at 100 Mb/s and
10 Mb/s, synchronous and overlapped (τ = 3); fp32 at 10 Mb/s would take ~9 minutes a round (341 MB each
way): its link-bound ideal is the 100 Mb/s one's link time x 10."""
PRESET_CASES = [(2, "100mbit", "grpc", 4, 0, {"preset": "diloco-sparse"}),
                (2, "100mbit", "grpc", 4, 0, {"preset": "lordo-sparse"}),
                (2, "10mbit", "grpc", 4, 0, {"preset": "lordo-sparse"})]
"""--presets: the app presets that carry the wire (issue 30) on the 125m-size model (FULL_MODEL, K = 4):
`diloco-sparse` at 100 Mb/s and LoRDO-Global's `lordo-sparse` (every worker fits the round's bases to
the downlink, nothing dense on the wire) at 100 and 10 Mb/s, synchronous."""
RELAY = {"preset": "diloco-sparse", "payload-dtype": "topk2bit-relay"}
"""--relay: `diloco-sparse`'s outer step and uplink with the relay downlink (option B of issue 30)."""
RELAY_CASES = [(2, "100mbit", "grpc", 4, 0, RELAY), (2, "100mbit", "grpc", 4, 3, RELAY),
               (2, "10mbit", "grpc", 4, 0, RELAY), (2, "10mbit", "grpc", 4, 3, RELAY),
               (2, "10mbit", "grpc", 4, 0, {"preset": "diloco-sparse"})]
"""--relay: the relay on the 125m-size model (FULL_MODEL, K = 4) at 100 and 10 Mb/s, synchronous and
overlapped (τ = 3), and `diloco-sparse` (option A, the server's re-sparsified change) at 10 Mb/s beside it."""
RECIPE = {"preset": "diloco-relay"}
"""--recipe: issue 30's recipe, the relay with 1-bit values and the residual scaled by the lr's fall
(docs/results.md section 12, part twenty-five): `diloco-sparse` with payload-dtype=topk1bit-relay and
wire-ef-lr-scale=true, as the preset carries it."""
RECIPE_CASES = [(2, "100mbit", "grpc", 4, 0, RECIPE), (2, "100mbit", "grpc", 4, 3, RECIPE),
                (2, "10mbit", "grpc", 4, 0, RECIPE), (2, "10mbit", "grpc", 4, 3, RECIPE),
                (2, "10mbit", "grpc", 4, 0, RELAY), (2, "100mbit", "grpc", 4, 0, {})]
"""--recipe: the recipe on the 125m-size model (FULL_MODEL, K = 4) at 100 and 10 Mb/s, synchronous and
overlapped (τ = 3), the 2-bit relay at 10 Mb/s and fp32 at 100 Mb/s beside it (fp32 at 10 Mb/s takes
~10 minutes a round: section 12, part sixteen)."""
QUICK_CASES = [(2, "8mbit", "grpc", 3, 2)]
"""--quick: one overlapped case (the synchronous path is tests/integration/test_wan.py's deployment)."""


def emulate(nodes: int, link: str, run_config: dict[str, Any], work: Path, timeout: float, what: str,
            ranks_per_node: int = 1, counters: dict | None = None, node_config: list[str] = ()) -> list[dict]:
    """Run one `lordo-emulate` deployment (1 torch thread per process) and return its server.jsonl
    records; `counters`, when given, receives each node's veth byte counts at the run's end;
    `node_config`: more node-config keys per node ('I:key=value')."""
    cfg = EmulationConfig(nodes=nodes, link=link, app=ROOT, out_dir=work, threads=1, timeout=timeout,
                          ranks_per_node=ranks_per_node, node_config=list(node_config),
                          run_config=[" ".join(f"{k}={json.dumps(v)}" for k, v in run_config.items())])
    with Emulation(cfg) as emulation:
        status = emulation.submit(None)
        if counters is not None and status == 0:
            counters.update(emulation.topology.link_bytes())
    if status != 0:
        raise RuntimeError(f"{what} failed ({status}); log {work / 'run.log'}")
    return [json.loads(line) for line in (work / "out" / "server.jsonl").read_text().splitlines()]


def run_case(nodes: int, link: str, plane: str, model: dict[str, Any], rounds: int, work: Path,
             timeout: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One emulated deployment (`extra`: more run-config keys); per-round records and their
    medians over rounds 2..N. Besides the link-bound ideal of a synchronous round, each round
    against max over nodes of max(compute, link time), the bound no schedule beats (overlap)."""
    run_config = {**model, "num-server-rounds": rounds, "min-clients": nodes, "data-plane": plane,
                  "round-timeout": timeout, **(extra or {})}
    started = time.perf_counter()
    counters: dict = {}
    records = emulate(nodes, link, run_config, work, timeout, f"{nodes} nodes at {link} ({plane})", counters=counters)
    short = [r for r in records[1:] if r["clients_ok"] != nodes]
    if short:
        raise RuntimeError(f"{nodes} nodes at {link} ({plane}): round {short[0]['round']} had {short[0]['clients_ok']} "
                           f"replies (missing: {short[0].get('missing')}; dropped: {short[0].get('dropped')}); "
                           f"logs {work}")
    rows = []
    for prev, r in zip(records, records[1:]):
        links = r.get("links", {})
        rows.append({
            # from the end of the previous round's aggregation to the end of this one's: the round
            # plus the server's evaluation and checkpoint between rounds
            "cycle_seconds": r["elapsed_seconds"] - prev["elapsed_seconds"] if r["round"] > 1 else None,
            "round": r["round"], "round_seconds": r["round_seconds"], "ideal_seconds": r.get("ideal_seconds"),
            "round_over_ideal": r.get("round_over_ideal"), "link_seconds": r.get("link_seconds"),
            "train_seconds": r["client_train_seconds"], "aggregation_seconds": r["aggregation_seconds"],
            "down_bytes": r["bytes_sent_per_client"], "up_bytes": r["bytes_received_per_client"],
            # each node's achieved rate over its own transfers, as a share of its link
            # (on Flower's path the node's transfers are inside Flower's messages: not measured)
            "link_share": min((n["down_bytes"] + n["up_bytes"]) / max(n["download_seconds"] - n.get("download_wait_seconds", 0.0)
                                                                         + n["upload_seconds"], 1e-9)
                              / n["rate"] for n in links.values()) if links and plane == "grpc" else None,
            "server_peak_rss_bytes": r["server_peak_rss_bytes"],
            **_bound(r["round_seconds"], links),
            "phase_seconds": r.get("phase_seconds", {}), "links": links})
    later = [x for x in rows if x["round"] >= 2] or rows
    med = {k: statistics.median(x[k] for x in later if x[k] is not None)
           for k in later[0] if k not in ("round", "phase_seconds", "links") and any(x[k] is not None for x in later)}
    # the app's own count of one node's payload bytes over the run (every round, both ways) against what
    # the kernel counted on each node's veth (framing, gRPC, Flower's control messages and evaluation included)
    # (its running total: LoRDO-Global's round-0 gradient exchange, when its bases start from the gradient, is in it
    # and in no round's own bytes)
    app_bytes = next((r["cum_bytes_per_client"] for r in reversed(records) if "cum_bytes_per_client" in r), None)
    if app_bytes is None:
        app_bytes = sum(r["bytes_sent_per_client"] + r["bytes_received_per_client"] for r in records if "bytes_sent_per_client" in r)
    veth = {n: c["rx_bytes"] + c["tx_bytes"] for n, c in counters.items()}
    return {"nodes": nodes, "link": link, "rate_bytes_per_second": parse_rate(link), "data_plane": plane,
            "run_config": extra or {}, "rounds": rows, "median_rounds_2_to_n": med,
            "app_bytes_per_node": app_bytes, "veth_bytes": veth,
            "app_over_veth": {n: app_bytes / v for n, v in veth.items() if v},
            "wall_seconds": time.perf_counter() - started}


def hetero_config(name: str, scenario: dict[str, Any], rounds: int, data: dict[str, Any],
                  async_rounds: int = 0) -> dict[str, Any]:
    """The run config of `HETERO_CASES[name]` in `scenario` (asynchronous: ρ = 1/√M unless set, and
    `async_rounds` rounds' tokens instead of `rounds` where given)."""
    cfg = {**HETERO_MODEL, **data, **HETERO_CASES[name], "num-server-rounds": rounds, "min-clients": scenario["nodes"]}
    if cfg["variant"] in ASYNC_VARIANTS:
        cfg.setdefault("async-weight", round(scenario["nodes"] ** -0.5, 3))
        if async_rounds:
            cfg["num-server-rounds"] = async_rounds
    return cfg


def summed_pushes(records: list[dict]) -> tuple[dict[str, int], dict[str, int]]:
    """The staleness histogram and the pushes per node over a run's records (each record's, summed)."""
    staleness: dict[str, int] = {}
    pushes: dict[str, int] = {}
    for r in records:
        for k, v in (r.get("staleness") or {}).items():
            staleness[k] = staleness.get(k, 0) + v
        for k, v in enumerate(r.get("pushes_by_worker") or []):  # a list: node index -> its pushes
            pushes[str(k)] = pushes.get(str(k), 0) + v
    return staleness, pushes


def run_hetero(name: str, scenario: dict[str, Any], run_config: dict[str, Any], work: Path,
               timeout: float) -> dict[str, Any]:
    """One heterogeneous deployment: the validation loss against wall-clock and tokens (every
    record's), the federation's tokens per second and, for asynchronous rounds, the staleness
    histogram and the pushes per node (each record's, summed)."""
    run_config = {**run_config, "round-timeout": timeout}
    started = time.perf_counter()
    records = emulate(scenario["nodes"], scenario["link"], run_config, work, timeout,
                      f"{name} over {scenario['link']}", node_config=scenario["node_config"])
    curve = [{"elapsed_seconds": r.get("elapsed_seconds", 0.0), "tokens": r["tokens"], "val_loss": r["val_loss"]}
             for r in records if "val_loss" in r]
    last = records[-1]
    staleness, pushes = summed_pushes(records)
    return {"name": name, "run_config": run_config, "curve": curve, "tokens": last["tokens"],
            "elapsed_seconds": last["elapsed_seconds"], "tokens_per_second": last["tokens"] / last["elapsed_seconds"],
            "final_val_loss": curve[-1]["val_loss"], "staleness": staleness, "pushes_by_worker": pushes,
            "local_steps_by_worker": last.get("local_steps_by_worker"),
            "bytes_sent_per_client": last.get("bytes_sent_per_client"),
            "bytes_received_per_client": last.get("bytes_received_per_client"),
            "wall_seconds": time.perf_counter() - started}


def run_virtual_twin(name: str, run_config: dict[str, Any], speeds: str) -> dict[str, Any]:
    """`--virtual SPEEDS`: a --hetero case without the deployment. The reference trainer on the case's own
    run config (the app's settings, as the deployment gets them), asynchronous replies applied in the
    virtual clock's order with `speeds` virtual seconds per local step of each node (`async-order=virtual`:
    tests/integration/test_async_flower.py holds a Flower run in that order equal to the trainer), the
    synchronous cases in rounds that wait for the slowest node. One torch thread, as a deployment's
    processes. Deterministic: what differs from the deployment's run is its timing alone."""
    import torch

    from lordo_fed.app.config import flat_defaults, load_app_config
    from lordo_fed.data import load_dataset
    from lordo_fed.device import pick_device
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.trainer.config import TrainConfig
    from lordo_fed.trainer.run import RunContext, run_method

    run_config = {**run_config, "async-order": "virtual", "async-speeds": speeds}
    app = load_app_config({**flat_defaults(), **run_config}, explicit=run_config)
    workers = int(run_config["min-clients"])
    cfg = TrainConfig.of_app(app, workers)
    records: list[dict] = []
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = load_dataset(cfg.data, workers)
        ctx = RunContext(cfg, dataset, pick_device("cpu"), dataset.val_batches(cfg.eval_batches), records.append)
        run_method(ctx, resolve_method(app.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps))
    finally:
        torch.set_num_threads(threads)
    # the virtual seconds stand in for the wall-clock, so the deployment's summary and figure read them alike
    curve = [{"elapsed_seconds": r["virtual_time"], "tokens": r["tokens"], "val_loss": r["val_loss"]}
             for r in records if "val_loss" in r]
    staleness, pushes = summed_pushes(records)
    last = records[-1]
    return {"name": name, "run_config": run_config, "curve": curve, "tokens": last["tokens"],
            "elapsed_seconds": curve[-1]["elapsed_seconds"], "virtual_seconds": True,
            "tokens_per_second": last["tokens"] / curve[-1]["elapsed_seconds"], "final_val_loss": curve[-1]["val_loss"],
            "staleness": staleness, "pushes_by_worker": pushes, "wall_seconds": time.perf_counter() - started}


def loss_at(curve: list[dict[str, float]], value: float, key: str = "elapsed_seconds") -> float:
    """The validation loss of the last evaluation at or before `value` of `key` (wall-clock seconds, or
    "tokens")."""
    return [c["val_loss"] for c in curve if c[key] <= value + 1e-9][-1]


def seconds_to(curve: list[dict[str, float]], loss: float) -> float | None:
    """Wall-clock seconds of the first evaluation at or below `loss` (None: never reached)."""
    return next((c["elapsed_seconds"] for c in curve if c["val_loss"] <= loss), None)


def measured_seconds(case: dict[str, Any], nodes: int) -> list[float]:
    """Each node's seconds per round in the deployment: the run's wall-clock over its pushes (a slow
    link or slow compute alike)."""
    pushes = case["pushes_by_worker"]
    return [case["elapsed_seconds"] / max(pushes.get(str(w), 0), 1) for w in range(nodes)]


def nominal_seconds(case: dict[str, Any], scenario: dict[str, Any]) -> list[float]:
    """Each node's seconds per round from the scenario's nominal handicaps alone: a round of an
    unhandicapped node (the median of the measured rounds of the nodes at the most common link rate
    without a slowdown), times a node's `slowdown`, plus its extra link time, one state down and one
    reply up (the run's last push's sizes) at its rate in place of the common one."""
    from lordo_fed.wan.links import parse_links

    nodes = scenario["nodes"]
    rates = parse_links(scenario["link"], nodes)
    slowdown = [1.0] * nodes
    for entry in scenario["node_config"]:  # "0:slowdown=4"
        node, _, setting = entry.partition(":")
        key, _, value = setting.partition("=")
        if key == "slowdown":
            slowdown[int(node)] = float(value)
    common = max(set(rates), key=rates.count)
    plain = [w for w in range(nodes) if rates[w] == common and slowdown[w] == 1.0]
    measured = measured_seconds(case, nodes)
    fast = sorted(measured[w] for w in plain)[len(plain) // 2]
    nbytes = (case.get("bytes_sent_per_client") or 0) + (case.get("bytes_received_per_client") or 0)
    return [fast * slowdown[w] + nbytes / rates[w] - nbytes / common for w in range(nodes)]


def virtual_staleness(case: dict[str, Any], nodes: int, seconds: list[float] | None = None) -> dict[str, Any]:
    """What the virtual clock predicts for the nodes' seconds per round (default `measured_seconds`:
    the speeds the deployment showed; `nominal_seconds`: the scenario's handicaps): the schedule of
    the reference trainer's `run_async` (lordo_fed.rounds.async_rounds.VirtualClock, arrival order,
    no grace window) on the same budget of rounds; its staleness histogram and pushes per node."""
    from lordo_fed.rounds.async_rounds import VirtualClock

    pushes = case["pushes_by_worker"]
    seconds = seconds or measured_seconds(case, nodes)
    budget = sum(pushes.values())  # rounds sent in all (the same tokens: every round has K steps)
    clock, version, pulled, staleness, predicted = VirtualClock(), 0, {}, {}, {}
    for w in range(nodes):
        pulled[w] = version
        clock.start(w, 0.0, seconds[w])
    sent = nodes
    while len(clock):
        _, batch = clock.window(0.0)
        for t, w in batch:
            s = str(version - pulled[w])
            staleness[s] = staleness.get(s, 0) + 1
            predicted[str(w)] = predicted.get(str(w), 0) + 1
            version += 1
            if sent < budget:
                pulled[w] = version
                clock.start(w, t, seconds[w])
                sent += 1
    return {"seconds_per_round": [round(x, 2) for x in seconds], "staleness": staleness, "pushes_by_worker": predicted}


def predict_nominal(paths: list[str]) -> int:
    """`--predict`: the nominal-speed prediction of stored --hetero results, written into each file."""
    for path in paths:
        result = json.loads(Path(path).read_text())
        scenario = HETERO_SCENARIOS[result["config"]["scenario"]]
        for name, case in result["cases"].items():
            if "virtual_clock" in case:
                case["virtual_clock_nominal"] = virtual_staleness(case, scenario["nodes"], nominal_seconds(case, scenario))
                pred = case["virtual_clock_nominal"]
                print(f"{path} {name}: pushes {case['pushes_by_worker']} predicted {pred['pushes_by_worker']}, "
                      f"staleness {case['staleness']} predicted {pred['staleness']}")
        write_json(result, path)
    return 0


def main_hetero(args) -> int:
    scenario_name = args.scenario or "link"
    if scenario_name not in HETERO_SCENARIOS:
        raise SystemExit(f"--scenario {scenario_name!r}: expected one of {sorted(HETERO_SCENARIOS)}")
    scenario = HETERO_SCENARIOS[scenario_name]
    rounds = args.rounds or 8
    names = args.cases.split(",") if args.cases else list(HETERO_DEFAULT)
    unknown = sorted(set(names) - set(HETERO_CASES))
    if unknown:
        raise SystemExit(f"--hetero --cases {args.cases!r}: unknown {unknown}; expected names of {sorted(HETERO_CASES)}")
    result = result_header("wan_hetero", False, {"model": HETERO_MODEL, "scenario": scenario_name, **scenario,
                                                 "rounds": rounds, "async_rounds": args.async_rounds or rounds,
                                                 "threads_per_process": 1,
                                                 "data": "iid" if args.iid else "by_source", "seed": args.seed,
                                                 "virtual_speeds": args.virtual or None})
    result["cases"] = {}
    with tempfile.TemporaryDirectory(prefix="wan_hetero_") as tmp:
        work = Path(args.work or tmp)
        # non-IID by source: node m trains on source m (verse, verse, code, code; benchmarks/async_rounds.py)
        data = {} if args.iid else {"data-path": str(non_iid_corpus(work / "corpus")), "partition": "by_source"}
        data["seed"] = args.seed
        for name in names:
            cfg = hetero_config(name, scenario, rounds, data, args.async_rounds)
            if args.virtual:
                result["cases"][name] = run_virtual_twin(name, cfg, args.virtual)
                write_json(result, args.out)
                continue
            try:
                case = run_hetero(name, scenario, cfg, work / name, 1200.0)
            except RuntimeError as err:  # one failed deployment: recorded, the other cases still run
                print(f"[wan_rounds] {name}: {err}", flush=True)
                result.setdefault("failed", {})[name] = str(err)
                write_json(result, args.out)
                continue
            if cfg["variant"] in ASYNC_VARIANTS and not cfg.get("async-match-speed") and not cfg.get("async-grace"):
                case["virtual_clock"] = virtual_staleness(case, scenario["nodes"])
                case["virtual_clock_nominal"] = virtual_staleness(case, scenario["nodes"],
                                                                  nominal_seconds(case, scenario))
            result["cases"][name] = case
            write_json(result, args.out)  # a cut-short run keeps what it measured
    summarise_hetero(result)
    write_json(result, args.out)
    plot_hetero(result, png_path(args.out))
    return 0


def summarise_hetero(result: dict[str, Any]) -> None:
    """Each case against the synchronous LoRDO-Global run (`synchronous`, else the first case): its
    wall-clock to reach the synchronous final loss (as a ratio), its final loss against the synchronous
    one (as a difference in percent: at equal tokens unless --async-rounds gave it more), its loss at the
    synchronous run's tokens and every case's loss at the shortest run's wall-clock."""
    cases = result["cases"]
    clock = min(c["elapsed_seconds"] for c in cases.values())
    ref_name = "synchronous" if "synchronous" in cases else next(iter(cases))
    ref = cases[ref_name]
    for c in cases.values():
        c["val_loss_at_equal_clock"] = loss_at(c["curve"], clock)
        reach = seconds_to(c["curve"], ref["final_val_loss"])
        c["seconds_to_reference_loss"] = reach
        c["time_ratio_to_reference"] = None if reach is None else reach / ref["elapsed_seconds"]
        c["final_loss_vs_reference_pct"] = 100 * (c["final_val_loss"] / ref["final_val_loss"] - 1)
        # with --async-rounds a run goes past the reference's tokens: its loss where it had trained as many
        c["val_loss_at_reference_tokens"] = loss_at(c["curve"], ref["tokens"], "tokens")
    result["equal_clock_seconds"] = clock
    result["reference"] = ref_name
    print_rows(f"{'case':>24} {'tokens':>9} {'seconds':>8} {'tok/s':>7} {'loss(end)':>9} {'vs ref':>7} "
               f"{'t->ref':>7} {'loss@' + format(clock, '.0f') + 's':>10}",
               [f"{n:>24} {c['tokens']:>9} {c['elapsed_seconds']:8.1f} {c['tokens_per_second']:7.0f} "
                f"{c['final_val_loss']:9.3f} {c['final_loss_vs_reference_pct']:+6.1f}% "
                f"{'-' if c['time_ratio_to_reference'] is None else format(c['time_ratio_to_reference'], '.2f'):>7} "
                f"{c['val_loss_at_equal_clock']:10.3f}" for n, c in cases.items()])


def plot_hetero(result: dict[str, Any], out: Path) -> None:
    cfg = result["config"]
    fig = new_figure(7.5, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    for n, c in result["cases"].items():
        ax.plot([p["elapsed_seconds"] for p in c["curve"]], [p["val_loss"] for p in c["curve"]], marker=".",
                label=n, linestyle="-" if c["run_config"]["variant"] in ASYNC_VARIANTS else "--")
    virtual = any(c.get("virtual_seconds") for c in result["cases"].values())
    ax.set(xlabel="virtual seconds" if virtual else "wall-clock seconds", ylabel="validation loss")
    extra = f", {' '.join(cfg['node_config'])}" if cfg.get("node_config") else ""
    ax.set_title(f"{cfg['nodes']} nodes over {cfg['link']}{extra} ({cfg.get('data', 'iid')} data)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


def _bound(seconds: float, links: dict[str, dict]) -> dict[str, float | None]:
    """The round against max over nodes of max(its compute, its link time) (lordo_fed.wan.links,
    `overlap_bound_seconds`; train_seconds there are all of the round's local steps)."""
    if not links:
        return {"bound_seconds": None, "round_over_bound": None}
    bound = max(max(n["train_seconds"], (n["down_bytes"] + n["up_bytes"]) / n["rate"]) for n in links.values())
    return {"bound_seconds": bound, "round_over_bound": seconds / bound}


def plot(result: dict[str, Any], out: Path) -> None:
    cases = result["cases"]
    fig = new_figure(max(7.5, 1.6 * len(cases)), 4.2)
    ax = fig.add_subplot(1, 1, 1)
    def payload(rc: dict[str, Any]) -> str:  # a preset without payload-dtype travels with its own payload
        return rc.get("payload-dtype") or (f"{rc['preset']}'s" if "preset" in rc else "fp32")

    labels = [f"{c['nodes']} nodes\n{c['link']}\n{c['data_plane']}"
              + (f"\n{c['run_config'].get('model-preset', '125m')}\n{payload(c['run_config'])}\n"
                 f"K={c['run_config']['local-steps']} τ={c['run_config']['overlap-delay']}" if c["run_config"] else "")
              for c in cases]
    med = [c["median_rounds_2_to_n"] for c in cases]
    ideal = [m.get("ideal_seconds", 0) for m in med]
    bound = [m.get("bound_seconds", 0) for m in med]
    actual = [m["round_seconds"] for m in med]
    x = range(len(cases))
    ax.bar([i - 0.27 for i in x], ideal, width=0.27, label="link-bound ideal (synchronous)")
    ax.bar(list(x), bound, width=0.27, label="max(compute, link)")
    ax.bar([i + 0.27 for i in x], actual, width=0.27, label="round")
    for i, (a, b, c) in enumerate(zip(actual, ideal, bound)):
        if b:
            ax.text(i + 0.27, a, f"{a / b:.2f}x\n{a / c:.2f}x" if c else f"{a / b:.2f}x", ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("seconds per round (median, rounds 2..N)")
    ax.set_title(result["title"], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("wan_rounds", __doc__, "tiny model, 2 nodes at 8 Mbit/s, 3 rounds (seconds)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per case (default 4; quick 3)")
    parser.add_argument("--cases", default="", help="subset, e.g. '2:1gbit:grpc,4:100mbit:grpc' (or "
                        "'2:1gbit:grpc:4:3': K = 4 local steps, overlap delay 3; --overlap's own cases may set "
                        "more run-config keys; --hetero: names of HETERO_CASES)")
    parser.add_argument("--pick", default="", help="comma-separated indices into the chosen case list (e.g. --relay "
                        "--pick 2,4: RELAY_CASES' synchronous relay and option A at 10 Mb/s, with their run-config keys)")
    parser.add_argument("--overlap", action="store_true", help="synchronous against overlapped rounds (OVERLAP_CASES)")
    parser.add_argument("--compression", action="store_true", help="fp32 against SparseLoCo's wire at 100 and 10 "
                        "Mb/s, synchronous and overlapped (COMPRESSION_CASES)")
    parser.add_argument("--presets", action="store_true", help="the app presets diloco-sparse and lordo-sparse at 100 "
                        "and 10 Mb/s (PRESET_CASES)")
    parser.add_argument("--relay", action="store_true", help="the relay downlink (topk2bit-relay) at 100 and 10 Mb/s, "
                        "synchronous and overlapped, and diloco-sparse at 10 Mb/s (RELAY_CASES)")
    parser.add_argument("--recipe", action="store_true", help="issue 30's recipe (topk1bit-relay, wire-ef-lr-scale) "
                        "at 100 and 10 Mb/s, synchronous and overlapped, the 2-bit relay and fp32 beside it (RECIPE_CASES)")
    parser.add_argument("--hetero", action="store_true", help="unequal nodes (--scenario): synchronous, overlapped and "
                        "asynchronous rounds (HETERO_CASES), non-IID data by source")
    parser.add_argument("--scenario", default="", help="--hetero: 'link' (4 nodes, one on 10 Mbit/s; default), "
                        "'compute' (4 nodes, one 4x slower) or 'link3' (3 nodes, one on 10 of 100 Mbit/s)")
    parser.add_argument("--iid", action="store_true", help="--hetero: IID data instead of one source per node")
    parser.add_argument("--async-rounds", type=int, default=0,
                        help="--hetero: the asynchronous cases train this many rounds' tokens (default --rounds): "
                             "more tokens than the synchronous run, to read the wall-clock to its final loss")
    parser.add_argument("--seed", type=int, default=0, help="--hetero: the run's seed (θ0, data order; default 0)")
    parser.add_argument("--virtual", default="", metavar="SPEEDS",
                        help="--hetero without a deployment (no root): each case's run config in the reference trainer, "
                             "replies in the virtual clock's order at these seconds per step of each node, e.g. "
                             "'2.3,1,1,1' (run_virtual_twin)")
    parser.add_argument("--work", default="", help="keep each case's logs and outputs here (default: a temporary folder)")
    parser.add_argument("--predict", nargs="+", default=[], metavar="RESULT",
                        help="no run: add the virtual clock's prediction from the scenario's nominal speeds "
                             "(`virtual_clock_nominal`) to each asynchronous case of these --hetero results")
    args = parser.parse_args(argv)
    if args.predict:
        return predict_nominal(args.predict)
    if args.hetero:
        return main_hetero(args)
    cases = (QUICK_CASES if args.quick else OVERLAP_CASES if args.overlap else COMPRESSION_CASES if args.compression
             else PRESET_CASES if args.presets else RELAY_CASES if args.relay else RECIPE_CASES if args.recipe
             else FULL_CASES)
    if args.cases:
        cases = [(int(n), link, plane, *map(int, rest)) for n, link, plane, *rest in (c.split(":") for c in args.cases.split(","))]
    if args.pick:
        picked = [int(i) for i in args.pick.split(",") if i.strip().lstrip("-").isdigit()]
        if len(picked) != len(args.pick.split(",")) or any(not 0 <= i < len(cases) for i in picked):
            parser.error(f"--pick {args.pick}: expected indices in 0..{len(cases) - 1} of the chosen case list")
        cases = [cases[i] for i in picked]
    model = QUICK_MODEL if args.quick else FULL_MODEL
    rounds = args.rounds or (3 if args.quick else 4)
    timeout = 300.0 if args.quick else 1200.0
    result = result_header("wan_rounds", args.quick, {"model": model, "rounds": rounds, "cases": cases,
                                                      "threads_per_process": 1})
    result["title"] = ("16m- and 125m-size DiLoCo: synchronous and overlapped rounds vs their bounds" if args.overlap
                       else "125m-size DiLoCo, fp32 and top-k 2-bit both ways: rounds vs their bounds" if args.compression
                       else "125m-size model, the presets diloco-sparse and lordo-sparse: rounds vs their bounds" if args.presets
                       else "125m-size DiLoCo, the relay downlink against diloco-sparse's: rounds vs their bounds" if args.relay
                       else "125m-size DiLoCo, the 1-bit relay (issue 30's recipe) against the 2-bit relay and fp32: "
                            "rounds vs their bounds" if args.recipe
                       else f"{'tiny' if args.quick else '125m-size'} {model['preset']}: rounds over shaped links "
                       "vs their link-bound ideal")
    result["cases"] = []
    with tempfile.TemporaryDirectory(prefix="wan_rounds_") as tmp:
        for i, (nodes, link, plane, *steps) in enumerate(cases):
            extra = {"local-steps": steps[0], "overlap-delay": steps[1] if len(steps) > 1 else 0} if steps else {}
            extra.update(steps[2] if len(steps) > 2 else {})
            case = run_case(nodes, link, plane, model, rounds, Path(args.work or tmp) / f"case{i}", timeout, extra)
            result["cases"].append(case)
            write_json(result, args.out)  # a cut-short run keeps what it measured
    print_rows(f"{'nodes':>5} {'link':>8} {'plane':>6} {'K':>3} {'tau':>3} {'cycle_s':>8} {'round_s':>8} {'ideal_s':>8} "
               f"{'ratio':>6} {'link_share':>10} {'bound_s':>8} {'/bound':>6}",
               [f"{c['nodes']:>5} {c['link']:>8} {c['data_plane']:>6} {c['run_config'].get('local-steps', model['local-steps']):>3} "
                f"{c['run_config'].get('overlap-delay', 0):>3} "
                f"{c['median_rounds_2_to_n'].get('cycle_seconds', float('nan')):8.2f} "
                f"{c['median_rounds_2_to_n']['round_seconds']:8.2f} "
                f"{c['median_rounds_2_to_n'].get('ideal_seconds', float('nan')):8.2f} "
                f"{c['median_rounds_2_to_n'].get('round_over_ideal', float('nan')):6.2f} "
                f"{c['median_rounds_2_to_n'].get('link_share', float('nan')):10.2f} "
                f"{c['median_rounds_2_to_n'].get('bound_seconds', float('nan')):8.2f} "
                f"{c['median_rounds_2_to_n'].get('round_over_bound', float('nan')):6.2f}" for c in result["cases"]])
    write_json(result, args.out)
    plot(result, png_path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
