"""Compressed payloads (issue 14): bytes on the wire, the perplexity they cost, and whether they
pay for their encoding time.

1. **bytes**: LoRDO-Global's steady-state round (every sync period passed) for 16m, 125m and 720m
   with the GPT-2 vocabulary, K = 8, 32, 128, each payload preset (`lordo_fed.wire.payload`) and
   `dense_sync_factor` F = 1 and 4. The round's two messages are built with the model's true
   shapes, every compressed tensor laid out as the codec lays it out (a compressed tensor's size
   depends on its shape and codec only, `part_sizes`, tested against `encode`), serialized with
   `lordo_fed.wire.encode` and measured with len(): up (Δ, the due moments) and down (θ or its change,
   the bases, the averaged moments), per worker per step, and the ratio to fp32 DDP (a gradient of
   4 bytes per parameter up and the averaged one down, every step). fp32 messages over protobuf's
   2 GiB limit (720m) are counted by their tensor bytes.
2. **time**: one round's encoding and decoding at 125m on this CPU (the worker compresses Δ with
   error feedback and its moments and encodes the reply, a relaying worker also keeps it as relayed,
   `worker_keep_s`; the server decodes it; the server encodes
   the downlink, the worker decodes it), against the time the bytes it saves take on a 1 Gb/s link;
   and the state a compressed preset adds to a worker (Δ's residual, the clients' copy θ_c).
   **refit**: the server's refit of LoRDO-Global's bases at 125m (exact SVD, randomized SVD, DCT
   columns) against the link time of a lean top-k round at 1 Gb/s and 100 Mb/s.
   **server**: the server's side of one top-k round at 125m with M = 2, 4, 8 replies (`diloco-sparse`,
   `sparseloco`, and `diloco-sparse` with the relay down): screening (decode, check), aggregation (the
   sums, the outer step, θ's compressed change and the clients' copy) and the next state's encoding, each
   reply decoded once into `SparseValues` against decoded to dense fp32 on arrival and again when the
   sums load it, side by side, on one CPU thread (`--server-threads 1,2`: thread counts interleaved).
3. **quality**: LoRDO-Global on `examples/reference/quality_cpu.yaml` (small preset, M = 4,
   rank 16) at K = 8 for 32 rounds, each compressed preset against fp32, seeds 0 and 1; fp32 and
   int8 also with the full-size moments synced every 4th round (`dense_sync_factor` = 4).
4. `--plot RESULT.json` redraws a result's figure and measures nothing.

    python benchmarks/compression.py                 # all of them (~40 min on 2 cores)
    python benchmarks/compression.py --parts bytes,time
    python benchmarks/compression.py --parts bytes --states lean --payloads fp32,topk1bit-relay --relay-m 8  # the relay at M = 8
    python benchmarks/compression.py --parts server --server-presets relay --server-threads 1,2
    python benchmarks/compression.py --quick         # 16m bytes at K = 32, tiny time and quality
Writes benchmarks/results/compression.json and compression.png.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path


import torch

from lordo_fed.wire import codec
from lordo_fed.wire.decode import decode_global_state, decode_update
from lordo_fed.wire.encode import encode_global_state, encode_update
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.downlink import Downlink
from lordo_fed.rounds.relay import for_worker, relayed_form, relayed_of, replay
from lordo_fed.rounds.screening import ReplyRef
from lordo_fed.optim.projection import projection_side
from lordo_fed.wire import lowrank
from lordo_fed.wire.compress import Encoded, ErrorFeedback, encode, part_sizes
from lordo_fed.wire.positions import expected_position_bytes
from lordo_fed.wire.payload import PAYLOADS, resolve_payload

try:
    from benchmarks.common import (GPT2_VOCAB, RANKS, make_parser, new_figure, png_path, result_header,
                                   stop_children_on_sigterm, write_json)
    from benchmarks.communication import ModelShapes, _sync_period
except ImportError:  # run as `python benchmarks/compression.py`
    from common import (GPT2_VOCAB, RANKS, make_parser, new_figure, png_path, result_header, stop_children_on_sigterm,
                        write_json)
    from communication import ModelShapes, _sync_period

ROOT = Path(__file__).resolve().parents[1]
LINK_BYTES_PER_S = 1e9 / 8
"""A 1 Gb/s link."""
QUALITY = ["model.preset=small", "rounds.local_steps=8", "total_steps=256", "eval_every=4"]
"""32 rounds of K = 8 on quality_cpu.yaml's small preset (M = 4, rank 16; 1.05 M tokens)."""


ROW_SHARE = 1.0
"""Row-sparse presets: the share of the embedding's rows a round sends (data-dependent: `--row-share`)."""


