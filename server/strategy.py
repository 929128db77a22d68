"""The LoRDO strategy: Flower's message-API Strategy around the library's Aggregator.

Each round (shared/docs/ALGORITHM.md, "One round"): send every connected client the global state
it needs (θ, the shared projections, the averaged states that are due) as one `lordo_fed.v1`
payload; collect replies until the round deadline, polling fast; decode and validate each reply
(schema, model identity, names, shapes, dtypes, finiteness) and drop bad ones with a log line
naming the client and the reason; aggregate through `lordo_fed.rounds.aggregator.Aggregator` (token
weights, outer update, Global projection refit and moment rotation); evaluate on the held-out
split every N rounds; write JSONL/TensorBoard metrics and an atomic checkpoint.

`start()` is our own: the stock loop has a separate evaluate phase per round (a second round trip)
and polls every 3 s; one phase per round and fast polling cut the per-round overhead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.result import Result

from lordo_fed.app.config import AppConfig
from lordo_fed.app.records import (EXPLICIT_KEYS, ROUND_TIMEOUT, TICKET, UPLOAD_SHA256, is_simulation, payload_bytes,
                                   payload_record, shorten_pull_backoff)
from lordo_fed.checkpoint import set_rng_state
from lordo_fed.data import load_dataset
from lordo_fed.evaluation import evaluate
from lordo_fed.rounds.build import build_run
from lordo_fed.rounds.screening import ReplyRef
from lordo_fed.transport.server import DataPlaneServer
from lordo_fed.wire.codec import PayloadError
from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import encode_global_state, encode_global_state_into, encoded_size, new_buffer
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from server.records import Recorder, RoundLog, rounded

log = logging.getLogger("lordo_fed.server")


class LoRDOStrategy(Strategy):
    """Server side of a LoRDO (or DiLoCo / Local Adam / DES-LOC) run over Flower."""

    def __init__(self, cfg: AppConfig, explicit_keys: Iterable[str] = ()):
        self.cfg = cfg
        # The run-config keys the user set: every message names them, so that clients compose the
        # same settings from the same merged run config (lordo_fed.app.config.load_app_config).
        self.explicit_keys = ",".join(sorted(explicit_keys))
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
        self.tokens = 0
        self.cum_bytes = 0
        self._round_log = RoundLog()
        self.data_plane: DataPlaneServer | None = None
        self._announced: dict[int, dict[str, int]] = {}
        """Rounds whose messages went out ahead of their state: message id -> node id."""
        self._theta_is_seeded = not cfg.resume
        """θ is still θ0, the seeded init every client builds itself: it is not sent (until a round is applied)."""
        self._acked: set[int] | None = None
        """Nodes whose reply to the last round arrived (None: any node, e.g. after a resume): with
        a compressed downlink the others are sent θ_c whole."""
        # The largest reply a node may upload: Δ plus at most three full-size states (u, v, E) in
        # fp32, and room for names and metrics. A bigger upload is refused before it is stored.
        self.max_upload = 4 * 4 * sum(p.numel() for p in self.model.parameters()) + (1 << 20)
        self.codecs = self.payload.receiver_specs
        """The compressed codecs replies may use: those of the run's payload preset (none for fp32/bf16)."""
        if cfg.resume:
            self.resume(cfg.resume)

    # ----------------------------------------------------------------------------- Strategy API
    def summary(self) -> None:
        c = self.cfg
        log.info("\t├── LoRDO strategy: variant %s, %d rounds of K=%d local steps", c.variant, c.num_rounds,
                 c.rounds.local_steps)
        log.info("\t├── Model %s (id %s), inner %s rank %d ω=%.3g lr=%.3g, outer %s", c.model.preset, self.model_id,
                 self.settings.inner.name, c.inner.rank, c.inner.omega, c.inner.lr, self.settings.outer.name)
        log.info("\t├── Sync periods (K_u, K_v) = (%d, %d), x %d for parameters that are not low-rank; projections: %s",
                 self.settings.rounds.sync_exp_avg_every, self.settings.rounds.sync_exp_avg_sq_every,
                 self.settings.rounds.dense_sync_factor,
                 self.settings.inner.projection if self.settings.inner.name == "lordo" else "none")
        log.info("\t├── Payload %s; min clients %d; round timeout %.0fs; eval every %d rounds", c.payload_dtype,
                 c.min_clients, c.round_timeout, c.eval_every)
        log.info("\t└── Outputs: %s", self.out_dir)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per connected node, all carrying the same encoded global state; with a
        compressed downlink, a node that did not reply last round (it may not hold the clients'
        copy of θ the state's change applies to) gets θ_c whole instead, inside the message."""
        nodes = list(grid.get_node_ids())
        data = self._encode_round(server_round)
        if not self.aggregator.downlink_due() or self._acked is None:
            return self._outgoing(server_round, data, nodes, MessageType.TRAIN)
        resync = [n for n in nodes if n not in self._acked]
        messages = self._outgoing(server_round, data, [n for n in nodes if n in self._acked], MessageType.TRAIN)
        if resync:
            log.info("round %d: nodes %s get θ whole (no reply from them last round)", server_round, resync)
            whole = encode_global_state(self.aggregator.resync_state(), self.model_id, self.payload.wire_dtype)
            messages += self._flower_messages(server_round, whole, resync, MessageType.TRAIN)
        return messages

    def _encode_round(self, server_round: int) -> bytearray | memoryview:
        """The round's global state, encoded once for every node; starts the round's log."""
        state = self._without_theta0(self.aggregator.global_state())
        if state.round != server_round:
            raise RuntimeError(f"aggregator is at round {state.round}, asked to configure {server_round}")
        encode_started = time.perf_counter()
        dtype = self.payload.wire_dtype
        if self.data_plane is None:
            data = encode_global_state(state, self.model_id, dtype)
        else:  # no memset of a fresh buffer on the round's critical path (encode.new_buffer)
            data = new_buffer(encoded_size(state, self.model_id, dtype))
            encode_global_state_into(state, self.model_id, data, dtype)
        self._round_log = RoundLog(sent_bytes=len(data), encode_seconds=time.perf_counter() - encode_started,
                                   marks={"published": time.perf_counter()})
        return data

    def _announce(self, round_idx: int, node_ids: Iterable[int]) -> list[Message]:
        """Train messages for a round whose state is not published yet (data plane tickets with
        no size/sha256: the node's download waits for the publish). Valid two round deadlines:
        the node may take the message while the previous round still runs."""
        tickets = self.data_plane.announce(round_idx, list(node_ids), ttl=2 * self.cfg.round_timeout + 60,
                                           max_upload=self.max_upload)
        return self._ticket_messages(round_idx, tickets, MessageType.TRAIN)

    def _message_config(self, round_idx: int) -> dict[str, Any]:
        """What every message of a round says besides its payload: the round, the run-config keys
        the user set (clients compose the same settings from them) and the round deadline."""
        return {"round": round_idx, EXPLICIT_KEYS: self.explicit_keys, ROUND_TIMEOUT: float(self.cfg.round_timeout)}

    def _ticket_messages(self, round_idx: int, tickets: dict[int, Any], message_type: str) -> list[Message]:
        """One message per node carrying its data-plane ticket (no payload)."""
        config = self._message_config(round_idx)
        return [Message(content=RecordDict({"config": ConfigRecord({**config, TICKET: t.SerializeToString()})}),
                        dst_node_id=n, message_type=message_type) for n, t in tickets.items()]

    def _publish_announced(self, round_idx: int, grid: Grid, announced: set[int]) -> dict[str, int]:
        """Encode and publish the state of an announced round; nodes that connected since the
        announcement get their message now (message id -> node id of those)."""
        data = self._encode_round(round_idx)
        late = [n for n in grid.get_node_ids() if n not in announced]
        if late:  # publishes too
            return self._push(grid, self._outgoing(round_idx, data, late, MessageType.TRAIN))
        self.data_plane.publish(round_idx, data)
        return {}

    def _outgoing(self, round_idx: int, data: bytes, node_ids: Iterable[int], message_type: str) -> list[Message]:
        """One message per node: the encoded state itself (data plane 'flower'), or a ticket to
        fetch it from the gRPC data plane, with the tokens of this node and round."""
        node_ids = list(node_ids)
        if self.data_plane is None:
            return self._flower_messages(round_idx, data, node_ids, message_type)
        tickets = self.data_plane.publish(round_idx, data, node_ids, ttl=self.cfg.round_timeout + 60,
                                          max_upload=self.max_upload)
        return self._ticket_messages(round_idx, tickets, message_type)

    def _flower_messages(self, round_idx: int, data: bytes, node_ids: Iterable[int], message_type: str) -> list[Message]:
        """One message per node with the encoded state inside it (Flower's own data plane)."""
        record = payload_record(data)
        config = ConfigRecord(self._message_config(round_idx))
        return [Message(content=RecordDict({"state": record, "config": config}), dst_node_id=n,
                        message_type=message_type) for n in node_ids]

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
        rl = self._round_log
        try:
            return self._aggregate_train(server_round, replies, rl)
        finally:
            self._acked = set(rl.replied)  # these nodes hold this round's copy of θ

    def _aggregate_train(self, server_round: int, replies: Iterable[Message],
                         rl: RoundLog) -> tuple[ArrayRecord | None, MetricRecord | None]:
        with self._screened_refs(replies, server_round, f"round {server_round}", self.aggregator.check_reply,
                                 self.aggregator.screen_round, rl) as usable:
            refs = []
            for ref, size, metrics in usable:
                rl.received[ref.worker_id] = size
                rl.client_seconds[ref.worker_id] = float(metrics.get("client-seconds", 0.0))
                # all of the round's local steps: an overlapped round's early ones ran before its message
                rl.client_train_seconds[ref.worker_id] = (float(metrics.get("train-seconds", 0.0))
                                                          + float(metrics.get("early-seconds", 0.0)))
                rl.client_codec_seconds[ref.worker_id] = float(metrics.get("codec-seconds", 0.0))
                rl.client_transfer_seconds[ref.worker_id] = float(metrics.get("transfer-seconds", 0.0))
                rl.client_metrics[ref.worker_id] = {k: float(v) for k, v in metrics.items()
                                                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
                if metrics.get("link-bytes-per-second", 0):
                    rl.link_rate[ref.worker_id] = float(metrics["link-bytes-per-second"])
                if metrics.get("fresh-state", 0):
                    rl.fresh_state.append(ref.worker_id)
                if metrics.get("clientapp-torch", 0):
                    rl.clientapp_torch += 1
                refs.append(ref)
            if len(refs) < self.cfg.min_clients:
                log.warning("round %d: %d usable replies < min_clients=%d; round skipped, global state unchanged",
                            server_round, len(refs), self.cfg.min_clients)
                self.aggregator.skip_round()  # the next round is a new attempt with the same θ
                return None, MetricRecord({"clients-ok": len(refs)})
            result = self.aggregator.aggregate_refs(refs)
        self._theta_is_seeded = False
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
        self._start_data_plane(grid)  # before anything is written: a bad TLS setting stops the run here
        self.recorder.start_clock()
        if self.aggregator.round == 1:
            self.recorder.add({"round": 0, "step": 0, "tokens": 0, **self._evaluate(),
                               "elapsed_seconds": self.recorder.elapsed()})
        self.recorder.open()
        try:
            if self.aggregator.needs_gradient_init:
                self._init_projections(grid, timeout)
            begun: tuple[int, float, dict[str, int]] | None = None
            while self.aggregator.round <= num_rounds:
                r = self.aggregator.round
                if begun is not None and begun[0] == r:  # published while the last round was finished
                    _, started, ids = begun
                else:
                    started = time.perf_counter()
                    ids = self._begin_round(r, grid, timeout, num_rounds)
                begun = None
                replies = self._receive(grid, ids, timeout, r)
                agg_started = time.perf_counter()
                _, metrics = self.aggregate_train(r, replies)
                aggregation_seconds = time.perf_counter() - agg_started
                if metrics is not None:
                    result.train_metrics_clientapp[r] = metrics
                rl, seconds = self._round_log, time.perf_counter() - started
                rl.marks["started"] = started
                if self.aggregator.round in self._announced and self.aggregator.round <= num_rounds:
                    # The nodes hold the next round's tickets: publish its state now, so that this
                    # round's evaluation and checkpoint overlap their download, not add to the round.
                    begun = (self.aggregator.round, time.perf_counter(),
                             self._begin_round(self.aggregator.round, grid, timeout, num_rounds))
                self._finish_round(r, metrics, seconds, aggregation_seconds, num_rounds, rl)
        finally:
            self._stop_data_plane()
        self.recorder.close()
        result.arrays = ArrayRecord({n: _array(p) for n, p in self.aggregator.params.items()})
        return result

    def _begin_round(self, r: int, grid: Grid, timeout: float, num_rounds: int) -> dict[str, int]:
        """Send round `r` to the nodes (its state, or the tickets to it), or publish it when its
        messages went out a round ahead; on the data plane, announce round r+1 as well. Returns
        message id -> node id of the round's messages."""
        self._wait_for_nodes(grid, timeout)
        ids = self._announced.pop(r, None)
        if ids is None:
            ids = self._push(grid, list(self.configure_train(r, ArrayRecord(), ConfigRecord(), grid)))
        else:  # the nodes hold this round's tickets already: publish its state
            ids.update(self._publish_announced(r, grid, set(ids.values())))
        if self.data_plane is not None and r < num_rounds and self.aggregator.client_params is None:
            # Round r+1's messages go out now (tickets; its state is published later):
            # each SuperNode takes its next message as soon as it replied to this one,
            # so Flower's polling and process start overlap this round's work.
            self._announced[r + 1] = self._push(grid, self._announce(r + 1, grid.get_node_ids()))
        return ids

    def _finish_round(self, r: int, metrics: MetricRecord | None, seconds: float, aggregation_seconds: float,
                      num_rounds: int, rl: RoundLog) -> None:
        """Round `r`'s record (with an evaluation when due), then its checkpoint."""
        self.cum_bytes += rl.sent_bytes + max(rl.received.values(), default=0)
        due = r % self.cfg.eval_every == 0 or r == num_rounds
        refusals = self.data_plane.take_refusals() if self.data_plane is not None else None
        record = self.recorder.round_record(r, rl, (metrics or {}).get("train_loss"), self.tokens, self.cum_bytes,
                                            seconds, aggregation_seconds, refusals, self._evaluate if due else None)
        self.recorder.add(record)
        self.recorder.save(r, self.aggregator.state_dict(), self.tokens, self.cum_bytes)
        log.info("round %d: %s", r, rounded(record))

    def _init_projections(self, grid: Grid, timeout: float) -> None:
        """LoRDO-Global, init_projection='gradient': one query phase before round 1 in which every
        client returns its gradient at θ0, the round-1 projections are fitted to their mean."""
        self._wait_for_nodes(grid, timeout)
        data = encode_global_state(self._without_theta0(self.aggregator.gradient_request()), self.model_id,
                                   self.payload.wire_dtype)
        messages = self._outgoing(0, data, grid.get_node_ids(), MessageType.QUERY)
        self.fit_initial_projections(self._receive(grid, self._push(grid, messages), timeout, 0), len(data))

    def fit_initial_projections(self, replies: Iterable[Message], sent_bytes: int) -> None:
        """Decode and check the round-0 gradient replies (dropping bad ones with `initial
        projections: dropped reply of node <id>[ (partition <p>)]: <reason>`), fit the round-1
        projections to the good ones."""
        agg = self.aggregator
        with self._screened_refs(replies, 0, "initial projections", lambda g: (agg.check_gradient(g), math.nan),
                                 lambda ids, norms, reasons: agg.screen_gradient_round(ids, reasons),
                                 RoundLog()) as usable:
            result = agg.init_projections_refs([ref for ref, _, _ in usable])
        self.cum_bytes += sent_bytes + max((size for _, size, _ in usable), default=0)
        log.info("round-1 projections fitted to the mean gradient of %d clients", len(result.accepted))

    # ----------------------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _screened_refs(self, replies: Iterable[Message], round_idx: int, phase: str,
                       check: Callable[[WorkerUpdate], tuple[str | None, float]],
                       screen_round: Callable[[Sequence[int], Sequence[float], Sequence[str | None]], list[str | None]],
                       rl: RoundLog) -> Iterator[list[tuple[ReplyRef, int, MetricRecord]]]:
        """(ref, payload size, client metrics) of every reply that decodes and passes screening,
        in partition order (sums in a fixed order are reproducible, whatever the arrival order).

        Bounded server memory: each reply is decoded once on arrival for `check` (its tensors'
        names, shapes, finiteness, and its ||Δ|| for the outlier rule), then dropped; the ref
        decodes it again from its payload when the aggregator asks (one reply at a time,
        `Aggregator.aggregate_refs`). The payloads stay where they arrived until the block ends:
        on the data plane, in its memory budget or spilled to disk; on Flower's path, in the
        messages. Each refused reply is logged as `<phase>: dropped reply of node <id>[
        (partition <p>)]: <reason>` (`<phase>: node <id> failed: ...` for an error reply) and
        recorded in `rl.dropped`; decoding time goes to `rl.decode_seconds`."""
        held = []  # data-plane uploads, discarded when the block ends
        entries: list[tuple[str, ReplyRef, int, MetricRecord, str | None, float]] = []
        try:
            for msg in replies:
                who = f"node {msg.metadata.src_node_id}"
                if msg.has_error():
                    rl.dropped[who] = f"error reply: {msg.error.reason}"
                    log.warning("%s: %s failed: %s", phase, who, msg.error.reason)
                    continue
                rl.replied.add(msg.metadata.src_node_id)
                decode_started = time.perf_counter()
                try:
                    if self.data_plane is None:
                        record = msg.content["update"]
                        source = (lambda record=record: payload_bytes(record))  # the message keeps the bytes
                    else:
                        upload = self._upload_of(msg, round_idx)
                        held.append(upload)
                        rl.transfer_seconds[msg.metadata.src_node_id] = upload.seconds
                        source = upload.buffer
                    payload = source()
                    size = len(payload)
                    update = decode_update(payload, expected_model_id=self.model_id, codecs=self.codecs)
                    del payload
                    reason, norm = check(update)
                except (PayloadError, ValueError, KeyError) as err:
                    rl.dropped[who] = str(err)
                    log.warning("%s: dropped reply of %s: %s", phase, who, err)
                    continue
                finally:
                    rl.decode_seconds += time.perf_counter() - decode_started
                ref = ReplyRef.of(update, load=lambda source=source: decode_update(source(), self.model_id,
                                                                                    codecs=self.codecs))
                del update
                entries.append((f"{who} (partition {ref.worker_id})", ref, size, msg.content.get("metrics", MetricRecord()),
                                reason, norm))
            entries.sort(key=lambda e: e[1].worker_id)
            reasons = screen_round([e[1].worker_id for e in entries], [e[5] for e in entries], [e[4] for e in entries])
            usable = []
            for (who, ref, size, metrics, _, _), reason in zip(entries, reasons):
                if reason is not None:
                    rl.dropped[who] = reason
                    log.warning("%s: dropped reply of %s: %s", phase, who, reason)
                else:
                    usable.append((ref, size, metrics))
            yield usable
        finally:
            for upload in held:
                upload.discard()

    def _without_theta0(self, state: GlobalState) -> GlobalState:
        """`state` without θ while θ is still the seeded θ0 (both sides derive it: not sent)."""
        if not self._theta_is_seeded:
            return state
        return dataclasses.replace(state, params={}, params_from_seed=True, params_delta=False)

    def _upload_of(self, msg: Message, round_idx: int):
        """The data-plane upload a reply vouches for (its sha256 must match); ValueError naming
        what is wrong, with the data plane's own refusals of this node when it has any."""
        node = msg.metadata.src_node_id
        upload = self.data_plane.upload(node, round_idx)
        config = msg.content.config_records.get("upload")
        declared = str(config.get(UPLOAD_SHA256, "")) if config is not None else ""
        if upload is None:
            refused = [r.reason for r in self.data_plane.refusals if r.node_id == node and r.round == round_idx]
            raise ValueError("no verified upload on the data plane" + (f" (refused: {'; '.join(refused)})" if refused else ""))
        if upload.sha256 != declared:
            upload.discard()
            raise ValueError(f"the reply vouches for sha256 {declared[:16] or 'none'}..., the data plane received "
                             f"{upload.sha256[:16]}...")
        return upload

    def _start_data_plane(self, grid: Grid) -> None:
        """Host the gRPC data plane when the run asks for it ('grpc', or 'auto' in a deployment)."""
        dp = self.cfg.data_plane
        if dp.mode == "flower" or (dp.mode == "auto" and is_simulation(grid)):
            return
        self.data_plane = DataPlaneServer(self.out_dir / "dataplane_spool", bind=dp.bind, port=dp.port,
                                          advertise=dp.address, tls=dp.tls(), stall_timeout=dp.stall_timeout,
                                          memory_budget=dp.memory_mb << 20, max_uploads=dp.max_uploads).start()

    def _stop_data_plane(self) -> None:
        if self.data_plane is not None:
            self.data_plane.stop()
            self.data_plane = None

    def _wait_for_nodes(self, grid: Grid, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(list(grid.get_node_ids())) < self.cfg.min_clients:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than min_clients={self.cfg.min_clients} nodes connected after {timeout:.0f}s")
            time.sleep(0.2)

    @staticmethod
    def _push(grid: Grid, messages: list[Message]) -> dict[str, int]:
        """Push `messages`; returns message id -> destination node id."""
        shorten_pull_backoff()
        return {mid: msg.metadata.dst_node_id for mid, msg in zip(grid.push_messages(messages), messages) if mid}

    def _receive(self, grid: Grid, ids: dict[str, int], timeout: float, round_idx: int) -> list[Message]:
        """Poll for the replies to the messages `ids` until all came or the deadline: every 20 ms
        for a second, then every 0.1 s; on the data plane every 0.5 s while the pending nodes'
        uploads for round `round_idx` are still to come, and every 20 ms once they are in.

        (Flower's `grid.send_and_receive` polls every 3 s. In simulation replies come within
        ~0.1 s; in deployment not before the SuperNodes' own 3 s polling allows. A pull costs the
        SuperLink CPU, and on a machine shared with the nodes their training pays for it: on the
        data plane a node's reply follows its upload, so the server waits on the uploads and polls
        Flower fast only when the replies are due. Reply chunks still being uploaded are retried
        after 50 ms, not Flower's 1 s: lordo_fed.app.records.shorten_pull_backoff.)
        """
        pending = set(ids)
        replies: list[Message] = []
        unavailable: dict[str, str] = {}
        start = time.monotonic()
        deadline = start + timeout
        while pending and time.monotonic() < deadline:
            got = list(grid.pull_messages(pending))
            for m in got:
                node = ids.get(m.metadata.reply_to_message_id)
                if m.has_error() and node is not None and m.metadata.src_node_id != node:
                    # An error reply the SuperLink wrote itself (the node missed its heartbeats, e.g.
                    # it was killed; or the message expired): its src_node_id is the SuperLink's (1),
                    # not the node's. The node sent nothing: count it as missing, by its own id.
                    unavailable[m.metadata.reply_to_message_id] = m.error.reason
                else:
                    replies.append(m)
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending:
                break
            if self.data_plane is not None:
                left = max(0.0, deadline - time.monotonic())
                if self.data_plane.wait_for_uploads(round_idx, [ids[m] for m in pending], min(0.5, left)):
                    self._round_log.marks.setdefault("uploads_in", time.perf_counter())
                    time.sleep(0.02)
            else:
                time.sleep(0.02 if time.monotonic() - start < 1.0 else 0.1)
        self._round_log.marks["replies_in"] = time.perf_counter()
        self._round_log.missing = [f"node {ids[mid]}" for mid in sorted(pending)]
        for who in self._round_log.missing:
            log.warning("no reply from %s within the round deadline (%.0fs); excluded from this round", who, timeout)
        for mid, reason in sorted(unavailable.items()):
            self._round_log.missing.append(f"node {ids[mid]}")
            log.warning("no reply from node %s: %s; excluded from this round", ids[mid], reason.rstrip(". "))
        return replies

    def _evaluate(self) -> dict:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.aggregator.params[n])
        return evaluate(self.model, self.val_batches)

    def resume(self, path: str) -> None:
        """Continue from a checkpoint: θ, outer state, projections, synced states, counters, RNG.

        `path` is a round JSON or a checkpoint directory (`Recorder.load`: its newest complete
        checkpoint, named in errors and the log). A checkpoint of another run is refused before
        anything is written, so a wrong `resume` never costs the checkpoints already in out_dir.
        """
        tensors, meta, source = self.recorder.load(path)
        self.aggregator.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("rng/")})
        set_rng_state(tensors)
        self.tokens, self.cum_bytes = meta["tokens"], meta["cum_bytes"]
        self.recorder.history = list(meta["history"])
        self.resumed_meta = meta
        self.resumed_tensors = {k: v for k, v in tensors.items() if k.startswith("async_acc/")}
        log.info("resumed from %s at round %d", source, self.aggregator.round)
        self.recorder.warn_if_schedule_differs(meta)


def _array(t: torch.Tensor):
    from flwr.app import Array

    return Array(t.detach().cpu().numpy())
