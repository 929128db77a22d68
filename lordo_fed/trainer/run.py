"""Run one method end to end on one process: M workers in turn, or DDP's per-step all-reduce.

Both loops use the library's Worker (the same local-step code the Flower client runs); the
round-based methods also use the Aggregator, so what this trainer measures is what the
federated app computes. Bytes on the wire are counted from the tensors actually exchanged.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn
from tqdm import tqdm

from lordo_fed.data import Dataset
from lordo_fed.evaluation import evaluate
from lordo_fed.metrics import optimizer_state_bytes, tensor_bytes
from lordo_fed.optim import LoRDO
from lordo_fed.optim.config import resolved_proj_method
from lordo_fed.optim.projection import get_projection_method
from lordo_fed.rounds.bases import fit_projections, initial_projections
from lordo_fed.rounds.async_rounds import Arrival, AsyncServer, NodeCopies, Pull, VirtualClock, async_record
from lordo_fed.rounds.build import build_run
from lordo_fed.rounds.methods import MethodSettings, make_worker
from lordo_fed.rounds.relay import for_worker
from lordo_fed.rounds.worker import Worker
from lordo_fed.trainer.checkpoints import Checkpoints, part
from lordo_fed.trainer.config import TrainConfig
from lordo_fed.wire.compress import decoded
from lordo_fed.wire.messages import DIAGNOSTIC_METRICS, GlobalState, WorkerUpdate

Record = dict
RecordFn = Callable[[Record], None]


@dataclass
class RunContext:
    """What every loop needs besides the method's settings."""

    cfg: TrainConfig
    dataset: Dataset
    device: torch.device
    val_batches: list
    emit: RecordFn
    seconds_before: float = 0.0
    """Wall-clock seconds a resumed run trained before it was killed (its checkpoint's; trainer.checkpoints)."""


class StepBar:
    """A progress bar in the run's steps: `total_steps`, what the user asked for (optimizer steps
    per worker), not worker-steps, which would count to M x total_steps.

    The workers of a round run in turn, so a step of the run is done once every worker has made
    it: `worker_step` is called for each worker-step, and the bar shows worker-steps / M, moving on
    every M-th call. DDP's loop, where all M workers make each step together, calls `step`."""

    def __init__(self, ctx: RunContext, desc: str) -> None:
        self.workers = ctx.cfg.workers
        self.bar = tqdm(total=ctx.cfg.total_steps, desc=desc, unit="step", disable=not ctx.cfg.progress,
                        leave=False, dynamic_ncols=True)
        self._worker_steps = self._shown = 0  # own counts: a disabled tqdm keeps no n

    def worker_step(self, i: int = 0, loss: torch.Tensor | None = None) -> None:
        """One local step of one worker (the signature of Worker.train_round's `progress`)."""
        self._worker_steps += 1
        done = self._worker_steps // self.workers
        if done > self._shown:
            self.bar.update(done - self._shown)
            self._shown = done

    def step(self) -> None:
        """One step of all the workers at once."""
        self.bar.update(1)

    def skip(self, steps: int) -> None:
        """`steps` steps done before a resumed run started (`trainer.checkpoints`)."""
        self._worker_steps += steps * self.workers
        self._shown += steps
        self.bar.update(steps)

    def set_postfix(self, **kw: str) -> None:
        self.bar.set_postfix(**kw)

    def close(self) -> None:
        self.bar.close()