def layout(spec, shape: tuple[int, ...]) -> Encoded:
    """A compressed tensor of `shape` as the codec lays it out (zero bytes of the right sizes);
    a row-sparse one with `ROW_SHARE` of its rows; Rice-coded top-k positions at their expected size
    for uniformly spread positions (`expected_position_bytes`: within 1% of real encodings of iid values)."""
    n = math.prod(shape)
    if spec.kind == "rows":
        spec = dataclasses.replace(spec, topk=round(ROW_SHARE * shape[0]))
    a, b, c = part_sizes(spec, n, tuple(shape))
    if spec.kind == "topk":  # Rice-coded positions: their expected size for uniformly spread positions
        c = expected_position_bytes(n, spec.chunk, spec.k, spec.index_coding)
    return Encoded(spec, n, bytes(a), bytes(b), bytes(c), tuple(shape))


LEAN = {"sync_exp_avg_every": 0, "sync_exp_avg_sq_every": 0}
"""No moments on the wire (each worker keeps its own)."""
STATES = {"synced": (False, "svd"), "lean": (True, "dct"), "nomoments": (True, "svd"), "clientfit": (True, None)}
"""`--states`: what else a round carries besides θ and Δ, as (moments kept local, bases): 'synced' the
moments as the method syncs them and fp32 SVD bases; 'lean' no moments, the bases as DCT column indices
(`inner.proj_method=dct`); 'nomoments' no moments, SVD bases; 'clientfit' no moments and no bases
(`bases-from=downlink`: each worker fits them to the downlink's change, from round 2 on)."""


def round_messages(ms: ModelShapes, payload: str, k: int, factor: int, t: int,
                   state_kind: str = "synced") -> tuple[WorkerUpdate, GlobalState]:
    """LoRDO-Global's reply and next state in round t, as they travel with `payload` and `state_kind`
    (`STATES`)."""
    local_moments, bases = STATES[state_kind]
    settings = resolve_method("lordo_global", InnerConfig(rank=ms.rank),
                              RoundConfig(local_steps=k, dense_sync_factor=factor, **(LEAN if local_moments else {})),
                              OuterConfig())
    rounds = settings.rounds
    codecs = resolve_payload(payload).codecs
    params = ms.params()
    up_moments, down_moments = ms.moments(rounds, t, True), ms.moments(rounds, t - 1, True)
    coords = {}
    if codecs is not None:
        # a `lowrank+` preset: the matrices with a shared basis send coordinates (r x q or p x r) and a residual
        delta = {n: layout(codecs.delta_spec(n, tuple(p.shape)), p.shape) for n, p in params.items()}
        if codecs.lowrank is not None:
            coords = {n: layout(codecs.lowrank, ms.moment_shape(n, True)) for n in ms.ranks}
        up_moments = {key: layout(codecs.moment_spec(key), v.shape) for key, v in up_moments.items()}
        down_moments = {key: layout(codecs.moment_spec(key), v.shape) for key, v in down_moments.items()}
        theta = {n: layout(codecs.down, p.shape) for n, p in params.items()} if codecs.down is not None else {}
    else:
        delta, theta = params, params
    update = WorkerUpdate(worker_id=0, round=t, delta=delta, moments=up_moments, tokens=4096 * k, opt_step=t * k,
                          metrics={"train_loss": 3.0, "train_loss_last": 3.0, "lr": 1e-3}, coords=coords)
    state = GlobalState(round=t, params=theta, projections=ms.projections(bases) if bases else {}, moments=down_moments,
                        opt_step=(t - 1) * k, params_delta=codecs is not None)
    return update, state


def message_bytes(msg, ms: ModelShapes, payload: str) -> tuple[int, bool]:
    """(len of the serialized message, whether it was counted by tensor bytes: over 2 GiB)."""
    dtype = resolve_payload(payload).wire_dtype
    if codec.tensors_nbytes(msg, dtype) > 2 ** 31 - (64 << 20):
        return codec.tensors_nbytes(msg, dtype), True
    data = (encode_update(msg, ms.model_id, dtype) if isinstance(msg, WorkerUpdate)
            else encode_global_state(msg, ms.model_id, dtype))
    return len(data), False


RELAY_M = 4
"""Workers whose replies a relaying preset's state carries (`topk2bit-relay`, issue 30's option B: each
worker replays the round, lordo_fed.rounds.relay). The state a node gets leaves out its own reply, which the
node kept (`relay.for_worker`): the other M − 1 replies, each as the state's `relay` field carries it (Δ only:
no moments, no metrics), and the two fields naming the one left out (`node_state`). (docs/results.md, section
12, part nine, counted M = 8 with every reply in one state for all.)"""


