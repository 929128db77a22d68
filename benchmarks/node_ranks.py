"""Nodes of several ranks: bytes on the WAN per node, and what the intra-node wrapper costs a step.

1. **Bytes.** Real deployments by `lordo-emulate` (each node in its own network namespace, 1 Gb/s
   links, node workers; lordo_fed.wan.emulate `--ranks-per-node`), LoRDO-Global, small preset, the
   same total batch each way: 1 node of 2 ranks against 2 one-rank nodes, and 2 nodes of 2 ranks
   against 4 one-rank nodes. Bytes are the server's own counts of what each node received and sent
   (server.jsonl), per round and summed over the nodes.
2. **Wrapper overhead.** One process, one rank: LoRDO-Local local steps of the 16m preset through DDP (gloo,
   world size 1; NCCL with `--device cuda`) against the bare model, alternated, median of each
   (the issue's ≤ 5%; `benchmarks/gpu_check.py --only ranks` takes it on a GPU, 125m).

    sudo python benchmarks/node_ranks.py          # ~4 min on 2 cores
    sudo python benchmarks/node_ranks.py --quick  # tiny preset: the overhead part only (the tests run it)
    python benchmarks/node_ranks.py --overhead-only --device cuda --preset 125m --out benchmarks/results/gpu_node_ranks.json
Writes benchmarks/results/node_ranks.json.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import make_parser, print_rows, result_header, write_json  # noqa: E402

MODEL = {"preset": "quickstart", "model-preset": "small", "rank": 16, "local-steps": 8, "batch-size": 8,
         "seq-len": 64, "eval-batches": 2, "eval-every": 100}
CASES = [(1, 2), (2, 1), (2, 2), (4, 1)]
"""(nodes, ranks per node): the pairs of the same total batch side by side."""


def bytes_case(nodes: int, ranks: int, work: Path, rounds: int = 3) -> dict[str, Any]:
    from benchmarks.wan_rounds import emulate

    run_config = {**MODEL, "num-server-rounds": rounds, "min-clients": nodes, "data-plane": "grpc"}
    records = emulate(nodes, "1gbit", run_config, work, 900.0, f"{nodes} nodes of {ranks} ranks", ranks_per_node=ranks)
    later = [r for r in records if r["round"] >= 2]  # round 1 sends no θ (both sides build θ0)
    down = statistics.median(r["bytes_sent_per_client"] for r in later)
    up = statistics.median(r["bytes_received_per_client"] for r in later)
    return {"nodes": nodes, "ranks_per_node": ranks, "windows_per_step": nodes * ranks * MODEL["batch-size"],
            "tokens_per_round": later[-1]["tokens"] - later[-2]["tokens"] if len(later) > 1 else None,
            "down_bytes_per_node": down, "up_bytes_per_node": up, "wan_bytes_per_round": nodes * (down + up),
            "final_val_loss": records[-1].get("val_loss")}


def wrapper_overhead(preset: str, batch: int, steps: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Seconds per local step through DDP (one rank: gloo, or NCCL on CUDA) and through the bare
    model, alternated (each sample ends in the loss's host read: the GPU's work is in it)."""
    import torch
    import torch.distributed as dist

    from lordo_fed.data import TokenShard
    from lordo_fed.methods import make_worker, resolve_method
    from lordo_fed.model import ModelConfig, build_model, lowrank_parameter_names
    from lordo_fed.node.ranks import LocalRanks
    from lordo_fed.optim.config import InnerConfig
    from lordo_fed.outer import OuterConfig
    from lordo_fed.rounds import RoundConfig

    import numpy as np

    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{tmp}/rdv", rank=0,
                                world_size=1)
        try:
            s = resolve_method("lordo_local", InnerConfig(rank=16), RoundConfig(local_steps=steps), OuterConfig())
            shard = TokenShard(np.random.default_rng(0).integers(0, 256, size=1 << 18), shard_id=0)
            workers = {}
            for name, ranks in (("bare", None), ("ddp", LocalRanks(0, 1))):
                torch.manual_seed(0)
                model = build_model(ModelConfig(preset=preset), 256).to(dev)
                workers[name] = make_worker(0, model, s, shard, lowrank_parameter_names(model), 10 ** 6, batch, 128,
                                            seed=0, ranks=ranks)
            seconds: dict[str, list[float]] = {"bare": [], "ddp": []}
            for i in range(repeats):
                for name in (("bare", "ddp") if i % 2 == 0 else ("ddp", "bare")):
                    w = workers[name]
                    started = time.perf_counter()
                    w.local_steps(w.cursor, steps)
                    seconds[name].append((time.perf_counter() - started) / steps)
        finally:
            dist.destroy_process_group()
    bare, ddp = statistics.median(seconds["bare"][1:]), statistics.median(seconds["ddp"][1:])
    return {"preset": preset, "device": str(dev), "batch": batch, "steps_per_sample": steps, "samples": repeats - 1,
            "bare_seconds_per_step": bare, "ddp_seconds_per_step": ddp, "ddp_over_bare": ddp / bare,
            "samples_bare": seconds["bare"], "samples_ddp": seconds["ddp"]}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("node_ranks", __doc__, "tiny preset, the wrapper overhead only")
    parser.add_argument("--work", default="", help="keep each deployment's logs here (default: a temporary folder)")
    parser.add_argument("--device", default="cpu", help="where the overhead part trains (cuda: NCCL)")
    parser.add_argument("--preset", default="", help="model of the overhead part (default 16m; quick tiny)")
    parser.add_argument("--overhead-only", action="store_true", help="skip the deployments (a GPU machine)")
    args = parser.parse_args(argv)
    result = result_header("node_ranks", args.quick, {"model": MODEL, "cases": CASES, "link": "1gbit"})
    if args.quick:
        result["overhead"] = wrapper_overhead(args.preset or "tiny", 4, 4, 5, args.device)
    else:
        result["overhead"] = wrapper_overhead(args.preset or "16m", 8, 8, 9, args.device)
    if not args.quick and not args.overhead_only:
        result["bytes"] = []
        with tempfile.TemporaryDirectory(prefix="node_ranks_") as tmp:
            for nodes, ranks in CASES:
                work = Path(args.work or tmp) / f"n{nodes}r{ranks}"
                result["bytes"].append(bytes_case(nodes, ranks, work))
                write_json(result, args.out)
        print_rows(f"{'nodes':>5} {'ranks':>5} {'windows':>7} {'down/node':>10} {'up/node':>10} {'WAN/round':>11}",
                   [f"{c['nodes']:>5} {c['ranks_per_node']:>5} {c['windows_per_step']:>7} {c['down_bytes_per_node']:>10,.0f} "
                    f"{c['up_bytes_per_node']:>10,.0f} {c['wan_bytes_per_round']:>11,.0f}" for c in result["bytes"]])
    o = result["overhead"]
    print(f"wrapper: {o['ddp_seconds_per_step'] * 1e3:.1f} ms/step through DDP against {o['bare_seconds_per_step'] * 1e3:.1f} "
          f"bare ({o['ddp_over_bare']:.3f}x; {o['preset']}, batch {o['batch']})")
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
