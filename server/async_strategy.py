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
from lordo_fed.rounds.async_rounds import Arrival, AsyncServer, Pull, VirtualClock, async_record
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

    # ----------------------------------------------------------------------------- the loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        num_rounds = num_rounds or self.cfg.num_rounds
        timeout = timeout or self.cfg.round_timeout
        log.info("Starting asynchronous LoRDO strategy (%s order):", self.cfg.async_rounds.order)
        self.summary()
        self.recorder.start_clock()
        if self.pushes == 0 and not self.recorder.history:
            self.recorder.add({"round": 0, "step": 0, "tokens": 0, "pushes": 0, "virtual_time": 0.0,
                               **self.validate(), "elapsed_seconds": 0.0})
        self.recorder.open()
        self.courier.wait_for_nodes(grid, timeout)
        nodes = self._identify(grid, timeout)
        if self.aggregator.needs_gradient_init:  # async LoRDO-Global: the round-1 bases from the gradients at θ0
            self.init_projections(grid, timeout)
        self._run(grid, nodes, num_rounds, timeout)
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

        def dispatch(pid: int, now: float) -> None:
            nonlocal committed
            steps = acfg.local_steps_of(pid, K)
            if committed + steps * step_tokens > budget:
                return
            r = self.rounds.get(pid, 0) + 1
            pull = server.pull()
            state = GlobalState(round=r, params=pull.params, projections=pull.projections, moments=pull.moments,
                                opt_step=self.opt_steps.get(pid, 0) if pull.opt_step is None else pull.opt_step)
            state = self.without_theta0(state)
            payload = self.courier.encode(state)
            sizes["sent"] = len(payload)
            ids = self.courier.push(grid, self.courier.outgoing(r, payload, [nodes[pid]], MessageType.TRAIN))
            if not ids:
                server.release(pull)
                log.warning("partition %d: the message to node %d was not accepted; left out", pid, nodes[pid])
                return
            committed += steps * step_tokens
            (mid,) = ids
            by_message[mid] = pid
            inflight[pid] = InFlight(nodes[pid], r, pull, steps * step_tokens, time.monotonic(), len(payload))
            clock.start(pid, now, acfg.seconds(pid, K))

        def fail(pid: int, reason: str, now: float) -> None:
            nonlocal committed
            flight = inflight.pop(pid)
            server.release(flight.pull)
            clock.remove(pid)
            committed -= flight.tokens
            failures[pid] += 1
            left = failures[pid] >= MAX_FAILURES or flight.node not in set(grid.get_node_ids())
            log.warning("partition %d (node %d) round %d: %s; %s", pid, flight.node, flight.round, reason,
                        "left out of the run" if left else "sending the round again")
            if not left:
                dispatch(pid, now)

        def apply(pid: int, msg: Message) -> None:
            flight = inflight.pop(pid)
            t = clock.remove(pid)
            if t is not None:  # its scheduled arrival on the virtual clock (arrival order: never earlier)
                self.virtual_time = max(self.virtual_time, t)
            who = f"node {flight.node} (partition {pid})"
            try:
                payload = payload_bytes(msg.content["update"])
                sizes["received"] = len(payload)
                self.cum_bytes += flight.nbytes + len(payload)  # this push's state down and reply up
                update = self.courier.decode(payload)
                reason = server.check(update, pid, flight.round)
            except (PayloadError, ValueError, KeyError) as err:
                update, reason = None, str(err)
            if reason is not None:
                # It did reach us: the node kept its round's state, its next round follows on.
                log.warning("push %d: dropped reply of %s: %s", self.pushes + 1, who, reason)
                server.release(flight.pull)
                arrival = Arrival(pid, self.virtual_time, server.version - flight.pull.version, False, reason)
                loss = None
            else:
                arrival = server.push(update, flight.pull, self.virtual_time)
                if not arrival.applied:
                    log.warning("push %d: dropped reply of %s: %s", self.pushes + 1, who, arrival.reason)
                else:
                    self.theta_is_seeded = False
                self.opt_steps[pid] = update.opt_step
                self.tokens += update.tokens
                loss = update.metrics.get("train_loss")
                metrics = msg.content.metric_records.get("metrics")
                if metrics is not None and metrics.get("fresh-state", 0):
                    fresh.append(pid)
            failures[pid] = 0
            self.rounds[pid] = flight.round
            self.pushes += 1
            window.append((arrival, loss))
            if not held:
                closes[0] = (self.virtual_time if virtual else time.monotonic()) + acfg.grace
            held.append(pid)
            if acfg.grace == 0:
                close_window()
            elif self.pushes % M == 0:  # a record every M replies, within a window too (as run_async)
                record()

        def record() -> None:
            """A record of the replies since the last one (evaluation, checkpoint)."""
            self._finish_record(window, M, max(nodes) + 1, num_rounds, sizes, virtual, len(fresh))
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

        for pid in sorted(nodes):
            if pid not in inflight:
                dispatch(pid, self.virtual_time)
        start = time.monotonic()
        while inflight or held:
            got = list(grid.pull_messages(list(by_message)))
            for msg in sorted(got, key=lambda m: by_message.get(m.metadata.reply_to_message_id, -1)):
                pid = by_message.pop(msg.metadata.reply_to_message_id, None)
                if pid is not None:
                    arrived[pid] = msg
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
                msg = arrived.pop(pid)
                if msg.has_error():
                    fail(pid, f"error reply: {msg.error.reason}", self.virtual_time)
                else:
                    apply(pid, msg)
                progressed = True
            now = time.monotonic()
            for pid, flight in list(inflight.items()):
                if pid not in arrived and now - flight.sent > timeout:
                    by_message = {m: p for m, p in by_message.items() if p != pid}
                    fail(pid, f"no reply within the round deadline ({timeout:.0f}s)", self.virtual_time)
            if not progressed:
                time.sleep(0.02 if now - start < 1.0 else 0.05)
        if window:
            self._finish_record(window, M, max(nodes) + 1, num_rounds, sizes, virtual, len(fresh))

    def _finish_record(self, window: list, M: int, width: int, num_rounds: int, sizes: dict, virtual: bool,
                       fresh: int) -> None:
        """A record of the last `M` pushes, an evaluation when due, a checkpoint."""
        data = self.cfg.data
        r = -(-self.pushes // M)
        step = self.tokens // (M * data.batch_size * data.seq_len)
        record = async_record(window, width, r, self.tokens, step, self.virtual_time, self.pushes, self.server.version)
        if not virtual:
            del record["virtual_time"]  # arrival order: real time is elapsed_seconds
        record.update({
            "bytes_sent_per_client": sizes["sent"], "bytes_received_per_client": sizes["received"],
            "cum_bytes_per_client": self.cum_bytes / M, "server_peak_rss_bytes": peak_rss_bytes(),
            "clients_fresh_state": fresh,
            "elapsed_seconds": self.recorder.elapsed(),
        })
        if r % self.cfg.eval_every == 0 or r >= num_rounds:
            record.update(self.validate())
        self.recorder.add(record)
        self.aggregator.round = r + 1
        tensors, counters = self.server.state_dict()
        self.recorder.save(r, self.aggregator.state_dict(), self.tokens, self.cum_bytes,
                           {"async": {**counters, "pushes": self.pushes, "rounds": self.rounds,
                                      "opt_steps": self.opt_steps, "virtual_time": self.virtual_time}}, tensors)
        log.info("round %d (%d pushes): %s", r, self.pushes, rounded(record))