def bytes_table(presets: list[str], ks: list[int], factors: list[int], payloads: list[str],
                states: tuple[str, ...] = ("synced",), relay_m: int = RELAY_M) -> list[dict]:
    """Bytes per step of each preset x K x F x payload x state ('synced': SVD bases and the moments
    as the method syncs them; the others: `STATES`); `relay_m`: a relaying preset's workers (M)."""
    rows = []
    for preset in presets:
        ms = ModelShapes(preset, GPT2_VOCAB, RANKS[preset])
        ddp = 2 * 4 * ms.num_params  # fp32 gradient up and down, per step
        for factor, k, state_kind in ((f, k, s) for f in factors for k in ks for s in states):
            local_moments = STATES[state_kind][0]
            if local_moments and factor != 1:
                continue  # no moments: F has nothing to thin
            settings = RoundConfig(local_steps=k, dense_sync_factor=factor, **(LEAN if local_moments else {}))
            cycle = _sync_period(settings)
            for payload in payloads:
                codecs = resolve_payload(payload).codecs
                if state_kind == "clientfit" and (codecs is None or codecs.down is None or codecs.lowrank is not None):
                    continue  # bases from the downlink need a compressed downlink and no low-rank Δ (refused)
                up = down = 0.0
                estimated = False
                for t in range(cycle + 1, 2 * cycle + 1):
                    update, state = round_messages(ms, payload, k, factor, t, state_kind)
                    n_up, e_up = message_bytes(update, ms, payload)
                    if codecs is not None and codecs.relay:  # the state a node gets: the other workers' replies
                        state = node_state(state, update, relay_m)
                    n_down, e_down = message_bytes(state, ms, payload)
                    up, down, estimated = up + n_up, down + n_down, estimated or e_up or e_down
                up, down = up / cycle, down / cycle
                per_step = (up + down) / k
                rows.append({"preset": preset, "params": ms.num_params, "K": k, "dense_sync_factor": factor,
                             "payload": payload, "states": state_kind, "up_bytes_per_round": up, "down_bytes_per_round": down,
                             "bytes_per_step": per_step, "ddp_fp32_bytes_per_step": ddp,
                             "reduction_vs_ddp_fp32": ddp / per_step, "tensor_bytes_only": estimated,
                             **({"row_share": ROW_SHARE} if "rows" in payload else {}),
                             **({"M": relay_m} if codecs is not None and codecs.relay else {})})
        del ms
    return rows


def node_state(state: GlobalState, update: WorkerUpdate, workers: int = RELAY_M) -> GlobalState:
    """The relaying `state` as worker 0's node gets it, `workers` workers having sent `update` (Δ only)."""
    replies = [dataclasses.replace(relayed_form(update), worker_id=m) for m in range(workers)]
    return for_worker(dataclasses.replace(state, relay=replies, outer_lr=1.0), 0)


SERVER_PRESETS: dict[str, dict[str, str]] = {
    "diloco-sparse": {"preset": "diloco-sparse"}, "sparseloco": {"preset": "sparseloco"},
    "relay": {"preset": "diloco-sparse", "payload-dtype": "topk2bit-relay"}}
"""The setups the server part times (run config): every tensor top-k up, θ's change top-k down, the mean
over all workers, against SparseLoCo's contributor mean; and `diloco-sparse` with the relay down (option
B: no re-sparsification; the state carries the M replies as received, read the sparse way only)."""
SERVER_PATHS = ("sparse-once", "dense-twice")
"""How the server reads a top-k reply: decoded once into its kept values and positions (`SparseValues`,
server/courier.py), or to dense fp32 on arrival (screening) and again when the sums load it."""


def server_times(model: str, workers: tuple[int, ...], repeats: int = 3, presets: tuple[str, ...] = tuple(SERVER_PRESETS),
                 threads: tuple[int, ...] = (1,)) -> list[dict]:
    """The server's side of one round per preset, M, reading (`SERVER_PATHS`) and CPU thread count, the
    readings and thread counts interleaved `repeats` times and each phase's fastest pass kept."""
    from lordo_fed.app.config import load_app_config
    from lordo_fed.rounds.build import build_run

    unknown = [p for p in presets if p not in SERVER_PRESETS]
    if unknown or not presets or min(threads, default=0) < 1:
        raise ValueError(f"server part: presets {list(presets)} and threads {list(threads)}: expected some of "
                         f"{list(SERVER_PRESETS)} and thread counts >= 1")
    before = torch.get_num_threads()
    rows = []
    try:
        for name in presets:
            setup = SERVER_PRESETS[name]
            cfg = load_app_config({**setup, "model-preset": model})
            run = build_run(cfg, "diloco", vocab_size=GPT2_VOCAB, device=torch.device("cpu"))
            codecs, specs = run.payload.codecs, run.payload.receiver_specs
            params = {n: p.detach() for n, p in run.model.named_parameters()}
            g = torch.Generator().manual_seed(0)
            deltas = [{n: ErrorFeedback().compress(n, torch.randn(p.shape, generator=g) * 1e-3,
                                                   codecs.delta_spec(n, tuple(p.shape)))[0] for n, p in params.items()}
                      for _ in range(max(workers))]
            reply_bytes = len(encode_update(WorkerUpdate(0, 1, deltas[0], {}, 1, 1), run.model_id))
            for m in workers:
                best: dict[tuple[str, int], dict[str, float]] = {}
                theta: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
                paths = SERVER_PATHS[:1] if codecs.relay else SERVER_PATHS  # a relay reads replies the sparse way
                cases = [(path, t) for t in threads for path in paths]
                for _ in range(repeats):
                    for case in cases:
                        torch.set_num_threads(case[1])
                        agg = run.aggregator()
                        for _round in range(2):  # round 2 sends θ's change (round 1 sends θ whole)
                            times = _server_round(agg, deltas[:m], run.model_id, specs, case[0], run.payload.wire_dtype)
                        best[case] = {k: min(v, best.get(case, {}).get(k, math.inf)) for k, v in times.items()}
                        theta[case] = agg.params
                for path, t in cases:
                    # both readings at the same thread count end at the same θ (one reading: nothing to compare)
                    same = (all(torch.equal(theta[(paths[0], t)][n], x) for n, x in theta[(paths[-1], t)].items())
                            if len(paths) > 1 else None)
                    b = best[(path, t)]
                    rows.append({"preset": name, "model": model, "M": m, "path": path, "threads": t, "same_theta": same,
                                 **b, "server_s": b["screen_s"] + b["aggregate_s"],
                                 "server_with_encode_s": b["screen_s"] + b["aggregate_s"] + b["encode_s"]
                                 + b.get("encode_own_s", 0.0),
                                 "reply_bytes": reply_bytes})
    finally:
        torch.set_num_threads(before)
    return rows


