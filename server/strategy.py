"""The LoRDO strategy: Flower's message-API Strategy around the library's Aggregator.

Each round (docs/algorithm.md): configure (the global state each node needs: θ, the shared
projections, the averaged states that are due, encoded once as a `lordo_fed.v1` payload) → push
→ receive (polling fast until the round deadline) → screen (decode and validate each reply:
schema, model identity, names, shapes, dtypes, finiteness; bad ones dropped with a log line naming
the client and the reason) → aggregate (`lordo_fed.rounds.aggregator.Aggregator`: token weights,
outer update, Global projection refit and moment rotation) → evaluate on the held-out split every
N rounds → record (JSONL/TensorBoard) → checkpoint (atomic).

The wire is the courier's (server/courier.py: messages, tickets, the data plane, polling,
screening), the records are the recorder's (server/records.py: the round's log and record, plots,
checkpoints); the asynchronous strategy (server/async_strategy.py) reuses both.

`start()` is our own: the stock loop has a separate evaluate phase per round (a second round trip)
and polls every 3 s; one phase per round and fast polling cut the per-round overhead.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Iterable

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result

from lordo_fed.app.config import AppConfig
from lordo_fed.checkpoint import set_rng_state
from lordo_fed.data import load_dataset
from lordo_fed.evaluation import evaluate
from lordo_fed.rounds.build import build_run
from lordo_fed.rounds.relay import for_worker
from lordo_fed.wire.messages import GlobalState
from server.courier import Courier
from server.records import Recorder, RoundLog, rounded

log = logging.getLogger("lordo_fed.server")


class LoRDOStrategy(Strategy):
    """Server side of a LoRDO (or DiLoCo / Local Adam / DES-LOC) run over Flower."""

    def __init__(self, cfg: AppConfig, explicit_keys: Iterable[str] = ()):
        self.cfg = cfg
        self.out_dir = Path(cfg.out_dir).expanduser().resolve()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        dataset = load_dataset(cfg.data, 1)  # the validation split is the same for any partitioning
        self.val_batches = dataset.val_batches(cfg.eval_batches)
        self.run = build_run(cfg, cfg.variant, dataset.vocab_size)  # θ0: the reference trainer's and the nodes'
        self.settings, self.model, self.model_id = self.run.settings, self.run.model, self.run.model_id
        self.payload = self.run.payload
        self.aggregator = self.run.aggregator(outlier_factor=cfg.outlier_factor)
        self.recorder = Recorder(cfg, self.out_dir, self.model_id)
        self.checkpoint_dir = self.recorder.checkpoint_dir
        # The largest reply a node may upload: Δ plus at most three full-size states (u, v, E) in
        # fp32, and room for names and metrics. A bigger upload is refused before it is stored.
        max_upload = 4 * 4 * sum(p.numel() for p in self.model.parameters()) + (1 << 20)
        self.courier = Courier(cfg, explicit_keys, self.model_id, self.payload, max_upload,
                               self.out_dir / "dataplane_spool")
        self.tokens = 0
        self.cum_bytes = 0
        self.round_log = RoundLog()
        """The log of the round configured last (what `aggregate_train` fills)."""
        self.theta_is_seeded = not cfg.resume
        """θ is still θ0, the seeded init every client builds itself: it is not sent (until a round is applied)."""
        self._acked: set[int] | None = None
        """Nodes whose reply to the last round arrived (None: any node, e.g. after a resume): with
        a compressed downlink the others are sent θ_c whole."""
        self._partitions: dict[int, int] = {}
        """Node -> the partition of its reply that passed screening last round (a relaying state leaves
        it out of that node's next state). Checkpointed: a resumed run's first state leaves it out too."""
        if cfg.resume:
            self.resume(cfg.resume)
        else:
            self.recorder.claim_fresh()

    # ----------------------------------------------------------------------------- Strategy API
    def summary(self) -> None:
        c = self.cfg
        log.info("\t├── LoRDO strategy: variant %s, %d rounds of K=%d local steps", c.variant, c.num_rounds,
                 c.rounds.local_steps)
        log.info("\t├── Model %s (id %s), inner %s rank %d ω=%.3g lr=%.3g, outer %s", c.model.preset, self.model_id,
                 self.settings.inner.name, c.inner.rank, c.inner.omega, self.settings.inner.lr, self.settings.outer.name)
        log.info("\t├── Sync periods (K_u, K_v) = (%d, %d), x %d for parameters that are not low-rank; projections: %s",
                 self.settings.rounds.sync_exp_avg_every, self.settings.rounds.sync_exp_avg_sq_every,
                 self.settings.rounds.dense_sync_factor,
                 self.settings.inner.projection if self.settings.inner.name == "lordo" else "none")
        log.info("\t├── Payload %s; min clients %d; round timeout %.0fs; eval every %d rounds", c.payload_dtype,
                 c.min_clients, c.round_timeout, c.eval_every)
        log.info("\t└── Outputs: %s", self.out_dir)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per connected node, each carrying the state `_node_states` gives that node (the
        round's encoded global state, or the node's own)."""
        nodes = list(grid.get_node_ids())
        data, own = self._node_states(server_round, nodes)
        return self.courier.outgoing(server_round, data, nodes, MessageType.TRAIN, own)

    def _node_states(self, server_round: int, nodes: Iterable[int]) -> tuple[memoryview, dict[int, memoryview]]:
        """The round's encoded global state, and node -> the encoded state that node gets instead: with a
        compressed downlink, a node that did not reply last round (it may not hold the clients' copy of
        θ the state's change applies to) gets θ_c whole; with a relaying one, a node whose reply the
        state relays gets it without that reply (`_own_states`). Known only once the last round's
        replies are in, so an announced round asks it at publish time (`_publish_announced`). Starts the
        round's log."""
        data = self._encode_round(server_round)
        if not self.aggregator.downlink_due():
            return data, {}
        nodes = list(nodes)
        # after a resume any node may hold θ_c (`_acked` None); a node that does not asks for θ whole
        resync = [] if self._acked is None else [n for n in nodes if n not in self._acked]
        own = self._own_states(server_round, [n for n in nodes if n not in resync], len(data))
        if resync:
            log.info("round %d: nodes %s get θ whole (no reply from them last round)", server_round, resync)
            own.update(dict.fromkeys(resync, self.courier.encode(self.aggregator.resync_state())))
        return data, own

    def _encode_round(self, server_round: int) -> memoryview:
        """The round's global state, encoded once for every node; starts the round's log."""
        state = self._round_state(server_round)
        encode_started = time.perf_counter()
        data = self.courier.encode(state)
        self.round_log = RoundLog(sent_bytes=len(data), encode_seconds=time.perf_counter() - encode_started,
                                  marks={"published": time.perf_counter()})
        return data

    def _own_states(self, server_round: int, nodes: list[int], shared: int) -> dict[int, memoryview]:
        """A relaying state: node -> the state that node gets, encoded, for each of `nodes` whose reply the
        state relays (`relay.for_worker`: without that reply, which the node kept); the others get the
        round's state (`shared` bytes). The round's log counts the largest state a node gets."""
        state = self._round_state(server_round)
        if not state.relay:
            return {}
        started = time.perf_counter()
        own = {}
        for n in nodes:
            mine = for_worker(state, self._partitions[n]) if n in self._partitions else state
            if mine is not state:
                own[n] = self.courier.encode(mine)
        rl = self.round_log
        rl.encode_seconds += time.perf_counter() - started
        rl.sent_bytes = max((len(own[n]) if n in own else shared for n in nodes), default=shared)
        return own

    def _round_state(self, server_round: int) -> GlobalState:
        state = self.without_theta0(self.aggregator.global_state())
        if state.round != server_round:
            raise RuntimeError(f"aggregator is at round {state.round}, asked to configure {server_round}")
        return state

    def _publish_announced(self, grid: Grid, r: int) -> dict[str, int]:
        """Publish announced round `r`'s state (`Courier.publish_announced`); starts the round's log,
        which marks when the round's messages went out. Without a compressed downlink every node gets
        the same state, published while it is encoded (the nodes' downloads start on its first bytes);
        with one, each node gets the state `_node_states` gives it, whole, through the ticket it holds
        (nodes that connected since the announcement with it)."""
        announced = self.courier.announced_at[r]
        if self.aggregator.tracks_copy:
            nodes = sorted({*grid.get_node_ids(), *self.courier.announced_nodes(r)})
            ids = self.courier.publish_announced(grid, r, *self._node_states(r, nodes))
        else:
            started = time.perf_counter()
            encoding = self.courier.start_encoding(self._round_state(r))
            self.round_log = RoundLog(sent_bytes=len(encoding.buffer), marks={"published": started})
            ids = self.courier.publish_announced(grid, r, encoding)
            self.round_log.encode_seconds = encoding.seconds
        self.round_log.marks["announced"] = announced
        return ids

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check every reply, drop bad ones with a reason, aggregate the rest.

        A reply is dropped, and logged as `round <r>: dropped reply of node <node id>[ (partition
        <p>)]: <reason>`, when it is an error reply, does not decode (PayloadError: schema, model
        identity, dtype/codec, declared sizes), fails `Aggregator.check` (round, tokens, names,
        shapes, dtypes, NaN/Inf), repeats a partition that already answered (two nodes with one
        partition-id: the first reply is kept) or is a norm outlier (`outlier-factor`). Nothing of a dropped
        reply reaches the global state. Fewer usable replies than min_clients: the round is
        skipped (θ, outer state, projections, moments unchanged; the round counter moves on).
        """
        rl = self.round_log
        try:
            return self._aggregate_train(server_round, replies, rl)
        finally:
            self._acked = set(rl.replied)  # these nodes hold this round's copy of θ
            self._partitions = dict(rl.partitions)  # and these kept the replies the next state relays

    def _aggregate_train(self, server_round: int, replies: Iterable[Message],
                         rl: RoundLog) -> tuple[ArrayRecord | None, MetricRecord | None]:
        with self.courier.screened(replies, server_round, f"round {server_round}", self.aggregator.check_reply,
                                   self.aggregator.screen_round, rl) as usable:
            refs = []
            for ref, size, metrics in usable:
                rl.add_reply(ref.worker_id, size, metrics)
                refs.append(ref)
            if len(refs) < self.cfg.min_clients:
                log.warning("round %d: %d usable replies < min_clients=%d; round skipped, global state unchanged",
                            server_round, len(refs), self.cfg.min_clients)
                self.aggregator.skip_round()  # the next round is a new attempt with the same θ
                return None, MetricRecord({"clients-ok": len(refs)})
            result = self.aggregator.aggregate_refs(refs)
        self.theta_is_seeded = False
        self.tokens += sum(r.tokens for r in refs)
        metrics = {k: float(v) for k, v in result.metrics.items()}
        metrics["clients_dropped"] = float(len(rl.dropped))
        return None, MetricRecord(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation runs on the server; client metrics travel in the train reply

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    # ----------------------------------------------------------------------------- the loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        """Rounds from the aggregator's current round (1, or the resumed one) to `num_rounds`."""
        num_rounds = num_rounds or self.cfg.num_rounds
        timeout = timeout or self.cfg.round_timeout
        log.info("Starting LoRDO strategy:")
        self.summary()
        result = Result()
        self.courier.start(grid)  # before anything is written: a bad TLS setting stops the run here
        self.recorder.start_clock()
        if self.aggregator.round == 1:
            self.recorder.add({"round": 0, "step": 0, "tokens": 0, **self.validate(),
                               "elapsed_seconds": self.recorder.elapsed()})
        self.recorder.open()
        try:
            if self.aggregator.needs_gradient_init:
                self.init_projections(grid, timeout)
            ahead: tuple[int, float, dict[str, int]] | None = None
            while self.aggregator.round <= num_rounds:
                r = self.aggregator.round
                if ahead is not None and ahead[0] == r:  # published while the last round was finished
                    _, started, ids = ahead
                else:  # configure, push
                    started = time.perf_counter()
                    ids = self._begin_round(r, grid, timeout, num_rounds)
                rl = self.round_log
                replies = self.courier.receive(grid, ids, timeout, r, rl)
                agg_started = time.perf_counter()
                _, metrics = self.aggregate_train(r, replies)  # screen, aggregate
                aggregation_seconds = time.perf_counter() - agg_started
                if metrics is not None:
                    result.train_metrics_clientapp[r] = metrics
                seconds = time.perf_counter() - started
                rl.marks["started"] = started
                ahead = self._begin_ahead(grid, timeout, num_rounds)
                # evaluate, record, checkpoint
                self._finish_round(r, metrics, seconds, aggregation_seconds, num_rounds, rl)
        finally:
            self.courier.stop()
        self.recorder.close()
        result.arrays = self.theta_record()
        return result

    def _begin_round(self, r: int, grid: Grid, timeout: float, num_rounds: int) -> dict[str, int]:
        """Send round `r` to the nodes (its state, or the tickets to it), or publish it when its
        messages went out a round ahead; on the data plane, announce round r+1 as well. Returns
        message id -> node id of the round's messages."""
        courier = self.courier
        courier.wait_for_nodes(grid, timeout)
        if courier.is_announced(r):  # the nodes hold this round's tickets already: publish its state
            ids = self._publish_announced(grid, r)
        else:
            ids = courier.push(grid, list(self.configure_train(r, ArrayRecord(), ConfigRecord(), grid)))
        if courier.data_plane is not None and r < num_rounds:
            # Round r+1's messages go out now (tickets; its state is published later, each node's
            # own where a compressed downlink makes them differ: `_publish_announced`): each
            # SuperNode takes its next message as soon as it replied to this one, so Flower's
            # polling and process start overlap this round's work.
            courier.announce(grid, r + 1)
        return ids

    def _begin_ahead(self, grid: Grid, timeout: float, num_rounds: int) -> tuple[int, float, dict[str, int]] | None:
        """When the nodes hold the next round's tickets already, publish its state now, so that
        this round's evaluation and checkpoint overlap their download, not add to the round:
        (that round, when it started, message id -> node id of its messages)."""
        r = self.aggregator.round
        if not self.courier.is_announced(r) or r > num_rounds:
            return None
        return r, time.perf_counter(), self._begin_round(r, grid, timeout, num_rounds)

    def _finish_round(self, r: int, metrics: MetricRecord | None, seconds: float, aggregation_seconds: float,
                      num_rounds: int, rl: RoundLog) -> None:
        """Round `r`'s record (with an evaluation when due), then its checkpoint."""
        self.cum_bytes += rl.sent_bytes + max(rl.received.values(), default=0)
        due = r % self.cfg.eval_every == 0 or r == num_rounds
        record = self.recorder.round_record(r, rl, (metrics or {}).get("train_loss"), self.tokens, self.cum_bytes,
                                            seconds, aggregation_seconds, self.courier.take_refusals(),
                                            self.validate if due else None)
        if metrics and "outer_lr" in metrics:  # a late outer lr is set: the lr this round stepped with
            record["outer_lr"] = metrics["outer_lr"]
        self.recorder.add(record)
        self.recorder.save(r, self.aggregator.state_dict(), self.tokens, self.cum_bytes,
                           extra={"relay_partitions": {str(n): p for n, p in self._partitions.items()}})
        log.info("round %d: %s", r, rounded(record))

    def init_projections(self, grid: Grid, timeout: float) -> None:
        """LoRDO-Global, init_projection='gradient': one query phase before round 1 in which every
        client returns its gradient at θ0, the round-1 projections are fitted to their mean."""
        courier = self.courier
        courier.wait_for_nodes(grid, timeout)
        data = courier.encode(self.without_theta0(self.aggregator.gradient_request()))
        ids = courier.push(grid, courier.outgoing(0, data, grid.get_node_ids(), MessageType.QUERY))
        self.fit_initial_projections(courier.receive(grid, ids, timeout, 0, self.round_log), len(data))

    def fit_initial_projections(self, replies: Iterable[Message], sent_bytes: int) -> None:
        """Decode and check the round-0 gradient replies (dropping bad ones with `initial
        projections: dropped reply of node <id>[ (partition <p>)]: <reason>`), fit the round-1
        projections to the good ones."""
        agg = self.aggregator
        with self.courier.screened(replies, 0, "initial projections", lambda g: (agg.check_gradient(g), math.nan),
                                   lambda ids, norms, reasons: agg.screen_gradient_round(ids, reasons),
                                   RoundLog()) as usable:
            result = agg.init_projections_refs([ref for ref, _, _ in usable])
        self.cum_bytes += sent_bytes + max((size for _, size, _ in usable), default=0)
        log.info("round-1 projections fitted to the mean gradient of %d clients", len(result.accepted))

    # ----------------------------------------------------------------------------- helpers
    def without_theta0(self, state: GlobalState) -> GlobalState:
        """`state` without θ while θ is still the seeded θ0 (both sides derive it: not sent)."""
        if not self.theta_is_seeded:
            return state
        return dataclasses.replace(state, params={}, params_from_seed=True, params_delta=False)

    def validate(self) -> dict:
        """The validation metrics of the global θ on the held-out batches."""
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.aggregator.params[n])
        return evaluate(self.model, self.val_batches)

    def theta_record(self) -> ArrayRecord:
        """The global θ as Flower arrays (the run's Result)."""
        return ArrayRecord({n: Array(p.detach().cpu().numpy()) for n, p in self.aggregator.params.items()})

    def resume(self, path: str) -> None:
        """Continue from a checkpoint: θ, outer state, projections, synced states, counters, RNG, and which
        node sent each reply a relaying state carries (so each node's first state leaves its own out).

        `path` is a round JSON or a checkpoint directory (`Recorder.load`: its newest complete
        checkpoint, named in errors and the log). A checkpoint of another run is refused before
        anything is written, so a wrong `resume` never costs the checkpoints already in out_dir.
        """
        tensors, meta, source = self.recorder.load(path)
        self.recorder.adopt(meta, source)
        self.aggregator.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("rng/")})
        set_rng_state(tensors)
        self.tokens, self.cum_bytes = meta["tokens"], meta["cum_bytes"]
        self.recorder.history = list(meta["history"])
        self._partitions = {int(n): int(p) for n, p in meta.get("relay_partitions", {}).items()}
        self.resumed_meta = meta
        self.resumed_tensors = {k: v for k, v in tensors.items() if k.startswith("async_acc/")}
        log.info("resumed from %s at round %d", source, self.aggregator.round)
        self.recorder.warn_if_schedule_differs(meta)
