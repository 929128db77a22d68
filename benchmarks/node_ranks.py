"""Nodes of several ranks: bytes on the WAN per node, and what the intra-node wrapper costs a step.

1. **Bytes.** Real deployments by `lordo-emulate` (each node in its own network namespace, 1 Gb/s
   links, node workers; lordo_fed.wan.emulate `--ranks-per-node`), LoRDO-Global, small preset, the
   same total batch each way: 1 node of 2 ranks against 2 one-rank nodes, and 2 nodes of 2 ranks
   against 4 one-rank nodes. Bytes are the server's own counts of what each node received and sent
   (server.jsonl), per round and summed over the nodes.
2. **Wrapper overhead.** One process, one rank: LoRDO-Local local steps of the 16m preset through DDP and
   through FSDP2 (gloo, world size 1; NCCL with `--device cuda`) against the bare model, alternated,
   median of each and median of the side-by-side ratios (the issue's ≤ 5%; `benchmarks/gpu_check.py --only ranks` takes it on a GPU, 125m).
3. **Memory per rank.** Two gloo ranks of one node, 16m, after two LoRDO-Local steps: the bytes each
   rank holds of θ, its gradients and the optimizer state (E, moments, bases), DDP against FSDP2.

    sudo .venv/bin/python benchmarks/node_ranks.py          # ~4 min on 2 cores
    sudo .venv/bin/python benchmarks/node_ranks.py --quick  # tiny preset: the overhead part only (the tests run it)
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
    """Seconds per local step through each intra-node wrapper (one rank: gloo, or NCCL on CUDA) and
    through the bare model, alternated (each sample ends in the loss's host read: the GPU's work is
    in it)."""
    import torch
    import torch.distributed as dist

    from lordo_fed.data import TokenShard
    from lordo_fed.rounds.methods import make_worker, resolve_method
    from lordo_fed.model import ModelConfig, build_model, lowrank_parameter_names
    from lordo_fed.node.ranks import LocalRanks
    from lordo_fed.optim.config import InnerConfig
    from lordo_fed.rounds.outer import OuterConfig
    from lordo_fed.rounds.config import RoundConfig

    import numpy as np

    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{tmp}/rdv", rank=0,
                                world_size=1)
        try:
            # one phase, as its figures were measured (LoRDO-Local's own switch needs a run length)
            s = resolve_method("lordo_local", InnerConfig(rank=16, switch_fraction=0.0), RoundConfig(local_steps=steps),
                               OuterConfig())
            shard = TokenShard(np.random.default_rng(0).integers(0, 256, size=1 << 18), shard_id=0)
            workers = {}
            for name, ranks in (("bare", None), ("ddp", LocalRanks(0, 1)), ("fsdp", LocalRanks(0, 1, "fsdp"))):
                torch.manual_seed(0)
                model = build_model(ModelConfig(preset=preset), 256).to(dev)
                workers[name] = make_worker(0, model, s, shard, lowrank_parameter_names(model), 10 ** 6, batch, 128,
                                            seed=0, ranks=ranks)
            seconds: dict[str, list[float]] = {name: [] for name in workers}
            names = list(workers)
            for i in range(repeats):
                for name in names[i % 3:] + names[:i % 3]:  # each first, second and last in turn
                    w = workers[name]
                    started = time.perf_counter()
                    w.local_steps(w.cursor, steps)
                    seconds[name].append((time.perf_counter() - started) / steps)
        finally:
            dist.destroy_process_group()
    median = {name: statistics.median(values[1:]) for name, values in seconds.items()}
    out = {"preset": preset, "device": str(dev), "batch": batch, "steps_per_sample": steps, "samples": repeats - 1}
    for name in seconds:
        out[f"{name}_seconds_per_step"] = median[name]
        if name != "bare":
            out[f"{name}_over_bare"] = median[name] / median["bare"]
            # the median of the ratios of samples taken side by side: robust to the machine's drift
            out[f"{name}_over_bare_paired"] = statistics.median(
                a / b for a, b in zip(seconds[name][1:], seconds["bare"][1:]))
    return {**out, **{f"samples_{name}": values for name, values in seconds.items()}}


def _held_main(rank: int, rendezvous: str, preset: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from lordo_fed.data import TokenShard
    from lordo_fed.rounds.methods import make_worker, resolve_method
    from lordo_fed.model import ModelConfig, build_model, lowrank_parameter_names
    from lordo_fed.node.ranks import WRAPPERS, LocalRanks, exit_rank
    from lordo_fed.optim.config import InnerConfig
    from lordo_fed.optim.sharded import local
    from lordo_fed.rounds.outer import OuterConfig
    from lordo_fed.rounds.config import RoundConfig

    import numpy as np

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    held = {}
    s = resolve_method("lordo_local", InnerConfig(rank=16, switch_fraction=0.0), RoundConfig(local_steps=2), OuterConfig())
    shard = TokenShard(np.random.default_rng(0).integers(0, 256, size=1 << 16), shard_id=0)
    for wrapper in WRAPPERS:
        torch.manual_seed(0)
        model = build_model(ModelConfig(preset=preset), 256)
        worker = make_worker(0, model, s, shard, lowrank_parameter_names(model), 100, 2, 64, seed=0,
                             ranks=LocalRanks(rank, 2, wrapper))
        for i in range(2):
            worker.forward_backward(i)
            grads = sum(local(p.grad).numel() * 4 for p in worker.params.values() if p.grad is not None)
            worker.clip_and_step(i)
        worker.optimizer.sync_state()
        theta = sum(local(p).numel() * 4 for p in worker.params.values())
        state = sum(t.numel() * t.element_size() for st in worker.optimizer.state.values()
                    for t in st.values() if torch.is_tensor(t) and t.ndim)
        held[wrapper] = {"theta_bytes": theta, "grad_bytes": grads, "optimizer_state_bytes": state,
                         "total_bytes": theta + grads + state}
    torch.save(held, f"{out}.{rank}")
    dist.barrier()  # neither rank closes its connections while the other still waits in a collective
    exit_rank(0)  # not through the interpreter's finalization, which gloo's threads can abort (node/ranks.py)


def held_per_rank(preset: str) -> dict[str, Any]:
    """Bytes each of a node's two ranks holds of θ, gradients and optimizer state, per wrapper
    (two gloo processes; the gradients as they are before the optimizer step)."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_held_main, args=(f"{tmp}/rdv", preset, f"{tmp}/held"), nprocs=2, join=True)
        ranks = [torch.load(f"{tmp}/held.{r}") for r in range(2)]
    return {"preset": preset, "ranks": ranks,
            "fsdp_over_ddp": max(r["fsdp"]["total_bytes"] for r in ranks) / ranks[0]["ddp"]["total_bytes"]}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("node_ranks", __doc__, "tiny preset, the wrapper overhead only")
    parser.add_argument("--work", default="", help="keep each deployment's logs here (default: a temporary folder)")
    parser.add_argument("--device", default="cpu", help="where the overhead part trains (cuda: NCCL)")
    parser.add_argument("--preset", default="", help="model of the overhead part (default 16m; quick tiny)")
    parser.add_argument("--overhead-only", action="store_true", help="skip the deployments (a GPU machine)")
    args = parser.parse_args(argv)
    result = result_header("node_ranks", args.quick, {"model": MODEL, "cases": CASES, "link": "1gbit"})
    if args.quick:
        result["overhead"] = wrapper_overhead(args.preset or "tiny", 4, 4, 6, args.device)
    else:
        result["overhead"] = wrapper_overhead(args.preset or "16m", 8, 8, 10, args.device)
    if args.device == "cpu":
        result["held"] = held_per_rank(args.preset or ("tiny" if args.quick else "16m"))
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
    for name in ("ddp", "fsdp"):
        print(f"wrapper: {o[f'{name}_seconds_per_step'] * 1e3:.1f} ms/step through {name} against "
              f"{o['bare_seconds_per_step'] * 1e3:.1f} bare ({o[f'{name}_over_bare']:.3f}x; side by side "
              f"{o[f'{name}_over_bare_paired']:.3f}x; {o['preset']}, batch {o['batch']})")
    if "held" in result:
        h = result["held"]["ranks"][0]
        print(f"held per rank ({result['held']['preset']}): ddp {h['ddp']['total_bytes']:,} B, fsdp {h['fsdp']['total_bytes']:,} B "
              f"({result['held']['fsdp_over_ddp']:.3f}x)")
    write_json(result, args.out)
    return 0


if __name__ == "__main__":
    from lordo_fed.node.ranks import exit_rank

    # wrapper_overhead's process group (destroyed) leaves gloo's threads running: the interpreter's
    # finalization can abort the process under them (lordo_fed/node/ranks.py)
    exit_rank(main())