def run_rounds(ctx: RunContext, settings: MethodSettings) -> nn.Module:
    """Round-based methods: every round, each worker trains K steps, the aggregator combines."""
    cfg = ctx.cfg
    run = build_run(cfg, settings, ctx.dataset.vocab_size, ctx.device)  # every method starts from the same θ0
    model = run.model
    rc = settings.rounds  # K, and the first rounds' own (`local_steps_ramp`)
    workers = [run.worker(m, ctx.dataset.train_shards[m], cfg.total_steps) for m in range(cfg.workers)]
    aggregator = run.aggregator()
    aggregator.diagnostics = cfg.diagnostics
    for w in workers:
        if isinstance(w.optimizer, LoRDO):
            w.optimizer.track_update_split = cfg.diagnostics
    num_rounds = rc.rounds_in(cfg.total_steps)
    checkpoints = Checkpoints(ctx, settings.name)
    sent_total = received_total = tokens = 0
    bar = StepBar(ctx, settings.name)
    resumed = checkpoints.load()  # a run started again: the aggregator, the workers and the counters as saved
    if resumed is not None:
        aggregator.load_state_dict(part(resumed.tensors, "server/"))
        for w, meta in zip(workers, resumed.counters["workers"]):
            w.load_flat_state(part(resumed.tensors, f"worker{w.worker_id}/"), meta)
        tokens, sent_total, received_total = (resumed.counters[k] for k in ("tokens", "sent", "received"))
        with torch.no_grad():  # θ as the last round left it (what a run resumed after its last round returns)
            for n, p in model.named_parameters():
                p.copy_(aggregator.params[n])
        bar.skip(rc.steps_before(resumed.round + 1))
    else:
        if aggregator.needs_gradient_init:
            request = aggregator.gradient_request()
            gradients = [w.gradient(request, sorted(run.ranks)) for w in workers]
            aggregator.init_projections(gradients)
            received_total += tensor_bytes(request.tensors())
            sent_total += max(tensor_bytes(g.tensors()) for g in gradients)
        checkpoints.record({**_eval_record(ctx, model, settings, 0, 0, 0), "virtual_time": 0.0})
    for _ in range(resumed.round if resumed else 0, num_rounds):
        state = aggregator.global_state()
        # each worker's own state: a relaying one leaves out the worker's own reply (relay.for_worker)
        states = [for_worker(state, w.worker_id) for w in workers]
        received = max(tensor_bytes(s.tensors()) for s in states)
        started = time.perf_counter()
        updates = [w.train_round(s, progress=bar.worker_step) for w, s in zip(workers, states)]
        sent = max(tensor_bytes(u.tensors()) for u in updates)  # compressed tensors by their encoded bytes
        relay = {u.worker_id: u for u in updates}  # as received: what a relaying payload sends on
        updates = [as_received(u, sparse=True) for u in updates]
        aggregation_started = time.perf_counter()
        result = aggregator.aggregate(updates, relay=relay)
        elapsed = time.perf_counter() - started
        aggregation_seconds = time.perf_counter() - aggregation_started
        tokens += sum(u.tokens for u in updates)
        sent_total += sent
        received_total += received
        bar.set_postfix(loss=f"{result.metrics.get('train_loss', float('nan')):.3f}")
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(aggregator.params[n])
        r = state.round
        K, step = rc.steps_of(r), rc.steps_before(r + 1)
        record = {
            "round": r, "step": step, "tokens": tokens, "train_loss": result.metrics.get("train_loss"),
            "delta_norm": result.metrics.get("delta_norm"),
            **{k: result.metrics[k] for k in ("delta_stable_rank", "delta_in_subspace", "delta_retention",
                                              "sparse_support_shared", "outer_lr", *DIAGNOSTIC_METRICS)
               if k in result.metrics},
            "bytes_sent_per_worker": sent, "bytes_received_per_worker": received,
            "bytes_sent_per_worker_per_step": sent / K, "bytes_received_per_worker_per_step": received / K,
            "cum_bytes_sent_per_worker": sent_total, "cum_bytes_received_per_worker": received_total,
            "opt_state_bytes": optimizer_state_bytes(workers[0].optimizer),
            "round_seconds": elapsed, "aggregation_seconds": aggregation_seconds,
            # on the virtual clock of the asynchronous methods: every round waits for the slowest worker
            "virtual_time": step * max(cfg.async_rounds.speed_of(w) for w in range(cfg.workers)),
        }
        if r % cfg.eval_every == 0 or r == num_rounds:
            record.update(_eval_record(ctx, model, settings, r, step, tokens))
        checkpoints.record({"method": settings.name, **record})
        if checkpoints.due(r, num_rounds):
            flat = [w.flat_state() for w in workers]
            checkpoints.save(r, {"server/": aggregator.state_dict(),
                                 **{f"worker{w.worker_id}/": tensors for w, (tensors, _) in zip(workers, flat)}},
                             {"tokens": tokens, "sent": sent_total, "received": received_total,
                              "workers": [meta for _, meta in flat]})
    bar.close()
    return model


