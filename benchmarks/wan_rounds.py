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

Full run (the issue's table): 125m-size model (byte vocabulary, 85 M parameters, 341 MB of fp32
θ), DiLoCo (θ down, Δ up: the largest payload per parameter with no moments), one local step of
2 x 128 tokens so the link dominates, 1 torch thread per process; 2 and 4 nodes at 1 Gb/s and
100 Mb/s on the gRPC data plane, and the 2-node 1 Gb/s case on Flower's own path for contrast.
Needs root (network namespaces).

    sudo python benchmarks/wan_rounds.py            # ~25 min on 2 cores
    sudo python benchmarks/wan_rounds.py --overlap --out benchmarks/results/wan_overlap.json  # ~10 min
    sudo python benchmarks/wan_rounds.py --quick    # tiny model, 2 nodes at 8 Mbit/s, overlapped, seconds
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

from benchmarks.common import make_parser, new_figure, png_path, print_rows, result_header, write_json  # noqa: E402
from lordo_fed.wan.emulate import Emulation, EmulationConfig  # noqa: E402
from lordo_fed.wan.links import parse_rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

FULL_MODEL = {"preset": "diloco", "model-preset": "125m", "local-steps": 1, "batch-size": 2, "seq-len": 128,
              "eval-batches": 1, "eval-every": 1000, "warmup-steps": 0, "min-clients": 0}
QUICK_MODEL = {"preset": "quickstart", "local-steps": 3, "batch-size": 4, "seq-len": 32, "eval-batches": 2}
FULL_CASES = [  # (nodes, link, data plane[, K, overlap delay τ])
    (2, "1gbit", "grpc"), (2, "100mbit", "grpc"), (4, "1gbit", "grpc"), (4, "100mbit", "grpc"), (2, "1gbit", "flower")]
OVERLAP_CASES = [(2, "1gbit", "grpc", 4, 0), (2, "1gbit", "grpc", 4, 3)]
"""--overlap: synchronous and overlapped rounds side by side, K = 4 steps so compute and link are
of one size (a 125m-size step takes seconds here), τ = 3 of them while the link works."""
QUICK_CASES = [(2, "8mbit", "grpc", 3, 2)]
"""--quick: one overlapped case (the synchronous path is tests/test_wan.py's deployment)."""


def run_case(nodes: int, link: str, plane: str, model: dict[str, Any], rounds: int, work: Path,
             timeout: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One emulated deployment (`extra`: more run-config keys); per-round records and their
    medians over rounds 2..N. Besides the link-bound ideal of a synchronous round, each round
    against max over nodes of max(compute, link time), the bound no schedule beats (overlap)."""
    run_config = {**model, "num-server-rounds": rounds, "min-clients": nodes, "data-plane": plane,
                  "round-timeout": timeout, **(extra or {})}
    cfg = EmulationConfig(nodes=nodes, link=link, app=ROOT, out_dir=work, threads=1, timeout=timeout,
                          run_config=[" ".join(f"{k}={json.dumps(v)}" for k, v in run_config.items())])
    started = time.perf_counter()
    with Emulation(cfg) as emulation:
        status = emulation.submit(None)
    if status != 0:
        raise RuntimeError(f"{nodes} nodes at {link} ({plane}) failed ({status}); log {work / 'run.log'}")
    records = [json.loads(line) for line in (work / "out" / "server.jsonl").read_text().splitlines()]
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
    return {"nodes": nodes, "link": link, "rate_bytes_per_second": parse_rate(link), "data_plane": plane,
            "run_config": extra or {}, "rounds": rows, "median_rounds_2_to_n": med, "wall_seconds": time.perf_counter() - started}


def _bound(seconds: float, links: dict[str, dict]) -> dict[str, float | None]:
    """The round against max over nodes of max(its compute, its link time) (lordo_fed.wan.links,
    `overlap_bound_seconds`; train_seconds there are all of the round's local steps)."""
    if not links:
        return {"bound_seconds": None, "round_over_bound": None}
    bound = max(max(n["train_seconds"], (n["down_bytes"] + n["up_bytes"]) / n["rate"]) for n in links.values())
    return {"bound_seconds": bound, "round_over_bound": seconds / bound}


def plot(result: dict[str, Any], out: Path) -> None:
    cases = result["cases"]
    fig = new_figure(7.5, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{c['nodes']} nodes\n{c['link']}\n{c['data_plane']}"
              + (f"\nK={c['run_config']['local-steps']} τ={c['run_config']['overlap-delay']}" if c["run_config"] else "")
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
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("seconds per round (median, rounds 2..N)")
    ax.set_title(result["title"], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("wan_rounds", __doc__, "tiny model, 2 nodes at 8 Mbit/s, 3 rounds (seconds)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per case (default 4; quick 3)")
    parser.add_argument("--cases", default="", help="subset, e.g. '2:1gbit:grpc,4:100mbit:grpc' (or "
                        "'2:1gbit:grpc:4:3': K = 4 local steps, overlap delay 3)")
    parser.add_argument("--overlap", action="store_true", help="synchronous against overlapped rounds (OVERLAP_CASES)")
    parser.add_argument("--work", default="", help="keep each case's logs and outputs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    cases = QUICK_CASES if args.quick else OVERLAP_CASES if args.overlap else FULL_CASES
    if args.cases:
        cases = [(int(n), link, plane, *map(int, rest)) for n, link, plane, *rest in (c.split(":") for c in args.cases.split(","))]
    model = QUICK_MODEL if args.quick else FULL_MODEL
    rounds = args.rounds or (3 if args.quick else 4)
    timeout = 300.0 if args.quick else 1200.0
    result = result_header("wan_rounds", args.quick, {"model": model, "rounds": rounds, "cases": cases,
                                                      "threads_per_process": 1})
    result["title"] = (f"{'tiny' if args.quick else '125m-size'} {model['preset']}: rounds over shaped links "
                       "vs their link-bound ideal")
    result["cases"] = []
    with tempfile.TemporaryDirectory(prefix="wan_rounds_") as tmp:
        for i, (nodes, link, plane, *steps) in enumerate(cases):
            extra = {"local-steps": steps[0], "overlap-delay": steps[1] if len(steps) > 1 else 0} if steps else {}
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