def _server_round(agg, deltas: list[dict[str, Encoded]], model_id: str, specs, path: str,
                  wire_dtype: str) -> dict[str, float]:
    """One round of `server_times`: the replies encoded as nodes send them (not timed), then screened and
    aggregated as server/courier.py and the aggregator do (a relay keeps each reply as received, as
    `Courier.screened` does), then the next state encoded once for every node (`encode_s`); a relay also
    encodes each node's own state, its own reply left out (`encode_own_s`: the M encodes
    `LoRDOStrategy._own_states` adds)."""
    payloads = [bytes(encode_update(WorkerUpdate(m, agg.round, d, {}, 4096, 4), model_id)) for m, d in enumerate(deltas)]
    relay = agg.payload is not None and agg.payload.relay
    t0 = time.perf_counter()
    refs = []
    for data in payloads:
        update = decode_update(data, model_id, codecs=specs, sparse=path == "sparse-once")
        reason, norm = agg.check_reply(update)
        if reason is not None:
            raise RuntimeError(reason)
        load = None if path == "sparse-once" else (lambda data=data: decode_update(data, model_id, codecs=specs))
        # a relay sends on the bytes the sparse decode checked, as `Courier.screened` does (`relayed_of`)
        reply = relayed_of(update) if relay else None
        relayed = (lambda reply=reply: reply) if relay else None
        refs.append(ReplyRef.of(update, load=load, norm=norm, relayed=relayed))
        del update
    t1 = time.perf_counter()
    # θ_c after the last round's change is committed inside (`_commit_downlink`), once a round as in the
    # product; a relaying server keeps no θ_c (its replays give θ itself)
    agg.aggregate_refs(refs)
    t2 = time.perf_counter()
    shared = agg.global_state()
    state = encode_global_state(shared, model_id, wire_dtype)
    t3 = time.perf_counter()
    del state
    times = {"screen_s": t1 - t0, "aggregate_s": t2 - t1, "encode_s": t3 - t2}
    if relay and shared.relay:
        for m in range(len(deltas)):
            own = encode_global_state(for_worker(shared, m), model_id, wire_dtype)
            del own
        times["encode_own_s"] = time.perf_counter() - t3
    return times


def time_round(preset: str, payloads: list[str], repeats: int = 3) -> list[dict]:
    """Encode + decode of one round's messages with real tensors (random values), per payload:
    the payloads interleaved `repeats` times (the first pass also pays first-touch page faults),
    each phase's fastest pass kept."""
    runs: dict[str, list[dict]] = {p: [] for p in payloads}
    for _ in range(repeats):
        for payload in payloads:
            runs[payload].append(_time_once(preset, payload))
    rows, base = [], None
    for payload in payloads:
        row = {k: (min(r[k] for r in runs[payload]) if k.endswith("_s") else v) for k, v in runs[payload][0].items()}
        row["codec_s"] = row["worker_encode_s"] + row["server_decode_s"] + row["server_encode_s"] + row["worker_decode_s"]
        base = base or row
        saved = (base["up_bytes"] - row["up_bytes"]) + (base["down_bytes"] - row["down_bytes"])
        row["link_seconds_saved_1gbps"] = saved / LINK_BYTES_PER_S
        row["extra_codec_s"] = row["codec_s"] - base["codec_s"]
        row["pays_for_itself"] = row["link_seconds_saved_1gbps"] >= row["extra_codec_s"]
        rows.append(row)
    return rows


_SHAPES: dict[str, ModelShapes] = {}


