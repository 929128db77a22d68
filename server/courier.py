"""The server's side of the wire: state out, replies in.

Out: a round's messages, each carrying the encoded global state (Flower's own data plane) or a
ticket to fetch it from the gRPC data plane (`lordo_fed.transport.server`), announced a round
ahead where the nodes can take them early and published once the state is encoded; pushed
through the Grid. In: replies polled fast until the round deadline, each decoded and checked,
bad ones dropped with a log line naming the node and the reason (`Courier.screened`).

The strategies (server/strategy.py, server/async_strategy.py) hold one `Courier`; what a round
saw on the wire goes into its `RoundLog` (server/records.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from lordo_fed.app.config import AppConfig
from lordo_fed.app.records import (EXPLICIT_KEYS, IDENTIFY, ROUND_TIMEOUT, SESSION, TICKET, UPLOAD_DIGEST,
                                   is_simulation, payload_bytes, payload_record, shorten_pull_backoff)
from lordo_fed.transport.server import DataPlaneServer, Upload
from lordo_fed.wire.codec import PayloadError
from lordo_fed.wire.compress import SparseValues
from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import StreamingEncode, encode_global_state
from lordo_fed.rounds.relay import relayed_of
from lordo_fed.rounds.screening import ReplyRef
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.payload import Payload
from server.records import RoundLog

log = logging.getLogger("lordo_fed.server")

#: A usable reply: its ref (the aggregator loads it when it asks), its payload size, its client's metrics.
Usable = tuple[ReplyRef, int, MetricRecord]


class Courier:
    """Messages, tickets, the data plane, polling and the screening of replies, for one run."""

    def __init__(self, cfg: AppConfig, explicit_keys: Iterable[str], model_id: str, payload: Payload,
                 max_upload: int, spool: Path):
        self.cfg = cfg
        # The run-config keys the user set: every message names them, so that clients compose the
        # same settings from the same merged run config (lordo_fed.app.config.load_app_config).
        self.explicit_keys = ",".join(sorted(explicit_keys))
        self.model_id = model_id
        self.wire_dtype = payload.wire_dtype
        self.codecs = payload.receiver_specs
        """The compressed codecs replies may use: those of the run's payload preset (none for fp32/bf16)."""
        self.relay = payload.codecs is not None and payload.codecs.relay
        """A relaying preset: each usable reply's ref also reads it as received (`ReplyRef.relayed`)."""
        self.max_upload = max_upload
        """The largest reply a node may upload (a bigger upload is refused before it is stored)."""
        self.spool = spool
        self.data_plane: DataPlaneServer | None = None
        self._announced: dict[int, dict[str, int]] = {}
        """Rounds whose messages went out ahead of their state: message id -> node id."""
        self.announced_at: dict[int, float] = {}
        """When each of them went out (time.perf_counter(): the round's `phase_seconds`, server/records.py)."""

    # ----------------------------------------------------------------------------- the data plane
    def start(self, grid: Grid) -> None:
        """Host the gRPC data plane when the run asks for it ('grpc', or 'auto' in a deployment)."""
        dp = self.cfg.data_plane
        if dp.mode == "flower" or (dp.mode == "auto" and is_simulation(grid)):
            return
        self.data_plane = DataPlaneServer(self.spool, bind=dp.bind, port=dp.port,
                                          advertise=dp.address, tls=dp.tls(), stall_timeout=dp.stall_timeout,
                                          memory_budget=dp.memory_mb << 20, max_uploads=dp.max_uploads,
                                          checksum=dp.checksum).start()

    def stop(self) -> None:
        if self.data_plane is not None:
            self.data_plane.stop()
            self.data_plane = None

    def take_refusals(self) -> list | None:
        """What the data plane refused since the last call (None: no data plane, Flower's own)."""
        return None if self.data_plane is None else self.data_plane.take_refusals()

    # ----------------------------------------------------------------------------- state out
    def encode(self, state: GlobalState) -> memoryview:
        """`state` as one `lordo_fed.v1` payload, in a buffer the data plane may publish as it is
        (`encode_global_state`: not zero-filled first, no memset on the round's critical path)."""
        return encode_global_state(state, self.model_id, self.wire_dtype)

    def message_config(self, round_idx: int) -> dict[str, Any]:
        """What every message of a round says besides its payload: the round, the run-config keys
        the user set (clients compose the same settings from them) and the round deadline."""
        return {"round": round_idx, EXPLICIT_KEYS: self.explicit_keys, ROUND_TIMEOUT: float(self.cfg.round_timeout)}

    def outgoing(self, round_idx: int, data: bytes, node_ids: Iterable[int], message_type: str,
                 own: Mapping[int, bytes] | None = None) -> list[Message]:
        """One message per node: the encoded state itself (data plane 'flower'), or a ticket to
        fetch it from the gRPC data plane, with the tokens of this node and round. `own`: node id ->
        the encoded state that node gets instead of `data` (a relaying state without its own reply)."""
        node_ids = list(node_ids)
        if self.data_plane is None:
            return self.flower_messages(round_idx, data, node_ids, message_type, own)
        tickets = self.data_plane.publish(round_idx, data, node_ids, ttl=self.cfg.round_timeout + 60,
                                          max_upload=self.max_upload, own=own)
        return self._ticket_messages(round_idx, tickets, message_type)

    def flower_messages(self, round_idx: int, data: bytes, node_ids: Iterable[int], message_type: str,
                        own: Mapping[int, bytes] | None = None) -> list[Message]:
        """One message per node with the encoded state inside it (Flower's own data plane): `data`, or
        the node's own (`own`), one record per distinct state (the nodes resent θ whole share one)."""
        own = own or {}
        records = {id(data): payload_record(data)}
        for d in own.values():
            if id(d) not in records:
                records[id(d)] = payload_record(d)
        config = ConfigRecord(self.message_config(round_idx))
        return [Message(content=RecordDict({"state": records[id(own.get(n, data))], "config": config}),
                        dst_node_id=n, message_type=message_type) for n in node_ids]

    def identify_messages(self, node_ids: Iterable[int]) -> list[Message]:
        """One query per node asking which partition it trains (no state)."""
        config = ConfigRecord({IDENTIFY: 1, **self.message_config(0)})
        return [Message(content=RecordDict({"config": config}), dst_node_id=n, message_type=MessageType.QUERY)
                for n in node_ids]

    def _ticket_messages(self, round_idx: int, tickets: dict[int, Any], message_type: str,
                         session: bool = False) -> list[Message]:
        """One message per node carrying its data-plane ticket (no payload); with `session`, the
        ticket starts the node's asynchronous session (lordo_fed/node/session.py)."""
        config = {**self.message_config(round_idx), **({SESSION: 1} if session else {})}
        return [Message(content=RecordDict({"config": ConfigRecord({**config, TICKET: t.SerializeToString()})}),
                        dst_node_id=n, message_type=message_type) for n, t in tickets.items()]

    def open_session(self, grid: Grid, round_idx: int, node_id: int) -> str | None:
        """Start `node_id`'s asynchronous session at `round_idx` on the data plane: one train
        message with its first ticket (its start point follows with `data_plane.publish_to`).
        Returns the message id (its reply comes when the session ends), None if not accepted."""
        ticket = self.data_plane.open_session(node_id, round_idx, ttl=2 * self.cfg.round_timeout + 60,
                                              max_upload=self.max_upload)
        ids = self.push(grid, self._ticket_messages(round_idx, {node_id: ticket}, MessageType.TRAIN, session=True))
        return next(iter(ids), None)

    def announce(self, grid: Grid, round_idx: int) -> None:
        """Push the train messages of a round whose state is not published yet (data plane
        tickets with no size/digest: the node's download waits for the publish). Valid two round
        deadlines: the node may take the message while the previous round still runs."""
        tickets = self.data_plane.announce(round_idx, list(grid.get_node_ids()), ttl=2 * self.cfg.round_timeout + 60,
                                           max_upload=self.max_upload)
        self._announced[round_idx] = self.push(grid, self._ticket_messages(round_idx, tickets, MessageType.TRAIN))
        self.announced_at[round_idx] = time.perf_counter()

    def is_announced(self, round_idx: int) -> bool:
        return round_idx in self._announced

    def announced_nodes(self, round_idx: int) -> set[int]:
        """The nodes that hold an announced round's tickets."""
        return set(self._announced.get(round_idx, {}).values())

    def start_encoding(self, state: GlobalState) -> StreamingEncode:
        """`encode` on a thread, readable as it fills (what `publish_announced` serves)."""
        return StreamingEncode(state, self.model_id, self.wire_dtype)

    def publish_announced(self, grid: Grid, round_idx: int, state: StreamingEncode | memoryview,
                          own: Mapping[int, bytes] | None = None) -> dict[str, int]:
        """Publish the state of an announced round: one being encoded, while it is encoded
        (`DataPlaneServer.publish_encoding`: the nodes' waiting downloads start on its first bytes;
        returns once it is encoded), or one encoded already, with `own`: node id -> the state that
        node downloads instead (`outgoing`). Nodes that connected since the announcement get their
        message now, once the states are whole. Returns message id -> node id of all the round's messages."""
        ids = self._announced.pop(round_idx)
        self.announced_at.pop(round_idx, None)
        announced = set(ids.values())
        late = [n for n in grid.get_node_ids() if n not in announced]
        if isinstance(state, StreamingEncode) and not late:
            self.data_plane.publish_encoding(round_idx, state)
        else:  # publishes too, with the digests in the late nodes' tickets
            data = state.result() if isinstance(state, StreamingEncode) else state
            messages = self.outgoing(round_idx, data, late, MessageType.TRAIN, own)
            if messages:
                ids.update(self.push(grid, messages))
        return ids

    @staticmethod
    def push(grid: Grid, messages: list[Message]) -> dict[str, int]:
        """Push `messages`; returns message id -> destination node id."""
        shorten_pull_backoff()
        return {mid: msg.metadata.dst_node_id for mid, msg in zip(grid.push_messages(messages), messages) if mid}

    def wait_for_nodes(self, grid: Grid, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(list(grid.get_node_ids())) < self.cfg.min_clients:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than min_clients={self.cfg.min_clients} nodes connected after {timeout:.0f}s")
            time.sleep(0.2)

    # ----------------------------------------------------------------------------- replies in
    def receive(self, grid: Grid, ids: dict[str, int], timeout: float, round_idx: int, rl: RoundLog) -> list[Message]:
        """Poll for the replies to the messages `ids` until all came or the deadline: every 20 ms
        for a second, then every 0.1 s; on the data plane every 0.5 s while the pending nodes'
        uploads for round `round_idx` are still to come, and every 20 ms once they are in. The
        phases reached and the nodes that sent nothing go into `rl`.

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
                    rl.marks.setdefault("uploads_in", time.perf_counter())
                    time.sleep(0.02)
            else:
                time.sleep(0.02 if time.monotonic() - start < 1.0 else 0.1)
        rl.marks["replies_in"] = time.perf_counter()
        rl.missing = [f"node {ids[mid]}" for mid in sorted(pending)]
        for who in rl.missing:
            log.warning("no reply from %s within the round deadline (%.0fs); excluded from this round", who, timeout)
        for mid, reason in sorted(unavailable.items()):
            rl.missing.append(f"node {ids[mid]}")
            log.warning("no reply from node %s: %s; excluded from this round", ids[mid], reason.rstrip(". "))
        return replies

    def decode(self, payload: bytes | memoryview, adopt: bool = False, keep_compressed: bool = False,
               sparse: bool = False) -> WorkerUpdate:
        """A reply's payload as a WorkerUpdate of this run's model (PayloadError when it is not one);
        `adopt`: fp32 tensors are views of a writable `payload` instead of copies; `keep_compressed`:
        compressed tensors as received; `sparse`: Δ's top-k tensors as `SparseValues`
        (lordo_fed.wire.decode)."""
        return decode_update(payload, expected_model_id=self.model_id, adopt=adopt, codecs=self.codecs,
                             keep_compressed=keep_compressed, sparse=sparse)

    def _relayed(self, update: WorkerUpdate, source: Callable[[], Any]) -> Callable[[], WorkerUpdate]:
        """A relaying preset: the reply as the next state relays it (`ReplyRef.relayed`), taken from the bytes
        its screening decode checked (`relay.relayed_of`: no second decode), or decoded again as received when
        a Δ tensor is not a top-k one kept sparse. Either way it owns its bytes: it outlives the upload."""
        reply = relayed_of(update)
        return (lambda: reply) if reply is not None else (lambda: self.decode(source(), keep_compressed=True))

    @contextlib.contextmanager
    def screened(self, replies: Iterable[Message], round_idx: int, phase: str,
                 check: Callable[[WorkerUpdate], tuple[str | None, float]],
                 screen_round: Callable[[Sequence[int], Sequence[float], Sequence[str | None]], list[str | None]],
                 rl: RoundLog) -> Iterator[list[Usable]]:
        """(ref, payload size, client metrics) of every reply that decodes and passes screening,
        in partition order (sums in a fixed order are reproducible, whatever the arrival order).

        Each reply is decoded on arrival for `check` (its tensors' names, shapes, finiteness, and
        its ||Δ|| for the outlier rule), and the ref keeps that decode for the aggregator, so each
        reply is decoded once, while the kept decodes fit in `data-plane-memory-mb` beyond their
        payloads (on either path): an upload held in the data plane's memory decodes in place
        (`adopt`: its fp32 tensors are views of the upload's buffer, nothing beyond it), a top-k Δ
        stays sparse (`SparseValues`: 12 bytes a sent value, 1/30 of its dense decode at 3%
        density), and any other tensor (an int8 one decoded to fp32, a spilled or Flower-path
        reply's copy) counts its dense bytes. A reply past that budget is decoded again when the
        aggregator asks, one at a time (`Aggregator.aggregate_refs`), so the server's memory stays
        bounded whatever the number of replies. The payloads stay where they arrived until the
        block ends: on the data plane, in its memory budget or spilled to disk; on Flower's path, in
        the messages. A ref must not be loaded after the block: the upload buffers its kept decodes
        view are then released for later uploads. Each refused reply is logged as `<phase>: dropped reply of node <id>[
        (partition <p>)]: <reason>` (`<phase>: node <id> failed: ...` for an error reply) and
        recorded in `rl.dropped`; decoding time goes to `rl.decode_seconds`."""
        held = []  # data-plane uploads, discarded when the block ends
        kept: dict[int, WorkerUpdate] = {}  # decodes kept for the aggregator, dropped when the block ends
        kept_budget = self.cfg.data_plane.memory_mb << 20  # bytes they may hold beyond their payloads

        def load_kept(index: int) -> WorkerUpdate:
            if index not in kept:
                raise RuntimeError(f"{phase}: a reply loaded after its screening block ended (its upload buffer "
                                   "was released)")
            return kept[index]
        entries: list[tuple[str, ReplyRef, int, MetricRecord, str | None, float, int]] = []
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
                    update = self.decode(payload, adopt=self.data_plane is not None, sparse=True)
                    extra = _held_bytes(update, payload)
                    del payload
                    reason, norm = check(update)
                    keep = reason is None and extra <= kept_budget  # a refused reply is never loaded
                except (PayloadError, ValueError, KeyError) as err:
                    rl.dropped[who] = str(err)
                    log.warning("%s: dropped reply of %s: %s", phase, who, err)
                    continue
                finally:
                    rl.decode_seconds += time.perf_counter() - decode_started
                if keep:
                    kept_budget -= extra
                    kept[len(entries)] = update
                    load = (lambda index=len(entries): load_kept(index))
                else:
                    load = (lambda source=source: self.decode(source(), sparse=True))
                relayed = self._relayed(update, source) if self.relay else None
                ref = ReplyRef.of(update, load=load, norm=norm, relayed=relayed)
                del update
                entries.append((f"{who} (partition {ref.worker_id})", ref, size, msg.content.get("metrics", MetricRecord()),
                                reason, norm, msg.metadata.src_node_id))
            entries.sort(key=lambda e: e[1].worker_id)
            reasons = screen_round([e[1].worker_id for e in entries], [e[5] for e in entries], [e[4] for e in entries])
            usable = []
            for (who, ref, size, metrics, _, _, node), reason in zip(entries, reasons):
                if reason is not None:
                    rl.dropped[who] = reason
                    log.warning("%s: dropped reply of %s: %s", phase, who, reason)
                else:
                    usable.append((ref, size, metrics))
                    rl.partitions[node] = ref.worker_id
            yield usable
        finally:
            kept.clear()
            for upload in held:
                upload.discard()

    def _upload_of(self, msg: Message, round_idx: int) -> Upload:
        """The data-plane upload a reply vouches for (its digest must match); ValueError naming
        what is wrong, with the data plane's own refusals of this node when it has any."""
        node = msg.metadata.src_node_id
        upload = self.data_plane.upload(node, round_idx)
        config = msg.content.config_records.get("upload")
        declared = str(config.get(UPLOAD_DIGEST, "")) if config is not None else ""
        if upload is None:
            refused = [r.reason for r in self.data_plane.refusals if r.node_id == node and r.round == round_idx]
            raise ValueError("no verified upload on the data plane" + (f" (refused: {'; '.join(refused)})" if refused else ""))
        if upload.digest != declared:
            upload.discard()
            raise ValueError(f"the reply vouches for digest {declared[:16] or 'none'}..., the data plane received "
                             f"{upload.digest[:16]}...")
        return upload


def _held_bytes(update: WorkerUpdate, payload) -> int:
    """What keeping the decode `update` costs beyond `payload`, which is held anyway: the bytes of its
    `SparseValues` and of its tensors that own memory; nothing for a view of `payload` (decoded in place)."""
    buf = np.frombuffer(payload, dtype=np.uint8)
    start = buf.ctypes.data
    held = 0
    for t in update.tensors().values():
        if isinstance(t, SparseValues):
            held += t.nbytes
        elif not start <= t.data_ptr() < start + buf.nbytes:
            held += t.numel() * t.element_size()
    return held
