"""Server memory of one aggregation at M = 2, 4, 8 replies: every reply in memory, or streamed.

The server's round (docs/algorithm.md, "One round", step 3) averages M replies, each a
full-size pseudo-gradient Δ plus the due moments. Two ways to do it over the same replies:

- list: today's path. Every reply is decoded into memory (`decode_update`) and the list
  handed to `Aggregator.aggregate`: memory grows with M.
- stream: each reply is decoded on arrival, checked (`Aggregator.check_reply`) and dropped,
  keeping a `ReplyRef` whose `load` decodes its file again; `screen_round` applies the round's
  rules and `Aggregator.aggregate_refs` loads one reply at a time into fp32 accumulators:
  memory should be θ + outer state + accumulators + about one reply, whatever M.

Set-up: the preset's real model (LoRDO-Global, `make_aggregator`, rank dim/8, both moments due,
projections refitted from Δ̄ by `--proj-method`). The replies are random tensors of the shapes a
worker sends (Δ of every parameter, u and v low-rank for the low-rank matrices and full-size for
the rest), tokens differing per worker, each encoded fp32 with `encode_update` to a file
written before any measurement. Each (path, M) runs in a fresh interpreter: it builds the
aggregator, then resets its peak-RSS mark (writing 5 to /proc/self/clear_refs) so that the peak
read afterwards (VmHWM) is the round's alone, receives the M replies from their files and
aggregates. Both paths must end at the same θ (sha256 of its bytes): the streaming path is
bit-identical to the list path.

    python benchmarks/server_memory.py           # 125m (byte vocabulary), M = 2, 4, 8
    python benchmarks/server_memory.py --quick   # 16m, M = 2, 4
Writes benchmarks/results/server_memory.json.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import tempfile
import time
import weakref
from functools import partial
from pathlib import Path

import torch

from lordo_fed.wire import codec
from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import encode_update
from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.bases import low_rank_shape
from lordo_fed.rounds.methods import MethodSettings, lowrank_ranks, make_aggregator, resolve_method
from lordo_fed.metrics import peak_rss_bytes
from lordo_fed.model import ModelConfig, build_model, count_parameters
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.rounds.screening import ReplyRef
from lordo_fed.wire.messages import WorkerUpdate, moment_key
from lordo_fed.rounds.config import RoundConfig

try:
    from benchmarks.common import BYTE_VOCAB, RANKS, human_bytes, make_parser, print_rows, result_header, write_json
    from benchmarks.common import run_child as common_run_child
except ImportError:  # run as `python benchmarks/server_memory.py` without the repo root on sys.path
    from common import BYTE_VOCAB, RANKS, human_bytes, make_parser, print_rows, result_header, write_json
    from common import run_child as common_run_child

PATHS = ("list", "stream")
LOCAL_STEPS = 32


def _settings(preset: str, proj_method: str, outer: str) -> MethodSettings:
    inner = InnerConfig(rank=RANKS[preset], init_projection="random", proj_method=proj_method)
    return resolve_method("lordo_global", inner, RoundConfig(local_steps=LOCAL_STEPS), OuterConfig(name=outer))


def _ranks(model: torch.nn.Module, preset: str) -> dict[str, int]:
    return lowrank_ranks(model, ModelConfig(preset=preset).lowrank_pattern, RANKS[preset], "lordo")


# ---------------------------------------------------------------------------------------------
# the replies (parent process)


def random_update(shapes: dict[str, tuple[int, ...]], ranks: dict[str, int], rounds: RoundConfig, worker: int,
                  round_idx: int = 1, opt_step: int = LOCAL_STEPS) -> WorkerUpdate:
    """A reply of random tensors with the shapes a worker sends in `round_idx`: Δ of every
    parameter, and the moments `rounds` has due, low-rank (`ranks`) or full-size; round 0 is
    LoRDO-Global's gradient reply (the low-rank weights' gradients only)."""
    gen = torch.Generator().manual_seed(1000 * round_idx + worker)
    if round_idx == 0:
        return WorkerUpdate(worker_id=worker, round=0, delta={n: torch.randn(shapes[n], generator=gen) for n in ranks},
                            moments={}, tokens=4096 * (worker + 1), opt_step=0)
    delta = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    moments = {}
    for n, s in shapes.items():
        low = low_rank_shape(s, ranks[n]) if n in ranks else s
        for kind in rounds.due(round_idx, n in ranks):
            moments[moment_key(kind, n)] = (torch.rand(low, generator=gen) * 1e-6 + 1e-8 if kind == "exp_avg_sq"
                                            else torch.randn(low, generator=gen) * 1e-3)
    return WorkerUpdate(worker_id=worker, round=round_idx, delta=delta, moments=moments, tokens=4096 * (worker + 1),
                        opt_step=opt_step, metrics={"train_loss": 5.0 + 0.1 * worker})


def write_replies(spec: dict, count: int, folder: Path) -> dict:
    """Encode `count` round-1 replies of random tensors with the shapes a worker of `spec`'s
    preset sends, one file each (one reply in memory at a time). Returns their paths and sizes."""
    with torch.device("meta"):
        model = build_model(ModelConfig(preset=spec["preset"]), spec["vocab_size"])
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ranks = _ranks(model, spec["preset"])
    rounds = _settings(spec["preset"], spec["proj_method"], spec["outer"]).rounds
    model_id = codec.model_id(dict(model.named_parameters()))
    paths, sizes = [], []
    for worker in range(count):
        update = random_update(shapes, ranks, rounds, worker)
        path = folder / f"reply_{worker}.bin"
        path.write_bytes(encode_update(update, model_id, "fp32"))
        paths.append(str(path))
        sizes.append(path.stat().st_size)
        del update
    return {"paths": paths, "sizes": sizes, "model_id": model_id, "num_params": count_parameters(model),
            "param_bytes": 4 * count_parameters(model), "ranks": len(ranks)}


# ---------------------------------------------------------------------------------------------
# one aggregation (child process)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """Reset this process's peak-RSS mark (VmHWM) to its current RSS (Linux >= 4.0), so that the
    next read of the peak covers only what follows. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _stage() -> dict[str, int]:
    """Peak since the last reset and current resident set, in bytes."""
    return {"peak": peak_rss_bytes(), "rss": _status_bytes("VmRSS")}