def _time_once(preset: str, payload: str) -> dict:
    """One timed pass of `time_round`."""
    if preset not in _SHAPES:
        _SHAPES[preset] = ModelShapes(preset, GPT2_VOCAB, RANKS[preset])
    ms = _SHAPES[preset]
    rounds = RoundConfig(local_steps=32)
    params = ms.params()
    moments = ms.moments(rounds, 2, True)
    projections = ms.projections("svd")
    codecs = resolve_payload(payload).codecs
    dtype = resolve_payload(payload).wire_dtype
    t0 = time.perf_counter()
    bases = {n: (b, projection_side(ms.shapes[n])) for n, b in projections.items()}
    coords = {}
    if codecs is not None:  # the worker: Δ with error feedback (a `lowrank+` preset: coordinates + residual), the moments quantised
        ef = ErrorFeedback()
        delta = {}
        for n, p in params.items():
            if codecs.lowrank is not None and n in bases:
                delta[n], coords[n] = ef.compress_split(n, p, codecs.delta,
                                                        lambda t, b=bases[n]: lowrank.split(t, *b, codecs.lowrank))
            else:
                delta[n] = ef.compress(n, p, codecs.delta_spec(n, tuple(p.shape)))[0]
        up_moments = codecs.encode_moments(moments)
    else:
        delta, up_moments = params, moments
    reply = WorkerUpdate(0, 2, delta, up_moments, 4096, 64, coords=coords)
    up = encode_update(reply, ms.model_id, dtype)
    t_keep = time.perf_counter()
    relay = codecs is not None and codecs.relay  # the server forwards the M replies' Δ as it received them
    if relay:  # the worker keeps its reply as relayed, for the next state, which leaves it out
        Downlink(codecs, rounds).keep_reply(reply)
    t1 = time.perf_counter()
    received = decode_update(up, ms.model_id, codecs=resolve_payload(payload).receiver_specs)
    for n, c in received.coords.items():  # the server rebuilds Δ = P·Ĉ + R̂
        lowrank.join(received.delta[n], c, *bases[n])
    t2 = time.perf_counter()
    if codecs is not None:  # the server: θ's change (a relay: the replies, `relayed` below) and the averaged moments
        theta = {n: encode(p, codecs.down) for n, p in params.items()} if codecs.down is not None else {}
        down_moments = codecs.encode_moments(moments)
    else:
        theta, down_moments = params, moments
    down = encode_global_state(GlobalState(2, theta, projections, down_moments, 64, params_delta=codecs is not None),
                                     ms.model_id, dtype)
    forwarded = encode_update(WorkerUpdate(0, 2, delta, {}, 4096, 64), ms.model_id, dtype) if relay else b""
    down_bytes = len(down) + RELAY_M * len(forwarded)
    t3 = time.perf_counter()
    state = decode_global_state(down, ms.model_id, codecs=resolve_payload(payload).downlink_specs)
    if relay:  # the worker decodes the M replies (top-k Δ kept sparse, as decode_global_state keeps a relayed
        # reply's) and replays the round's mean and outer step
        replies = [dataclasses.replace(decode_update(forwarded, ms.model_id, codecs=resolve_payload(payload).receiver_specs,
                                                     sparse=True), worker_id=m) for m in range(RELAY_M)]
        replay(params, dataclasses.replace(state, round=3, relay=replies, outer_lr=1.0), RoundConfig(local_steps=32), codecs)
    t4 = time.perf_counter()
    # what a compressed preset adds to a worker's state (saved with it, held between rounds): Δ's
    # compression residual (as measured on the object) and the clients' copy θ_c (fp32, every parameter)
    residual = ef.nbytes() if codecs is not None else 0
    copy = 4 * ms.num_params if codecs is not None and codecs.tracks_copy else 0
    return {"preset": preset, "payload": payload, "up_bytes": len(up), "down_bytes": down_bytes,
            "worker_encode_s": t1 - t0, "worker_keep_s": t1 - t_keep, "server_decode_s": t2 - t1, "server_encode_s": t3 - t2,
            "worker_decode_s": t4 - t3, "worker_state_residual_bytes": residual, "worker_state_copy_bytes": copy,
            "params": ms.num_params}


WIRE_METRICS = ("wire_ef_ratio", "sparse_support_shared", "sparse_reselected")
"""Per-round wire diagnostics a quality run keeps (`round_metrics`): ‖e‖/‖Δ‖ after the send, the share of
the sent indices more than one worker sent, the share of a worker's indices it also sent the round before."""


REFIT_METHODS = ("svd", "rsvd", "dct")