def run_async(ctx: RunContext, settings: MethodSettings) -> nn.Module:
    """Asynchronous methods on the virtual clock (lordo_fed.rounds.async_rounds): each worker pulls the
    server's model, trains its local steps, and its Δ is applied on arrival, one outer step, in
    (virtual time, worker id) order; the worker then pulls again. Worker w runs
    `async_rounds.local_steps[w]` steps per round (default K) at `speeds[w]` virtual seconds each.
    The budget is the synchronous methods' tokens: a worker is sent another round while the
    tokens applied and in flight plus that round's stay within M x total_steps x batch x seq_len
    (a fast worker makes more rounds than a slow one).

    With a grace window (`async_rounds.grace` virtual seconds) the arrivals within it are applied
    in turn and their workers pull together when it closes (`VirtualClock.window`). With a
    compressed payload preset each pull goes as the compressed change from that worker's copy
    (`NodeCopies`), as the Flower strategy sends it.

    A worker's steps depend only on what it pulled and its own state, so they are computed when
    it pulls and its Δ is held until its arrival time: deterministic whatever the machine.
    A record every M pushes ("round" = pushes / M): tokens, virtual time, the staleness of the
    pushes since the last record, replies dropped past `async_rounds.max_staleness`.

    With `checkpoint_every=N` a checkpoint follows the grace window in which every N-th record (and the last)
    was made: besides θ, the outer step and the workers' states, the rounds in flight (each worker's Δ as the
    server will decode it, the version and basis it pulled, its arrival on the clock), the older bases those
    rounds train in, each worker's copy θ_c and the loop's counters, so a continued run ends where the
    uninterrupted one does, bit for bit (lordo_fed.trainer.checkpoints)."""
    cfg, data, acfg = ctx.cfg, ctx.cfg.data, ctx.cfg.async_rounds
    run = build_run(cfg, settings, ctx.dataset.vocab_size, ctx.device)
    model = run.model
    K, M = settings.rounds.local_steps, cfg.workers
    steps = [acfg.local_steps_of(w, K) for w in range(M)]
    workers = [run.worker(w, ctx.dataset.train_shards[w], cfg.total_steps, steps[w]) for w in range(M)]
    # θ, the outer step and (async LoRDO) the shared projections and averaged moments: the aggregator's
    aggregator = run.aggregator()
    checkpoints = Checkpoints(ctx, settings.name)
    resumed = checkpoints.load()  # a run started again: the server, the workers and the rounds in flight as saved
    if resumed is not None:
        aggregator.load_state_dict(part(resumed.tensors, "server/"))
    elif aggregator.needs_gradient_init:
        request = aggregator.gradient_request()
        aggregator.init_projections([w.gradient(request, sorted(run.ranks)) for w in workers])
    server = AsyncServer(aggregator.params, aggregator.outer, settings.async_rule, acfg,
                         lowrank=aggregator if aggregator.projection is not None else None, workers=M)
    step_tokens = data.batch_size * data.seq_len
    budget = M * cfg.total_steps * step_tokens
    clock, pending, rounds_of = VirtualClock(), {}, [0] * M
    copies = NodeCopies(run.payload.codecs)
    committed = 0  # tokens applied or in flight
    bar = StepBar(ctx, settings.name)  # worker-steps / M: the records' "step" (tokens applied / M)

    def start(w: int, now: float) -> None:
        nonlocal committed
        if committed + steps[w] * step_tokens > budget:
            return
        committed += steps[w] * step_tokens
        pull = server.pull()
        rounds_of[w] += 1
        r = rounds_of[w]  # the worker's own round: its schedule position (and, but for LoRDO, its step count)
        state = GlobalState(round=r, params=pull.params, projections=pull.projections, moments=pull.moments,
                            opt_step=(r - 1) * steps[w] if pull.opt_step is None else pull.opt_step)
        state = copies.start_point(w, state, pull)  # a compressed downlink: the change from w's copy
        update = workers[w].train_round(state, progress=bar.worker_step)
        # the update as sent: its bytes are counted (up, and the state it was made from down)
        pending[w] = (update, pull, tensor_bytes(update.tensors()), tensor_bytes(state.tensors()))
        clock.start(w, now, acfg.seconds(w, K))

    processed = tokens = 0
    window: list = []
    cum_sent = cum_received = 0  # over all workers: each push's reply (up) and the state it was made from (down)
    if resumed is not None:
        c = resumed.counters
        server.load_state_dict(part(resumed.tensors, "async/"), c["server"])
        if server.lowrank is not None:
            server.load_pulls_state(part(resumed.tensors, "pulls/"), c["pulls"])
        for w, meta in zip(workers, c["workers"]):
            w.load_flat_state(part(resumed.tensors, f"worker{w.worker_id}/"), meta)
        for w in c["copies"]:  # in θ's order, as a pull makes them
            held = part(resumed.tensors, f"copy{w}/")
            copies.copies[int(w)] = {n: held[n] for n in server.params}
        for w, flight in c["pending"].items():
            pending[int(w)] = (_update_of(part(resumed.tensors, f"pending{w}/"), flight["update"]),
                               Pull({}, flight["version"], basis=flight["basis"]), flight["sent"], flight["received"])
        clock.load_state(c["clock"])
        committed, rounds_of, processed, tokens = c["committed"], list(c["rounds_of"]), c["processed"], c["tokens"]
        cum_sent, cum_received = c["cum_sent"], c["cum_received"]
        window = [(Arrival(**arrival), loss) for arrival, loss in c["window"]]
        with torch.no_grad():  # θ as the last record left it (what a run resumed after its end returns)
            for n, p in model.named_parameters():
                p.copy_(server.params[n])
        bar.skip(committed // (step_tokens * M))
    else:
        checkpoints.record({**_eval_record(ctx, model, settings, 0, 0, 0), "virtual_time": 0.0})  # θ0
        for w in range(M):
            start(w, 0.0)
    while pending:
        close, batch = clock.window(acfg.grace)
        due = False
        for i, (t, w) in enumerate(batch):
            update, pull, sent, received = pending.pop(w)
            update = as_received(update)
            cum_sent, cum_received = cum_sent + sent, cum_received + received
            arrival = server.push(update, pull, t)
            processed += 1
            tokens += update.tokens
            window.append((arrival, update.metrics.get("train_loss")))
            last = i == len(batch) - 1
            if last:
                for _, v in batch:  # the same start point for all of them, when the window closes
                    start(v, close)
            # A record every M pushes (at that push's time, within a window too), and at the end.
            if processed % M and not (last and not pending):
                continue
            r = -(-processed // M)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(server.params[n])
            at = t if processed % M == 0 else close
            record = {"method": settings.name, **async_record(window, M, r, tokens, tokens // (M * step_tokens), at,
                                                               processed, server.version),
                      "bytes_sent_per_worker": sent, "bytes_received_per_worker": received,
                      "bytes_sent_per_worker_per_step": sent / K, "bytes_received_per_worker_per_step": received / K,
                      "cum_bytes_sent_per_worker": cum_sent / M, "cum_bytes_received_per_worker": cum_received / M,
                      "opt_state_bytes": optimizer_state_bytes(workers[0].optimizer)}
            window = []
            if r % cfg.eval_every == 0 or (last and not pending):
                record.update(_eval_record(ctx, model, settings, r, record["step"], tokens))
            checkpoints.record(record)
            due = due or checkpoints.due(r, r if last and not pending else 0)
        if due:  # after the window: its arrivals applied and its workers' next rounds in flight
            _save_async(checkpoints, r, aggregator, server, workers, copies, pending, clock, window,
                        {"committed": committed, "rounds_of": rounds_of, "processed": processed, "tokens": tokens,
                         "cum_sent": cum_sent, "cum_received": cum_received})
    bar.close()
    return model


def _save_async(checkpoints: Checkpoints, r: int, aggregator, server: AsyncServer, workers: list, copies: NodeCopies,
                pending: dict, clock: VirtualClock, window: list, counters: dict) -> None:
    """An asynchronous run's checkpoint after record `r` (`run_async`): each round in flight as the server will
    decode it (`as_received`), under `pending<w>/`, with what it pulled and the bytes it counts."""
    async_tensors, async_meta = server.state_dict()
    parts = {"server/": aggregator.state_dict(), "async/": async_tensors}
    pulls_meta = None
    if server.lowrank is not None:
        pulls_tensors, pulls_meta = server.pulls_state()
        parts["pulls/"] = pulls_tensors
    flat = [w.flat_state() for w in workers]
    parts.update({f"worker{w.worker_id}/": tensors for w, (tensors, _) in zip(workers, flat)})
    parts.update({f"copy{w}/": held for w, held in copies.copies.items()})
    flights = {}
    for w, (update, pull, sent, received) in pending.items():
        update = as_received(update)
        parts[f"pending{w}/"] = update.tensors()
        flights[str(w)] = {"update": {"worker_id": update.worker_id, "round": update.round, "tokens": update.tokens,
                                      "opt_step": update.opt_step, "metrics": update.metrics,
                                      "keys": list(parts[f"pending{w}/"])},  # the order it was made in
                           "version": pull.version, "basis": pull.basis, "sent": sent, "received": received}
    checkpoints.save(r, parts, {**counters, "server": async_meta, "pulls": pulls_meta,
                                "workers": [meta for _, meta in flat], "copies": sorted(copies.copies),
                                "pending": flights, "clock": clock.state(),
                                "window": [(dataclasses.asdict(a), loss) for a, loss in window]})


def _update_of(tensors: dict[str, Tensor], meta: dict) -> WorkerUpdate:
    """A round in flight as `_save_async` saved it (`WorkerUpdate.tensors()`' names, in the order it had)."""
    ordered = {k: tensors[k] for k in meta["keys"]}
    moments = {k: v for k, v in ordered.items() if not k.startswith(("delta/", "coords/"))}
    return WorkerUpdate(worker_id=int(meta["worker_id"]), round=int(meta["round"]), delta=part(ordered, "delta/"),
                        moments=moments, tokens=int(meta["tokens"]), opt_step=int(meta["opt_step"]),
                        metrics=dict(meta["metrics"]), coords=part(ordered, "coords/"))


def as_received(update: WorkerUpdate, sparse: bool = False) -> WorkerUpdate:
    """`update` as the server decodes it: compressed tensors (a compressed `payload_dtype`)
    replaced by their decoded values, exactly what a Flower server aggregates; with `sparse` an untiled
    top-k Δ kept sparse, as a synchronous round's server keeps it (server/courier.py: its norm, which the
    median clipping reads, is its values')."""
    return dataclasses.replace(update, delta=decoded(update.delta, sparse=sparse), moments=decoded(update.moments),
                               coords=decoded(update.coords))


def run_ddp(ctx: RunContext, settings: MethodSettings) -> nn.Module:
    """DDP / low-rank DDP: each step, every worker's gradient is averaged (an all-reduce), one step.

    With LoRDO and projection='global' the projection is refit every K steps from the update
    accumulated since the last refit: what LoRDO-Global does with the pseudo-gradient, so that
    M = 1, K = 1 LoRDO-Global must equal this loop. projection='local' is GaLore-style: refit
    from the all-reduced (error-fed) gradient every proj_interval steps.
    """
    cfg, data = ctx.cfg, ctx.cfg.data
    run = build_run(cfg, settings, ctx.dataset.vocab_size, ctx.device)
    model, ranks = run.model, run.ranks
    K = settings.rounds.local_steps
    first = make_worker(0, model, settings, ctx.dataset.train_shards[0], run.lowrank, cfg.total_steps,
                        data.batch_size, data.seq_len, seed=data.seed)  # DDP: nothing compressed on the wire
    optimizer = first.optimizer
    workers = [first] + [
        Worker(m, model, optimizer, ctx.dataset.train_shards[m], settings.inner, settings.rounds, cfg.total_steps,
               data.batch_size, data.seq_len, data_seed=data.seed)
        for m in range(1, cfg.workers)
    ]
    params = dict(model.named_parameters())
    server_proj = isinstance(optimizer, LoRDO) and settings.inner.projection == "global" and bool(ranks)
    if server_proj:
        method = get_projection_method(resolved_proj_method(settings.inner, ctx.device))
        if settings.inner.init_projection == "gradient":
            # The all-reduced gradient at θ0 of every worker's next batch (not consumed).
            for w in workers:
                w.forward_backward(w.cursor, scale=1.0 / cfg.workers)
            grads = {n: params[n].grad.detach().float().clone() for n in ranks}
            optimizer.zero_grad(set_to_none=True)
            initial = fit_projections(grads, ranks, method, cfg.seed)
        else:
            initial = initial_projections({n: tuple(params[n].shape) for n in ranks}, ranks, method, cfg.seed)
        for n, stored in initial.items():
            optimizer.set_projection(params[n], stored)
        anchor = {n: params[n].detach().float().clone() for n in ranks}
    checkpoints = Checkpoints(ctx, settings.name)
    bar = StepBar(ctx, settings.name)
    tokens = cum_bytes = 0  # per worker, per direction
    resumed = checkpoints.load()  # a run started again: θ, the optimizer, the cursors and the bases' anchor
    if resumed is not None:
        with torch.no_grad():
            for n, p in part(resumed.tensors, "param/").items():
                params[n].copy_(p)
        first.load_flat_state(part(resumed.tensors, "worker/"), resumed.counters["worker"])
        for w, cursor in zip(workers, resumed.counters["cursors"]):
            w.cursor = cursor
        if server_proj:
            anchor = {n: t.to(ctx.device) for n, t in part(resumed.tensors, "anchor/").items()}
        tokens, cum_bytes = resumed.counters["tokens"], resumed.counters["bytes"]
        bar.skip(resumed.round * K)
    else:
        checkpoints.record(_eval_record(ctx, model, settings, 0, 0, 0))
    losses: list[torch.Tensor] = []  # device scalars, read once per record
    started = time.perf_counter()
    for step in range(resumed.round * K if resumed else 0, cfg.total_steps):
        # The all-reduce: the mean of the M workers' gradients (each loss scaled by 1/M).
        for w in workers:
            losses.append(w.forward_backward(w.cursor, scale=1.0 / cfg.workers))
            w.cursor += 1
        grad_bytes = tensor_bytes([p.grad for p in params.values() if p.grad is not None])
        first.clip_and_step(step)
        bar.step()
        tokens += cfg.workers * data.batch_size * data.seq_len
        cum_bytes += grad_bytes  # each worker sends its gradient and receives the mean: same size
        if (step + 1) % K:
            continue
        r = (step + 1) // K
        if server_proj:
            delta = {n: anchor[n] - params[n].detach().float() for n in ranks}
            for n, stored in fit_projections(delta, ranks, method, cfg.seed + 7919 * r).items():
                optimizer.set_projection(params[n], stored)
            anchor = {n: params[n].detach().float().clone() for n in ranks}
        record = {
            "method": settings.name, "round": r, "step": step + 1, "tokens": tokens,
            "train_loss": sum(torch.stack(losses).tolist()) / len(losses),
            "bytes_sent_per_worker": grad_bytes * K, "bytes_received_per_worker": grad_bytes * K,
            "bytes_sent_per_worker_per_step": grad_bytes, "bytes_received_per_worker_per_step": grad_bytes,
            "cum_bytes_sent_per_worker": cum_bytes, "cum_bytes_received_per_worker": cum_bytes,
            "opt_state_bytes": optimizer_state_bytes(optimizer),
            "round_seconds": time.perf_counter() - started,
        }
        losses, started = [], time.perf_counter()
        bar.set_postfix(loss=f"{record['train_loss']:.3f}")
        if r % cfg.eval_every == 0 or step + 1 == cfg.total_steps:
            record.update(_eval_record(ctx, model, settings, r, step + 1, tokens))
        checkpoints.record(record)
        if checkpoints.due(r, cfg.total_steps // K):
            tensors, meta = first.flat_state()  # the one optimizer every worker steps, and the first's cursor
            checkpoints.save(r, {"param/": {n: p.detach() for n, p in params.items()}, "worker/": tensors,
                                 **({"anchor/": anchor} if server_proj else {})},
                             {"tokens": tokens, "bytes": cum_bytes, "worker": meta,
                              "cursors": [w.cursor for w in workers]})
    bar.close()
    return model


def _eval_record(ctx: RunContext, model: nn.Module, settings: MethodSettings, r: int, step: int, tokens: int) -> Record:
    return {"method": settings.name, "round": r, "step": step, "tokens": tokens, **evaluate(model, ctx.val_batches)}


def run_method(ctx: RunContext, settings: MethodSettings) -> nn.Module:
    """Dispatch on the method's loop; returns the final global model."""
    return {"ddp": run_ddp, "async": run_async}.get(settings.loop, run_rounds)(ctx, settings)