class LoadCounter:
    """Loads of spooled replies, and the most of them alive at once (a loaded reply is alive while
    any of its tensors is): the evidence that streaming holds one reply at a time."""

    def __init__(self) -> None:
        self.loaded: list[list[weakref.ref]] = []
        self.max_alive = 0

    @property
    def loads(self) -> int:
        return len(self.loaded)

    def load(self, path: str, model_id: str) -> WorkerUpdate:
        update = decode_update(Path(path).read_bytes(), model_id)
        self.loaded.append([weakref.ref(t) for t in (*update.delta.values(), *update.moments.values())])
        self.max_alive = max(self.max_alive, sum(any(r() is not None for r in refs) for refs in self.loaded))
        return update


def receive_and_stream(agg: Aggregator, paths: list[str], model_id: str, counter: LoadCounter) -> dict:
    """What a streaming server does: check each reply as it arrives, keep its ref, drop its
    tensors; then the round's rules and one pass that loads each usable reply once."""
    refs, norms, reasons = [], [], []
    for path in paths:
        update = decode_update(Path(path).read_bytes(), model_id)
        reason, norm = agg.check_reply(update)
        refs.append(ReplyRef.of(update, load=partial(counter.load, path, model_id)))
        norms.append(norm)
        reasons.append(reason)
        del update
    received = _stage()
    reasons = agg.screen_round([r.worker_id for r in refs], norms, reasons)
    usable = [r for r, why in zip(refs, reasons) if why is None]
    rejected = {r.worker_id: why for r, why in zip(refs, reasons) if why is not None}
    result = agg.aggregate_refs(usable, rejected)
    return {"after_receive": received, "accepted": result.accepted, "tokens": result.metrics["tokens"]}


def receive_and_aggregate_list(agg: Aggregator, paths: list[str], model_id: str) -> dict:
    """Today's server: decode every reply into memory, then aggregate the list."""
    updates = [decode_update(Path(path).read_bytes(), model_id) for path in paths]
    received = _stage()
    result = agg.aggregate(updates)
    del updates
    return {"after_receive": received, "accepted": result.accepted, "tokens": result.metrics["tokens"]}


def theta_digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over θ's bytes in name order: equal digests mean bit-identical global models."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(memoryview(params[name].contiguous().numpy()).cast("B"))
    return h.hexdigest()


def child(spec: dict) -> dict:
    """One aggregation of M replies by one path, in this (fresh) process; RSS per stage."""
    torch.set_num_threads(1)
    stages = {"after_import": _stage()}
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=spec["preset"]), spec["vocab_size"])
    agg = make_aggregator(model, _settings(spec["preset"], spec["proj_method"], spec["outer"]),
                          _ranks(model, spec["preset"]), seed=0)
    del model
    gc.collect()
    stages["after_setup"] = _stage()
    reset = _reset_peak()
    paths = spec["paths"][:spec["M"]]
    started = time.perf_counter()
    counter = LoadCounter()
    if spec["path"] == "stream":
        out = receive_and_stream(agg, paths, spec["model_id"], counter)
    else:
        out = receive_and_aggregate_list(agg, paths, spec["model_id"])
    seconds = time.perf_counter() - started
    gc.collect()
    stages["after_aggregate"] = _stage()
    stages["after_receive"] = out.pop("after_receive")
    return {"stages": stages, "peak_reset": reset, "round_peak_bytes": stages["after_aggregate"]["peak"],
            "setup_rss_bytes": stages["after_setup"]["rss"], "seconds": seconds,
            "loads": counter.loads if spec["path"] == "stream" else len(paths),
            "max_replies_loaded": counter.max_alive if spec["path"] == "stream" else len(paths),
            "theta_sha256": theta_digest(agg.params), **out}