def refit_times(preset: str, payload: str = "topk2bit-both", methods: tuple[str, ...] = REFIT_METHODS) -> list[dict]:
    """The server's whole-model refit of LoRDO-Global's bases (`fit_projections`, on this CPU) per
    projection method, against the time one worker's round of `payload` takes on 1 Gb/s and 100 Mb/s
    links (the lean state, K = 32: the bytes with nothing dense left, up and down; SVD bases would
    add their own fp32 bytes). Each method timed once after a warm-up fit of one matrix per shape."""
    from lordo_fed.optim.projection import get_projection_method
    from lordo_fed.rounds.bases import fit_projections

    ms = _SHAPES.setdefault(preset, ModelShapes(preset, GPT2_VOCAB, RANKS[preset]))
    params = ms.params()
    deltas = {n: params[n] for n in ms.ranks}
    ranks = dict(ms.ranks)
    update, state = round_messages(ms, payload, 32, 1, 2 * _sync_period(RoundConfig(local_steps=32, **LEAN)), "lean")
    round_bytes = message_bytes(update, ms, payload)[0] + message_bytes(state, ms, payload)[0]
    rows = []
    for name in methods:
        method = get_projection_method(name)
        warm = {}
        for n in deltas:
            warm.setdefault(tuple(deltas[n].shape), n)
        fit_projections({n: deltas[n] for n in warm.values()}, {n: ranks[n] for n in warm.values()}, method, seed=0)
        t0 = time.perf_counter()
        fit_projections(deltas, ranks, method, seed=0)
        seconds = time.perf_counter() - t0
        rows.append({"preset": preset, "method": name, "matrices": len(ranks), "refit_s": seconds,
                     "payload": payload, "round_bytes": round_bytes,
                     "link_s_1gbps": round_bytes / LINK_BYTES_PER_S, "link_s_100mbps": round_bytes / (LINK_BYTES_PER_S / 10),
                     "threads": torch.get_num_threads()})
        print(f"refit {preset} {name:4}: {seconds:6.2f} s on {torch.get_num_threads()} threads; a {payload} lean round "
              f"{round_bytes / 1e6:.1f} MB: {round_bytes / LINK_BYTES_PER_S:.3f} s at 1 Gb/s, "
              f"{10 * round_bytes / LINK_BYTES_PER_S:.3f} s at 100 Mb/s", flush=True)
    return rows


def quality_run(payload: str, factor: int, seed: int, quick: bool, work: Path, extra: tuple[str, ...] = (),
                tag: str = "", method: str = "lordo_global", horizon: tuple[int, int] | None = None) -> dict:
    """One run of the quality setting (`QUALITY`; `quick`: a tiny one; `horizon` (rounds, K): that many
    rounds of K steps instead) of `method` (LoRDO-Global) with `payload`, `dense_sync_factor` = `factor`,
    `seed` and trainer overrides `extra`: its final val loss and perplexity, its bytes per worker (sent +
    received), its curve and the wire's per-round metrics (`WIRE_METRICS`).

    A run whose folder in `work` holds a result of the same trainer arguments is not run again (the
    runs are deterministic): the folder is named by a hash of them, so a long benchmark stopped part
    way continues where it stopped when given the same `work`."""
    overrides = (["model.preset=tiny", "total_steps=8", "rounds.local_steps=2", "data.seq_len=32",
                  "eval_batches=2", "inner.warmup_steps=2", "eval_every=1"] if quick else QUALITY)
    if horizon is not None and not quick:
        rounds, k = horizon
        overrides = [*QUALITY[:1], f"rounds.local_steps={k}", f"total_steps={rounds * k}",
                     f"eval_every={max(1, rounds // 8)}"]
    args = ["progress=false", f"methods=[{method}]", "diagnostics=false", f"seed={seed}", f"payload_dtype={payload}",
            f"rounds.dense_sync_factor={factor}", *overrides, *extra]
    key = hashlib.sha256(json.dumps(args).encode()).hexdigest()[:12]
    out = work / f"{method}_{payload}_F{factor}_s{seed}{tag}_{key}"
    done = out / "result.json"
    if done.is_file():
        return {**json.loads(done.read_text()), "cached": True}
    cmd = [sys.executable, "-m", "lordo_fed.trainer.cli", "--config-dir", str(ROOT / "examples" / "reference"),
           "--config-name", "quality_cpu", f"out_dir={out}", *args]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"lordo-train failed ({payload}, F={factor}, seed {seed}, {' '.join(extra)}):\n"
                           f"{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / f"{method}.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    result = {"method": method, "payload": payload, "dense_sync_factor": factor, "seed": seed, "overrides": list(extra),
            "val_loss": evals[-1]["val_loss"], "val_ppl": math.exp(evals[-1]["val_loss"]),
            "rounds": records[-1]["round"], "tokens": records[-1]["tokens"],
            "bytes_per_worker": records[-1]["cum_bytes_sent_per_worker"] + records[-1]["cum_bytes_received_per_worker"],
            "curve": [{"tokens": r["tokens"], "val_loss": r["val_loss"]} for r in evals],
            "round_metrics": [{"round": r["round"], **{k: r[k] for k in WIRE_METRICS if k in r}} for r in records
                              if any(k in r for k in WIRE_METRICS)],
            "seconds": time.perf_counter() - started}
    done.write_text(json.dumps(result))
    return result


def quality(payloads: list[str], seeds: list[int], quick: bool, work: Path, factors: tuple[int, ...] = (1,),
            extra: tuple[str, ...] = ()) -> list[dict]:
    """Each payload at `dense_sync_factor` 1, and fp32 and int8 also at each other factor in
    `factors` (how quantised moments compose with syncing the full-size ones less often); every
    row against fp32 at the same seed and factor."""
    pairs = ("fp32", "int8") if {"fp32", "int8"} <= set(payloads) else ()  # int8 against fp32 at each other F
    cases = [(p, 1) for p in payloads] + [(p, f) for f in factors if f != 1 for p in pairs]
    rows = [quality_run(payload, factor, seed, quick, work, extra) for seed in seeds for payload, factor in cases]
    for r in rows:
        ref = next(x for x in rows if x["seed"] == r["seed"] and x["payload"] == "fp32"
                   and x["dense_sync_factor"] == r["dense_sync_factor"])
        r["ppl_vs_fp32"] = r["val_ppl"] / ref["val_ppl"] - 1.0
        r["bytes_vs_fp32"] = ref["bytes_per_worker"] / r["bytes_per_worker"]
    return rows


