"""Asynchronous rounds over Flower (async DiLoCo, momentum look-ahead, HeLoCo, async LoRDO): a node gets its
next round as soon as its reply is applied, nobody waits for the slowest.

The server side of `lordo_fed.rounds.async_rounds` (docs/algorithm.md, "Asynchronous rounds") driven by
Flower's push/pull messages:

1. Every connected node is asked for its partition id (a query message that needs no model), so
   the schedule is kept per partition, as the reference trainer keeps it per worker.
2. Each partition is sent its own round: θ (θ̄ = θ − ημm with look-ahead), its own round number
   and step count. Its reply is decoded and screened on arrival (schema, model identity, the
   partition and round it was sent, names, shapes, finiteness; bad replies are dropped with a log
   line naming the node), then applied with one outer step (`AsyncServer.push`: staleness =
   outer steps since that node's pull; dropped past `async_rounds.max_staleness`); the node is
   sent its next round at once.
3. Replies are applied as they arrive (`async-order='arrival'`) or in the virtual clock's order
   (`'virtual'`: each partition takes local_steps x speeds[p] virtual seconds per round, exactly the
   schedule of the reference trainer's `run_async`, whatever the real timing; a test holds the
   two equal). With a grace window (`async-grace`: real seconds in arrival order, virtual ones in
   virtual order) the nodes whose replies were applied within it are sent their next round
   together when it closes, all from the same θ.
4. The budget is the synchronous run's tokens (num_rounds x nodes x K x batch x seq_len); a record,
   an evaluation (every eval_every records) and a checkpoint every `nodes` replies.
5. On the gRPC data plane (a deployment's default) a round is not a Flower message: each node runs
   a session there (lordo_fed/node/session.py; docs/deployment.md, "Asynchronous rounds on the data
   plane"). One Flower message opens it with the first ticket; the server publishes each node's
   start point to it alone (`DataPlaneServer.publish_to`), takes its uploads as they arrive
   (`session_uploads`), and ends the session when the budget is spent; the session's Flower
   reply only says that it ended (before its round's reply: a failure).
6. With `async-match-speed` each round's local steps are chosen from the node's measured speed
   (`SpeedMatch`) and travel in its start point (`GlobalState.local_steps`).
7. With a compressed payload preset a start point is the compressed change from what that node
   holds (`NodeCopies`: one θ_c per node, error feedback in what the change leaves out), its
   moments quantised: compressed both ways, as synchronous rounds.

A node whose message fails (error reply, or no reply within round_timeout) is sent the same round
again, twice at most, then left out. A resumed run continues from the checkpoint's θ, outer
momentum and per-partition rounds; work in flight when the server stopped is redone from the
resumed θ (consistent, not the same schedule as an uninterrupted run).

Messages, polling and decoding are the synchronous strategy's courier's (server/courier.py); the
records, plots and checkpoints its recorder's (server/records.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType
from flwr.serverapp import Grid
from flwr.serverapp.strategy.result import Result

from lordo_fed.app.config import AppConfig
from lordo_fed.rounds.async_rounds import Arrival, AsyncServer, NodeCopies, Pull, SpeedMatch, VirtualClock, async_record
from lordo_fed.transport.server import Upload
from lordo_fed.wire.codec import PayloadError
from lordo_fed.app.records import payload_bytes
from lordo_fed.metrics import peak_rss_bytes
from lordo_fed.wire.messages import GlobalState
from server.records import rounded
from server.strategy import LoRDOStrategy

log = logging.getLogger("lordo_fed.server")
MAX_FAILURES = 3
"""A partition whose message fails this many times in a row is left out of the run."""


@dataclass
class InFlight:
    """A round sent to a node and not answered yet."""

    node: int
    round: int
    pull: Pull
    """What the node was sent (the server's version then; async LoRDO: the basis it trains in)."""
    tokens: int
    """Tokens this round commits of the budget."""
    sent: float
    """time.monotonic() when it was pushed (the reply deadline counts from it)."""
    nbytes: int
    """Bytes of the state it was sent."""


class AsyncLoRDOStrategy(LoRDOStrategy):
    """Server side of an asynchronous variant (async_diloco, async_lookahead, heloco, async_lordo,
    heloco_lordo) over Flower."""

    def __init__(self, cfg: AppConfig, explicit_keys: Iterable[str] = ()):
        self.resumed_meta: dict = {}
        self.resumed_tensors: dict = {}
        super().__init__(cfg, explicit_keys)
        # θ, the outer optimizer and (async LoRDO) the shared projections and averaged moments are
        # the aggregator's: its checkpoint format and evaluation serve as they are.
        agg = self.aggregator
        self.server = AsyncServer(agg.params, agg.outer, self.settings.async_rule, cfg.async_rounds,
                                  lowrank=agg if agg.projection is not None else None)
        saved = self.resumed_meta.get("async", {})
        self.server.load_state_dict(self.resumed_tensors, saved)
        self.resumed_tensors = {}
        self.pushes = int(saved.get("pushes", 0))
        self.rounds: dict[int, int] = {int(k): int(v) for k, v in saved.get("rounds", {}).items()}
        """Partition -> its last round answered."""
        self.opt_steps: dict[int, int] = {int(k): int(v) for k, v in saved.get("opt_steps", {}).items()}
        """Partition -> its optimizer step count after that round (what its next message carries)."""
        self.virtual_time = float(saved.get("virtual_time", 0.0))
        self.starts: dict[int, float] = {int(k): float(v) for k, v in saved.get("starts", {}).items()}
        """Partition -> the virtual time its current round started, or its next one starts (a grace
        window's close): a resumed run restarts each round at it, keeping the virtual clock's schedule."""
        self.train_messages = 0
        """Train messages this server process sent through Flower: one per round, or one per
        session on the gRPC data plane (recorded as `train_messages`)."""
        self.local_steps: dict[int, int] = {}
        """Partition -> the local steps of its latest round (recorded with `async-match-speed`)."""

    # ----------------------------------------------------------------------------- the loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        num_rounds = num_rounds or self.cfg.num_rounds
        timeout = timeout or self.cfg.round_timeout
        log.info("Starting asynchronous LoRDO strategy (%s order):", self.cfg.async_rounds.order)
        self.summary()
        self.courier.start(grid)  # the data plane, where the nodes' sessions run (before anything is written)
        self.recorder.start_clock()
        if self.pushes == 0 and not self.recorder.history:
            self.recorder.add({"round": 0, "step": 0, "tokens": 0, "pushes": 0, "virtual_time": 0.0,
                               **self.validate(), "elapsed_seconds": 0.0})
        self.recorder.open()
        try:
            self.courier.wait_for_nodes(grid, timeout)
            nodes = self._identify(grid, timeout)
            if self.aggregator.needs_gradient_init:  # async LoRDO-Global: the round-1 bases from the gradients at θ0
                self.init_projections(grid, timeout)
            self._run(grid, nodes, num_rounds, timeout)
        finally:
            self.courier.stop()
        self.recorder.close()
        result = Result()
        result.arrays = self.theta_record()
        return result

    def _identify(self, grid: Grid, timeout: float) -> dict[int, int]:
        """Partition id -> node id of every connected node (a second node with a partition
        already taken is left out, with a warning)."""
        courier = self.courier
        ids = courier.push(grid, courier.identify_messages(sorted(grid.get_node_ids())))
        nodes: dict[int, int] = {}
        for msg in sorted(courier.receive(grid, ids, timeout, 0, self.round_log),
                          key=lambda m: m.metadata.src_node_id):
            node = msg.metadata.src_node_id
            if msg.has_error():
                log.warning("node %d did not say which partition it trains (%s); left out", node, msg.error.reason)
                continue
            pid = int(msg.content["metrics"]["partition-id"])
            if pid in nodes:
                log.warning("node %d also trains partition %d (node %d has it); left out", node, pid, nodes[pid])
                continue
            nodes[pid] = node
        if len(nodes) < self.cfg.min_clients:
            raise RuntimeError(f"{len(nodes)} nodes with distinct partitions < min_clients={self.cfg.min_clients}")
        self.cfg.async_rounds.check_workers(nodes)
        log.info("asynchronous rounds over partitions %s", {p: nodes[p] for p in sorted(nodes)})
        return nodes

    def _run(self, grid: Grid, nodes: dict[int, int], num_rounds: int, timeout: float) -> None:
        acfg, K = self.cfg.async_rounds, self.cfg.rounds.local_steps
        data = self.cfg.data
        M, step_tokens = len(nodes), data.batch_size * data.seq_len
        budget = M * num_rounds * K * step_tokens
        virtual = acfg.order == "virtual"
        server = self.server
        server.workers = M  # async LoRDO: the moments' blend weight 1/M and a refit every M replies
        clock = VirtualClock()
        inflight: dict[int, InFlight] = {}
        by_message: dict[str, int] = {}
        arrived: OrderedDict[int, Message] = OrderedDict()
        failures = {p: 0 for p in nodes}
        window: list[tuple[Arrival, float | None]] = []
        fresh: list[int] = []  # partitions whose node found no state of the previous round (logged by the node)
        held: list[int] = []  # partitions applied in the open grace window: sent their next round when it closes
        closes = [0.0]  # when that window closes: virtual seconds (virtual order) or time.monotonic() (arrival)
        sizes = {"sent": 0, "received": 0}
        committed = self.tokens  # tokens applied (or dropped) so far; in-flight rounds are added
        plane = self.courier.data_plane
        """The gRPC data plane: each node runs a session of rounds on it (one Flower message per
        session); None: every round is a Flower message."""
        sessions: dict[int, str] = {}  # partition -> the message id of its open session
        matcher = SpeedMatch(K) if acfg.match_speed else None
        copies = NodeCopies(self.payload.codecs)  # a compressed downlink: each node's copy θ_c
        self.local_steps = {pid: acfg.local_steps_of(pid, K) for pid in nodes}
        partition_of = {node: pid for pid, node in nodes.items()}

        def dispatch(pid: int, now: float) -> None:
            nonlocal committed
            steps = acfg.local_steps_of(pid, K)
            if matcher is not None:  # steps from the node's measured speed, the last round cut to the budget
                steps = min(matcher.steps(pid), (budget - committed) // step_tokens)
            if steps < 1 or committed + steps * step_tokens > budget:
                end_session(pid)
                return
            r = self.rounds.get(pid, 0) + 1
            pull = server.pull()
            state = GlobalState(round=r, params=pull.params, projections=pull.projections, moments=pull.moments,
                                opt_step=self.opt_steps.get(pid, 0) if pull.opt_step is None else pull.opt_step,
                                local_steps=steps if matcher is not None else 0)
            state = self.without_theta0(copies.start_point(pid, state, pull))
            payload = self.courier.encode(state)
            sizes["sent"] = len(payload)
            if plane is not None:  # the node's session gets its start point on the data plane (opened first)
                if pid not in sessions:
                    mid = self.courier.open_session(grid, r, nodes[pid])
                    if mid is not None:
                        sessions[pid] = mid
                        by_message[mid] = pid
                        self.train_messages += 1
                accepted = pid in sessions
                if accepted:
                    plane.publish_to(nodes[pid], r, payload)
            else:
                ids = self.courier.push(grid, self.courier.outgoing(r, payload, [nodes[pid]], MessageType.TRAIN))
                by_message.update({mid: pid for mid in ids})
                self.train_messages += len(ids)
                accepted = bool(ids)
            if not accepted:
                server.release(pull)
                copies.forget(pid)
                log.warning("partition %d: the message to node %d was not accepted; left out", pid, nodes[pid])
                return
            committed += steps * step_tokens
            self.local_steps[pid] = steps
            inflight[pid] = InFlight(nodes[pid], r, pull, steps * step_tokens, time.monotonic(), len(payload))
            clock.start(pid, now, acfg.seconds(pid, K))
            self.starts[pid] = now

        def end_session(pid: int) -> None:
            """No further round for this partition's node: its session's next download answers
            `finished` (its Flower reply then comes and is collected at the end)."""
            if plane is not None and pid in sessions:
                plane.end_session(nodes[pid])

        def fail(pid: int, reason: str, now: float) -> None:
            nonlocal committed
            flight = inflight.pop(pid)
            server.release(flight.pull)
            copies.forget(pid)  # it may not have applied the round's change: θ whole next time
            clock.remove(pid)
            committed -= flight.tokens
            failures[pid] += 1
            left = failures[pid] >= MAX_FAILURES or flight.node not in set(grid.get_node_ids())
            log.warning("partition %d (node %d) round %d: %s; %s", pid, flight.node, flight.round, reason,
                        "left out of the run" if left else "sending the round again")
            if plane is not None and pid in sessions:  # its session is over: a new one (a new message) redoes the round
                plane.end_session(flight.node)
                mid = sessions.pop(pid)
                by_message.pop(mid, None)
            if not left:
                dispatch(pid, now)

        def apply(pid: int, reply: Message | Upload) -> None:
            """Apply one reply: a Flower message, or a session's upload on the data plane."""
            flight = inflight.pop(pid)
            t = clock.remove(pid)
            if t is not None:  # its scheduled arrival on the virtual clock (arrival order: never earlier)
                self.virtual_time = max(self.virtual_time, t)
            who = f"node {flight.node} (partition {pid})"
            try:
                payload = reply.buffer() if isinstance(reply, Upload) else payload_bytes(reply.content["update"])
                sizes["received"] = len(payload)
                self.cum_bytes += flight.nbytes + len(payload)  # this push's state down and reply up
                update = self.courier.decode(payload)
                del payload
                reason = server.check(update, pid, flight.round)
            except (PayloadError, ValueError, KeyError) as err:
                update, reason = None, str(err)
            finally:
                if isinstance(reply, Upload):
                    reply.discard()
            if reason is not None:
                # It did reach us: the node kept its round's state, its next round follows on.
                log.warning("push %d: dropped reply of %s: %s", self.pushes + 1, who, reason)
                server.release(flight.pull)
                arrival = Arrival(pid, self.virtual_time, server.version - flight.pull.version, False, reason)
                loss = None
            else:
                if matcher is not None:
                    matcher.observe(pid, time.monotonic() - flight.sent, update.metrics.get("train_seconds", 0.0),
                                    flight.tokens // step_tokens)
                arrival = server.push(update, flight.pull, self.virtual_time)
                if not arrival.applied:
                    log.warning("push %d: dropped reply of %s: %s", self.pushes + 1, who, arrival.reason)
                else:
                    self.theta_is_seeded = False
                self.opt_steps[pid] = update.opt_step
                self.tokens += update.tokens
                loss = update.metrics.get("train_loss")
                if update.metrics.get("fresh_state", 0):
                    fresh.append(pid)
            failures[pid] = 0
            self.rounds[pid] = flight.round
            self.pushes += 1
            window.append((arrival, loss))
            if not held:
                closes[0] = (self.virtual_time if virtual else time.monotonic()) + acfg.grace
            held.append(pid)
            if virtual:  # its next round starts when the window closes (a checkpoint before then keeps that)
                self.starts[pid] = closes[0]
            if acfg.grace == 0:
                close_window()
            elif self.pushes % M == 0:  # a record every M replies, within a window too (as run_async)
                record()

        def record() -> None:
            """A record of the replies since the last one (evaluation, checkpoint)."""
            self._finish_record(window, M, max(nodes) + 1, num_rounds, sizes, virtual, len(fresh),
                                final=not inflight and not held)
            window.clear()
            fresh.clear()

        def window_closed() -> bool:
            """Whether the open grace window is over: in virtual order once no scheduled arrival
            is left within it (each one within it is applied first), else on the real clock."""
            if not held:
                return False
            if virtual:
                head = clock.peek()
                return head is None or head[0] > closes[0]
            return time.monotonic() >= closes[0]

        def close_window() -> None:
            """Send every partition of the window its next round, all from the same θ; then the
            record due (every M replies without a window; with one, those came in `apply`), and
            the last one when nothing is left in flight."""
            if virtual:
                self.virtual_time = max(self.virtual_time, closes[0])
            for pid in held:
                dispatch(pid, self.virtual_time)
            held.clear()
            if window and ((acfg.grace == 0 and self.pushes % M == 0) or not inflight):
                record()

        for pid in sorted(nodes):  # a resumed run: each round again from where it started on the virtual clock
            if pid not in inflight:
                dispatch(pid, self.starts.get(pid, self.virtual_time) if virtual else self.virtual_time)
        start = time.monotonic()
        last_poll = 0.0
        progressed = True
        while inflight or held:
            if plane is not None:  # waits up to 50 ms for an upload when the last pass did nothing
                for upload in plane.session_uploads(0.0 if progressed else 0.05):
                    pid = partition_of.get(upload.node_id)
                    flight = inflight.get(pid)
                    if flight is None or flight.round != upload.round or pid in arrived:
                        upload.discard()  # a session the server gave up on (its round was sent again)
                    else:
                        arrived[pid] = upload
            if plane is None or time.monotonic() - last_poll > 0.5:  # sessions: Flower replies only end them
                last_poll = time.monotonic()
                got = list(grid.pull_messages(list(by_message)))
                for msg in sorted(got, key=lambda m: by_message.get(m.metadata.reply_to_message_id, -1)):
                    pid = by_message.pop(msg.metadata.reply_to_message_id, None)
                    if pid is None:
                        continue
                    if plane is None:
                        arrived[pid] = msg
                        continue
                    sessions.pop(pid, None)  # the session is over: the next round opens a new one
                    if pid in inflight and pid not in arrived:
                        reason = f"error reply: {msg.error.reason}" if msg.has_error() else "its session ended"
                        fail(pid, f"{reason} before the round's reply", self.virtual_time)
            progressed = False
            while True:
                if window_closed():
                    close_window()
                    progressed = True
                if virtual:
                    head = clock.peek()
                    pid = head[1] if head is not None and head[1] in arrived else None
                else:
                    pid = next(iter(arrived), None)
                if pid is None:
                    break
                reply = arrived.pop(pid)
                if isinstance(reply, Message) and reply.has_error():
                    fail(pid, f"error reply: {reply.error.reason}", self.virtual_time)
                else:
                    apply(pid, reply)
                progressed = True
            now = time.monotonic()
            for pid, flight in list(inflight.items()):
                if pid not in arrived and now - flight.sent > timeout:
                    by_message = {m: p for m, p in by_message.items() if p != pid}
                    fail(pid, f"no reply within the round deadline ({timeout:.0f}s)", self.virtual_time)
            if not progressed and plane is None:
                time.sleep(0.02 if now - start < 1.0 else 0.05)
        if window:
            self._finish_record(window, M, max(nodes) + 1, num_rounds, sizes, virtual, len(fresh), final=True)
        if plane is not None:
            self._close_sessions(grid, sessions, by_message, nodes, timeout)

    def _close_sessions(self, grid: Grid, sessions: dict[int, str], by_message: dict[str, int], nodes: dict[int, int],
                        timeout: float) -> None:
        """End every session still open and collect their Flower replies (a node's session that
        failed is logged), so the nodes are free when the run ends."""
        plane = self.courier.data_plane
        for pid in sessions:
            plane.end_session(nodes[pid])
        pending = {mid for mid in by_message if by_message[mid] in sessions}
        deadline = time.monotonic() + min(timeout, 120.0)
        while pending and time.monotonic() < deadline:
            for msg in grid.pull_messages(list(pending)):
                pending.discard(msg.metadata.reply_to_message_id)
                if msg.has_error():
                    log.warning("node %d: its session ended with an error: %s", msg.metadata.src_node_id, msg.error.reason)
            time.sleep(0.1)
        if pending:
            log.warning("%d sessions did not report their end within %.0fs", len(pending), min(timeout, 120.0))

    def _finish_record(self, window: list, M: int, width: int, num_rounds: int, sizes: dict, virtual: bool,
                       fresh: int, final: bool = False) -> None:
        """A record of the last `M` pushes, an evaluation when due (and on the run's `final` record,
        whose round can fall short of num_rounds when nodes train their own steps), a checkpoint."""
        data = self.cfg.data
        r = -(-self.pushes // M)
        step = self.tokens // (M * data.batch_size * data.seq_len)
        record = async_record(window, width, r, self.tokens, step, self.virtual_time, self.pushes, self.server.version)
        if not virtual:
            del record["virtual_time"]  # arrival order: real time is elapsed_seconds
        record.update({
            "bytes_sent_per_client": sizes["sent"], "bytes_received_per_client": sizes["received"],
            "cum_bytes_per_client": self.cum_bytes / M, "server_peak_rss_bytes": peak_rss_bytes(),
            "clients_fresh_state": fresh, "train_messages": self.train_messages,
            **({"local_steps_by_worker": [self.local_steps.get(p, 0) for p in range(width)]}
               if self.cfg.async_rounds.match_speed else {}),
            "elapsed_seconds": self.recorder.elapsed(),
        })
        if r % self.cfg.eval_every == 0 or r >= num_rounds or final:
            record.update(self.validate())
        self.recorder.add(record)
        self.aggregator.round = r + 1
        tensors, counters = self.server.state_dict()
        self.recorder.save(r, self.aggregator.state_dict(), self.tokens, self.cum_bytes,
                           {"async": {**counters, "pushes": self.pushes, "rounds": self.rounds,
                                      "opt_steps": self.opt_steps, "virtual_time": self.virtual_time,
                                      "starts": self.starts}}, tensors)
        log.info("round %d (%d pushes): %s", r, self.pushes, rounded(record))