def run_child(spec: dict) -> dict:
    return common_run_child(__file__, spec, f"{spec['path']} M={spec['M']}", timeout=900)


# ---------------------------------------------------------------------------------------------
# output


def print_table(rows: list[dict], model_bytes: int, reply_bytes: int) -> None:
    print(f"model (fp32 θ): {human_bytes(model_bytes)}; one reply (encoded Δ + moments): {human_bytes(reply_bytes)}")
    print_rows(f"{'path':6} {'M':>2} {'after setup':>12} {'round peak':>11} {'peak - setup':>12} "
               f"{'x reply':>7} {'max loaded':>10} {'seconds':>8}",
               (f"{r['path']:6} {r['M']:>2} {r['setup_rss_bytes'] / 1e6:9.0f} MB {r['round_peak_bytes'] / 1e6:8.0f} MB "
                f"{r['peak_over_setup_bytes'] / 1e6:9.0f} MB {r['peak_over_setup_bytes'] / reply_bytes:7.2f} "
                f"{r['max_replies_loaded']:>10} {r['seconds']:8.1f}" for r in rows))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = make_parser("server_memory", __doc__, "16m preset, M = 2 and 4 (seconds, not minutes)")
    parser.add_argument("--proj-method", default="svd", choices=("svd", "rsvd", "dct"),
                        help="how the server refits the shared projections (default: %(default)s)")
    parser.add_argument("--outer", default="average", choices=("average", "qhm", "nesterov"),
                        help="outer optimizer; qhm and nesterov keep a full-size momentum (default: %(default)s)")
    args = parser.parse_args()
    preset, ms = ("16m", (2, 4)) if args.quick else ("125m", (2, 4, 8))
    spec = {"preset": preset, "vocab_size": BYTE_VOCAB, "proj_method": args.proj_method, "outer": args.outer}
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="server_memory_") as tmp:
        replies = write_replies(spec, max(ms), Path(tmp))
        for m in ms:
            for path in PATHS:
                row = run_child({**spec, "path": path, "M": m, "paths": replies["paths"],
                                 "model_id": replies["model_id"]})
                row.update(path=path, M=m, peak_over_setup_bytes=row["round_peak_bytes"] - row["setup_rss_bytes"])
                rows.append(row)
    for m in ms:
        same = {r["theta_sha256"] for r in rows if r["M"] == m}
        if len(same) != 1:
            raise AssertionError(f"M={m}: the list and streaming paths ended at different θ")
    reply_bytes = max(replies["sizes"])
    config = {**spec, "M": list(ms), "rank": RANKS[preset], "local_steps": LOCAL_STEPS, "method": "lordo_global",
              "num_params": replies["num_params"], "model_bytes": replies["param_bytes"],
              "model_mb": replies["param_bytes"] / 1e6, "reply_bytes": reply_bytes, "reply_mb": reply_bytes / 1e6,
              "lowrank_matrices": replies["ranks"],
              "notes": ["round_peak_bytes: VmHWM of a fresh process, reset (clear_refs 5) after the aggregator "
                        "was built, read after receiving and aggregating the M replies",
                        "setup_rss_bytes: VmRSS once the aggregator holds θ and the round-1 projections "
                        "(the model it was built from released)",
                        "reply_bytes: one encoded reply on disk (fp32 Δ of every parameter, u and v)",
                        "max_replies_loaded: the most decoded replies alive at once during aggregation "
                        "(weak references on their tensors; the list path holds all M)",
                        "both paths end at the same θ (theta_sha256), checked for every M"]}
    result = result_header("server_memory", args.quick, config)
    result["seconds"] = time.perf_counter() - t0
    result["rows"] = rows
    result["summary"] = {"round_peak_mb": {path: {str(r["M"]): r["round_peak_bytes"] / 1e6 for r in rows
                                                  if r["path"] == path} for path in PATHS},
                         "model_mb": replies["param_bytes"] / 1e6, "reply_mb": reply_bytes / 1e6}
    out = write_json(result, args.out)
    print_table(rows, replies["param_bytes"], reply_bytes)
    print(f"written {out}")


if __name__ == "__main__":
    main()