GOAL_X = 2000
"""Issue 30's goal: at least 2,000x fewer bytes per step than fp32 DDP (125m, K = 32), at parity."""


def plot(result: dict, path: Path) -> None:
    """The figure of a result: bytes (x fewer than fp32 DDP against K, one panel per model, every
    payload x state at F = 1, the goal's line), then the codec's time against the link time it saves
    (`time`), then quality (`quality`); only the panels the result has data for."""
    import matplotlib

    rows = [r for r in result.get("bytes", []) if r["dense_sync_factor"] == 1]
    models = sorted({r["preset"] for r in rows}, key=lambda m: rows[[x["preset"] for x in rows].index(m)]["params"])
    panels = len(models) + bool(result.get("time")) + bool(result.get("quality"))
    if not panels:
        return
    fig = new_figure(4.6 * panels + (2.2 if rows else 0), 4.5)
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    states = sorted({r.get("states", "synced") for r in rows})
    lines = sorted({(r["payload"], r.get("states", "synced")) for r in rows})
    payloads = sorted({payload for payload, _ in lines})  # a colour per payload, a line style per state
    palette = "tab10" if len(payloads) <= 10 else "tab20"
    colors = {payload: matplotlib.colormaps[palette](i) for i, payload in enumerate(payloads)}
    for ax, model in zip(axes, models):
        for payload, state in lines:
            pts = sorted((r["K"], r["reduction_vs_ddp_fp32"]) for r in rows
                         if (r["preset"], r["payload"], r.get("states", "synced")) == (model, payload, state))
            label = payload if len(states) == 1 else f"{payload} ({state})"
            ax.plot([k for k, _ in pts], [x for _, x in pts], marker=".", color=colors[payload],
                    ls="-" if state == states[0] else "--", label=label if ax is axes[0] else None)
        ax.axhline(GOAL_X, color="grey", lw=0.8, ls=":")
        ax.text(min(r["K"] for r in rows), GOAL_X * 1.1, "2,000x (issue 30)",
                fontsize=7, color="grey")
        ax.set(xscale="log", yscale="log", xlabel="K (local steps a round)", ylabel="x fewer bytes than fp32 DDP per step",
               title=f"{model}, GPT-2 vocabulary, both directions")
    if rows:
        fig.legend(loc="center right", fontsize=6.5, frameon=False)
    rest = axes[len(models):]
    if result.get("time"):
        ax, rest = rest[0], rest[1:]
        t = result["time"]
        xs = range(len(t))
        ax.bar([x - 0.2 for x in xs], [r["codec_s"] for r in t], width=0.4, label="encode + decode, both ends")
        ax.bar([x + 0.2 for x in xs], [r.get("link_seconds_saved_1gbps", 0.0) for r in t], width=0.4,
               label="link time saved at 1 Gb/s")
        ax.set_xticks(list(xs), [r["payload"] for r in t], rotation=30, ha="right", fontsize=7)
        ax.set(ylabel="seconds a round", title=f"codec time, {t[0]['preset']}")
        ax.legend(fontsize=7)
    if result.get("quality"):
        ax = rest[0]
        for r in result["quality"]:
            if r["dense_sync_factor"] != 1:
                continue
            ax.plot([p["tokens"] / 1e6 for p in r["curve"]], [p["val_loss"] for p in r["curve"]],
                    ls="-" if r["seed"] == 0 else ":", label=f"{r['payload']} seed {r['seed']}")
        ax.set(xlabel="tokens (M)", ylabel="validation loss", title="quality (small preset, K = 8, 32 rounds)")
        ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - (2.2 / (4.6 * panels + 2.2) if rows else 0), 1))
    fig.savefig(path)


def main() -> None:
    global ROW_SHARE
    parser = make_parser("compression", __doc__, "16m bytes at K = 32, tiny time and quality (seconds)")
    parser.add_argument("--parts", default="bytes,time,refit,server,quality",
                        help="comma-separated: bytes, time, refit, server, quality")
    parser.add_argument("--payloads", default="", help="comma-separated presets (default: all; quality needs fp32 in it)")
    parser.add_argument("--overrides", default="", help="quality part: extra trainer overrides, space-separated "
                        "(e.g. 'inner.ef_decay=0.9')")
    parser.add_argument("--states", default="synced", help="bytes part, comma-separated, of " + ", ".join(STATES)
                        + " (`STATES`)")
    parser.add_argument("--presets", default="", help="bytes part: comma-separated model presets (default "
                        "16m,125m,720m; --quick 16m)")
    parser.add_argument("--relay-m", type=int, default=RELAY_M, help="bytes part: the workers whose replies a relaying "
                        "preset's state carries (M; each node's own left out)")
    parser.add_argument("--row-share", type=float, default=ROW_SHARE,
                        help="row-sparse presets, bytes part: the share of the embedding's rows sent per round")
    parser.add_argument("--server-presets", default=",".join(SERVER_PRESETS),
                        help=f"server part: comma-separated, of {', '.join(SERVER_PRESETS)}")
    parser.add_argument("--server-threads", default="1", help="server part: comma-separated CPU thread counts, "
                        "interleaved in one run (e.g. 1,2: a coordinator with more cores)")
    parser.add_argument("--plot", default="", metavar="JSON", help="measure nothing: redraw the figure of a "
                        "result file next to it")
    args = parser.parse_args()
    stop_children_on_sigterm()  # a killed run stops its trainer too
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), png_path(args.plot))
        print(f"wrote {png_path(args.plot)}")
        return
    parts = set(args.parts.split(","))
    started = time.perf_counter()
    payloads = args.payloads.split(",") if args.payloads else list(PAYLOADS)
    ROW_SHARE = args.row_share
    result = {**result_header("compression", args.quick, {"payloads": payloads, "parts": sorted(parts),
                                                          "row_share": ROW_SHARE, "overrides": args.overrides,
                                                          "relay_m": args.relay_m,
                                                          "server_presets": args.server_presets,
                                                          "server_threads": args.server_threads})}
    if "bytes" in parts:
        presets, ks, factors = (["16m"], [32], [1]) if args.quick else (["16m", "125m", "720m"], [8, 32, 128], [1, 4])
        presets = args.presets.split(",") if args.presets else presets
        if args.relay_m < 1:
            parser.error(f"--relay-m {args.relay_m}: expected an integer >= 1")
        result["bytes"] = bytes_table(presets, ks, factors, payloads, tuple(args.states.split(",")), args.relay_m)
        write_json({**result, "seconds": time.perf_counter() - started}, args.out)  # each part kept as it ends
    if "time" in parts:
        result["time"] = time_round("tiny" if args.quick else "125m", payloads)
        write_json({**result, "seconds": time.perf_counter() - started}, args.out)
    if "refit" in parts:
        result["refit"] = refit_times("tiny" if args.quick else "125m")
        write_json({**result, "seconds": time.perf_counter() - started}, args.out)
    if "server" in parts:
        try:
            threads = tuple(int(t) for t in args.server_threads.split(","))
            result["server"] = server_times("tiny" if args.quick else "125m", (2,) if args.quick else (2, 4, 8),
                                            repeats=1 if args.quick else 3,
                                            presets=tuple(args.server_presets.split(",")), threads=threads)
        except ValueError as e:
            parser.error(f"--server-presets {args.server_presets!r} --server-threads {args.server_threads!r}: {e}")
        write_json({**result, "seconds": time.perf_counter() - started}, args.out)
    if "quality" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            result["quality"] = quality(payloads if not args.quick else ["fp32", "int8"], [0] if args.quick else [0, 1],
                                        args.quick, Path(tmp), factors=(1,) if args.quick else (1, 4),
                                        extra=tuple(args.overrides.split()))
    result["seconds"] = time.perf_counter() - started
    out = write_json(result, args.out)
    plot(result, png_path(out))
    for r in result.get("bytes", []):
        print(f"{r['preset']:5} K={r['K']:<4} F={r['dense_sync_factor']} {r['states']:6} {r['payload']:16} up {r['up_bytes_per_round'] / 1e6:9.1f} MB "
              f"down {r['down_bytes_per_round'] / 1e6:9.1f} MB  {r['reduction_vs_ddp_fp32']:7.1f}x fewer than fp32 DDP")
    for r in result.get("time", []):
        print(f"time {r['preset']} {r['payload']:16} codec {r['codec_s']:6.2f} s (extra {r['extra_codec_s']:+6.2f} s), "
              f"1 Gb/s link time saved {r['link_seconds_saved_1gbps']:6.2f} s")
    for r in result.get("server", []):
        print(f"server {r['model']} {r['preset']:13} M={r['M']} {r['path']:11} {r['threads']} thread(s): screen {r['screen_s']:5.2f} s, "
              f"aggregate {r['aggregate_s']:5.2f} s, together {r['server_s']:5.2f} s, the state encoded "
              f"{r['encode_s']:5.2f} s" + (f", each node's own {r['encode_own_s']:5.2f} s" if "encode_own_s" in r else ""))
    for r in result.get("quality", []):
        print(f"quality {r['payload']:16} F={r['dense_sync_factor']} seed {r['seed']}: val ppl {r['val_ppl']:.3f} ({r['ppl_vs_fp32']:+.2%} vs fp32), "
              f"{r['bytes_vs_fp32']:.1f}x fewer bytes")
    print(f"wrote {out}" + (f" and {png_path(out)}" if png_path(out).exists() else " (no figure: nothing to draw)"))


if __name__ == "__main__":
    main()
