"""The data plane's server: the ServerApp streams each round's state to the nodes and takes
their replies, over gRPC, beside Flower (which only carries a small `Ticket` per node).

Why: Flower 1.41's SuperLink-SuperNode path moves 25-33 MB/s on these machines where a bare
gRPC stream moves ~500 MB/s (docs/deployment.md, "The data plane"), and a 125M-parameter round is ~0.5 GB each
way per node. The payload format does not change: the encoded `lordo_fed.v1.GlobalState` goes
down and the encoded `lordo_fed.v1.WorkerUpdate` comes up, cut into chunks
(proto/lordo_fed/v1/dataplane.proto).

- One encoded state per round, shared by every node (`publish`), except for nodes given one of their
  own (`publish(own=...)`: a relaying state without the node's own reply, lordo_fed.rounds.relay); the
  previous round's states stay, older ones are dropped.
- Every call shows a capability token (lordo_fed.transport.tokens) bound to a node, a round and
  a direction. A refused call is logged as `data plane: refused <download|upload> of node <id>:
  <reason>` and kept in `refusals` for the round's report: a missing, malformed, forged, expired
  or replayed token, another node's or another round's token, an upload that declares or sends
  more than the round allows or more than it declared, one that ends short (the node died or
  the stream was cut), a digest mismatch or another checksum kind than the round's, and a stream
  that stalls longer than `stall_timeout`.
- Every payload carries a digest of the server's `checksum` kind, both ways (xxh3 by default,
  sha256 as an option: lordo_fed.transport.checksum says why).
- Uploads stream to a spool file (written as they arrive, hashed on the fly) and are published
  by an atomic rename only once whole and verified: nothing of a refused upload is ever read,
  and server memory does not grow with the payload or the number of nodes.
- TLS with the SuperLink's certificate and key (scripts/generate_certs.py) unless the deployment
  is explicitly insecure.
- Asynchronous sessions (`open_session`): a node trains round after round on the data plane alone.
  Each node has its own round and start point (`publish_to`); an upload's receipt carries the
  ticket of the node's next round, whose download waits until the server published it (or ends
  the session: `end_session`). Only the node's latest upload token counts, once.

The gRPC server is grpc.aio on an event loop in a background thread, so a stalled peer can be
timed out per chunk (`asyncio.wait_for`) without a thread per stream; its handlers are in
lordo_fed/transport/handlers.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import grpc

from lordo_fed.transport.checksum import CHECKSUMS, check_kind, digest_of
from lordo_fed.transport.framing import UPLOAD_DATA, unframe
from lordo_fed.transport.handlers import DataPlaneHandlers, Refusal, Refused, Upload
from lordo_fed.transport.tokens import DOWNLOAD, UPLOAD, TokenError, TokenIssuer
from lordo_fed.v1 import dataplane_pb2 as pb

if TYPE_CHECKING:  # the data plane loads without torch (tests/unit/test_layout.py): duck-typed at run time
    from lordo_fed.wire.encode import StreamingEncode

log = logging.getLogger("lordo_fed.dataplane")

CHUNK_BYTES = 4 << 20
"""Bytes per streamed message: large enough that per-message costs vanish (~500 MB/s measured
with 1-16 MB messages), small enough to bound each side's buffering."""
MESSAGE_LIMIT = CHUNK_BYTES + (1 << 20)
"""gRPC's max message size on both sides: one chunk plus the header fields."""


SERVICE = "lordo_fed.v1.DataPlane"
DOWNLOAD_METHOD = f"/{SERVICE}/Download"
UPLOAD_METHOD = f"/{SERVICE}/Upload"


def raw_bytes(raw: bytes) -> bytes:
    """The gRPC (de)serializer of messages framed by hand (lordo_fed.transport.framing): bytes as they are."""
    return raw


def _upload_chunk(raw: bytes) -> tuple[pb.UploadChunk, memoryview]:
    return unframe(raw, pb.UploadChunk, UPLOAD_DATA)


#: HTTP/2 flow-control window a stream starts with. Over a long-RTT path a small window caps a
#: stream far below its link (rate <= window / RTT: 64 KiB over 100 ms is 0.6 MB/s; a public
#: measurement of Flower over a ~100 ms WAN path fixed a 1.5 h round with 16 MB). gRPC's BDP probe
#: grows the window from there.
STREAM_WINDOW_BYTES = 16 << 20


def channel_options() -> list[tuple[str, int]]:
    """Both ends of the data plane: messages of a whole chunk, and large flow-control windows."""
    return [("grpc.max_send_message_length", MESSAGE_LIMIT), ("grpc.max_receive_message_length", MESSAGE_LIMIT),
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES), ("grpc.http2.bdp_probe", 1)]


class DataPlaneServer(DataPlaneHandlers):
    """Serves one run's rounds; start() binds, publish() opens a round, upload() collects replies."""

    def __init__(self, spool_dir: str | os.PathLike, bind: str = "127.0.0.1", port: int = 0,
                 advertise: str = "", tls: tuple[bytes, bytes] | None = None, stall_timeout: float = 30.0,
                 chunk_bytes: int = CHUNK_BYTES, issuer: TokenIssuer | None = None,
                 memory_budget: int = 1 << 30, max_uploads: int = 4, checksum: str = CHECKSUMS[0]):
        """`tls`: (PEM certificate chain, PEM private key), None for plaintext; `advertise`: the
        host nodes dial ('' = the bind host, 127.0.0.1 when binding all interfaces);
        `memory_budget`: bytes of replies held in memory at once, the rest spill to `spool_dir`
        (writing to the page cache runs at ~400 MB/s here, slower than the link: the first replies
        stay in RAM, and the server's memory stays bounded whatever the number of nodes);
        `max_uploads`: uploads read at once. The others wait, after their header (token, size)
        was checked, holding only gRPC's flow-control window: each stream being read costs the
        server ~45-90 MB of gRPC buffers and allocator arenas at 125m (results.md section 9), so
        this keeps its memory flat in the number of nodes, at the price of queueing uploads
        that arrive together (raise it when many nodes upload over slow links of their own);
        `checksum`: the digest kind of every payload, both ways (lordo_fed.transport.checksum)."""
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes}: expected 1..{CHUNK_BYTES}")
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout={stall_timeout!r}: expected seconds > 0")
        if not max_uploads >= 1:
            raise ValueError(f"max_uploads={max_uploads!r}: expected an integer >= 1")
        self.checksum = check_kind(checksum)
        self.spool_dir = Path(spool_dir)
        self.bind, self.port, self.tls, self.stall_timeout = bind, port, tls, stall_timeout
        self.advertise = advertise or ("127.0.0.1" if bind in ("0.0.0.0", "::", "[::]", "") else bind)
        self.chunk_bytes = chunk_bytes
        self.memory_budget = int(memory_budget)
        self._memory_used = 0
        self._spare: list[memoryview] = []
        """Buffers of discarded uploads, kept for the next ones within the budget: a new 200 MB
        buffer costs ~50,000 first-touch page faults on its first write (0.1-0.4 s here)."""
        self.issuer = issuer or TokenIssuer()
        self.refusals: list[Refusal] = []
        self._lock = threading.Lock()
        self._round: int | None = None
        self._blobs: dict[int, memoryview] = {}
        self._digest: dict[int, str] = {}
        self._events: dict[int, asyncio.Event] = {}
        """The current round's encoded state and the previous one's (a node that fell behind
        still trains the round it was sent, so its own state stays continuous)."""
        self._own: dict[int, dict[int, tuple[memoryview, str]]] = {}
        """Per round, the nodes given a state of their own (`publish(own=...)`): node -> (state, digest)."""
        self._filling: dict[int, tuple[StreamingEncode, Future]] = {}
        """A round's state still being encoded (`publish_encoding`): its encoding and the future of
        its digest, until the digest is known."""
        self._max_upload = 0
        self.max_uploads = int(max_uploads)
        self._upload_slots: asyncio.Semaphore | None = None  # made on the server's event loop
        self.active_uploads = 0
        self.peak_active_uploads = 0
        """Uploads being read now, and the most at once since start (tests, diagnostics)."""
        self._uploads: dict[tuple[int, int], Upload] = {}
        self._arrived = threading.Condition(self._lock)
        """Notified whenever an upload is stored (`wait_for_uploads`, `session_uploads`)."""
        self._sessions: dict[int, tuple[int, str]] = {}
        """Asynchronous sessions: node -> (the round whose reply it may upload, the nonce of the
        one upload token that counts for it)."""
        self._session_states: dict[int, tuple[int, memoryview, str]] = {}
        """node -> (round, encoded state, digest): the start point published to it last."""
        self._session_ended: set[int] = set()
        self._session_events: dict[int, asyncio.Event] = {}
        self._session_uploads: list[Upload] = []
        self._session_ttl = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lordo-dataplane-io")

    # ------------------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        """host:port the nodes dial."""
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"{host}:{self.port}"

    def start(self) -> "DataPlaneServer":
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lordo-dataplane", daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        log.info("data plane: serving on %s:%d (%s), advertised as %s", self.bind, self.port,
                 "TLS" if self.tls else "plaintext", self.address)
        return self

    async def _serve(self) -> int:
        self._upload_slots = asyncio.Semaphore(self.max_uploads)
        self._server = grpc.aio.server(options=channel_options())
        # The generated servicer's handlers, with the chunks (de)serialized by framing.py: same
        # wire bytes, the payload copied once (the generated stubs interoperate).
        handlers = {
            "Download": grpc.unary_stream_rpc_method_handler(
                self._serve_download, request_deserializer=pb.DownloadRequest.FromString, response_serializer=raw_bytes),
            "Upload": grpc.stream_unary_rpc_method_handler(
                self._serve_upload, request_deserializer=_upload_chunk,
                response_serializer=pb.UploadReceipt.SerializeToString),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        target = f"{self.bind}:{self.port}"
        if self.tls:
            port = self._server.add_secure_port(target, grpc.ssl_server_credentials([(self.tls[1], self.tls[0])]))
        else:
            port = self._server.add_insecure_port(target)
        if port == 0:
            raise OSError(f"data plane: cannot bind {target}")
        await self._server.start()
        return port

    def stop(self) -> None:
        if self._loop is None:
            return
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace=1.0), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = None
        self._io.shutdown(wait=True)
        for path in self.spool_dir.glob("*.part"):
            path.unlink(missing_ok=True)

    def __enter__(self) -> "DataPlaneServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------ rounds
    def publish(self, round_idx: int, data: bytes | bytearray | memoryview, node_ids=(), ttl: float = 0.0,
                max_upload: int = 0,
                own: Mapping[int, bytes | bytearray | memoryview] | None = None) -> dict[int, pb.Ticket]:
        """Serve `data` (the round's encoded GlobalState) from now on and return the tickets of
        `node_ids` (tokens valid `ttl` seconds; nodes announced earlier already hold theirs).
        `own`: node id -> the encoded state that node downloads instead (a relaying state without the
        node's own reply, lordo_fed.rounds.relay.for_worker; θ_c whole for a node that missed a round);
        its ticket names that state's size and digest, and the download token, bound to the node,
        fetches nothing else.
        Uploads are taken for this round only; replies of earlier rounds not collected yet are
        discarded. The previous round's state stays downloadable: a node that fell behind
        (stalled, slow) still trains the round it was sent and keeps its own state continuous,
        though its late reply is refused. Downloads waiting for this round start now."""
        digest = digest_of(self.checksum, data)
        digests: dict[int, str] = {}  # one per distinct state: the nodes resent θ whole share one
        for d in (own or {}).values():
            if id(d) not in digests:
                digests[id(d)] = digest_of(self.checksum, d)
        own = {int(n): (memoryview(d).cast("B"), digests[id(d)]) for n, d in (own or {}).items()}
        self._open_round(round_idx, memoryview(data).cast("B"), digest, None, max_upload, own)
        blobs = {n: own.get(int(n), (data, digest)) for n in node_ids}
        return {int(n): self._ticket(n, round_idx, ttl, max_upload or self._max_upload, len(b), d)
                for n, (b, d) in blobs.items()}

    def served(self, round_idx: int, node_id: int) -> tuple[memoryview, str | None, tuple | None] | None:
        """What `node_id` downloads of round `round_idx` now: (the encoded state, its digest, None) when the
        round gave the node one of its own (`publish(own=...)`), else the round's (its digest None while it
        is encoded, with the encoding and the future of its digest: `publish_encoding`); None: not served."""
        with self._lock:
            own = self._own.get(int(round_idx), {}).get(int(node_id))
            if own is not None:
                return own[0], own[1], None
            blob = self._blobs.get(int(round_idx))
            if blob is None:
                return None
            return blob, self._digest.get(int(round_idx)), self._filling.get(int(round_idx))

    def publish_encoding(self, round_idx: int, encoding: StreamingEncode) -> str:
        """Serve an announced round's state while it is still being encoded (`StreamingEncode` of
        the GlobalState): the downloads waiting for the round start at once, each chunk goes out as
        soon as it is written, and the digest, computed once here when the encoding is done, follows
        the data in a last chunk (dataplane.proto, `Chunk`). So the server's encode and digest no
        longer sit between the round's start and the nodes' first byte (docs/results.md section 18).
        Only for rounds announced before (their tickets name no size or digest). Returns the
        digest once the whole state is encoded; re-raises the encoding's error (the downloads
        then end with it)."""
        pending: Future[str] = Future()
        self._open_round(round_idx, memoryview(encoding.buffer).cast("B"), None, (encoding, pending), 0)
        try:
            encoding.result()
            digest = digest_of(self.checksum, encoding.buffer)
        except BaseException as err:
            pending.set_exception(err)
            raise
        with self._lock:
            if self._filling.get(int(round_idx), (None,))[0] is encoding:
                self._digest[int(round_idx)] = digest
                del self._filling[int(round_idx)]
        pending.set_result(digest)
        return digest

    def _open_round(self, round_idx: int, blob: memoryview, digest: str | None,
                    filling: tuple[StreamingEncode, Future] | None, max_upload: int,
                    own: dict[int, tuple[memoryview, str]] | None = None) -> None:
        """Round `round_idx` is served from now on (`publish`, `publish_encoding`): its state `blob`,
        its `digest` (None while `filling`: the encoding, and the future of the digest), and the nodes'
        `own` states with their digests; the previous round's states stay, older ones and uploads of
        other rounds go; waiting downloads start."""
        with self._lock:
            self._round = int(round_idx)
            self._max_upload = int(max_upload) or self._max_upload
            self._blobs = {r: b for r, b in self._blobs.items() if r == round_idx - 1}
            self._blobs[int(round_idx)] = blob
            self._own = {r: o for r, o in self._own.items() if r == round_idx - 1}
            self._own[int(round_idx)] = own or {}
            self._digest = {r: d for r, d in self._digest.items() if r in self._blobs and r != round_idx}
            self._filling = {r: f for r, f in self._filling.items() if r in self._blobs and r != round_idx}
            if digest is not None:
                self._digest[int(round_idx)] = digest
            if filling is not None:
                self._filling[int(round_idx)] = filling
            stale = [k for k in self._uploads if k[1] != round_idx]
            stale = [self._uploads.pop(key) for key in stale]
        for upload in stale:
            upload.discard()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._published(round_idx).set)

    def announce(self, round_idx: int, node_ids, ttl: float, max_upload: int) -> dict[int, pb.Ticket]:
        """Tickets for a round whose state does not exist yet (size 0, no digest): a node can
        start on them at once, and its download waits until `publish(round_idx, ...)` (its first
        chunk then declares size and digest). Lets Flower deliver round r+1's message while
        round r is still running, taking Flower's message latency off the critical path."""
        with self._lock:
            self._max_upload = max(self._max_upload, int(max_upload))
        return {int(n): self._ticket(n, round_idx, ttl, max_upload, 0, "") for n in node_ids}

    def _ticket(self, node_id: int, round_idx: int, ttl: float, max_upload: int, size: int, digest: str,
                session: bool = False) -> pb.Ticket:
        return pb.Ticket(address=self.address, round=int(round_idx), size=size, digest=digest, checksum=self.checksum,
                         download_token=self.issuer.issue(node_id, round_idx, DOWNLOAD, ttl),
                         upload_token=self.issuer.issue(node_id, round_idx, UPLOAD, ttl),
                         max_upload=int(max_upload), tls=self.tls is not None, session=session)

    def _published(self, round_idx: int) -> asyncio.Event:
        """The event set when `round_idx` is published (event-loop thread only)."""
        if round_idx not in self._events:
            self._events = {r: e for r, e in self._events.items() if r >= round_idx - 1}
            self._events[round_idx] = asyncio.Event()
        return self._events[round_idx]

    def upload(self, node_id: int, round_idx: int) -> Upload | None:
        """The verified reply of `node_id` for `round_idx`, if one arrived (the caller owns it and
        calls `Upload.discard()` when done)."""
        with self._lock:
            return self._uploads.pop((int(node_id), int(round_idx)), None)

    def wait_for_uploads(self, round_idx: int, node_ids, timeout: float) -> bool:
        """Block until each of `node_ids` has a verified upload for `round_idx` waiting to be
        collected, or `timeout` seconds; True when all have. Lets the server poll Flower for the
        replies slowly while the nodes train, and fast once their payloads are in (each poll
        costs the SuperLink CPU, which on a shared machine the nodes' training pays for)."""
        wanted = {(int(n), int(round_idx)) for n in node_ids}
        with self._arrived:
            return self._arrived.wait_for(lambda: wanted <= self._uploads.keys(), timeout)

    # ------------------------------------------------------------------------------ sessions
    def open_session(self, node_id: int, round_idx: int, ttl: float, max_upload: int) -> pb.Ticket:
        """Start (or restart) `node_id`'s asynchronous session at `round_idx` and return its first
        ticket (announced: the download waits for `publish_to`). Tokens issued to the node before
        no longer upload. `ttl` bounds each of its tickets: a node's next round may wait that long
        for its start point (a grace window, the virtual clock's order)."""
        node = int(node_id)
        ticket = self._ticket(node, round_idx, ttl, max_upload, 0, "", session=True)
        nonce = self.issuer.check(ticket.upload_token, node, UPLOAD).nonce
        with self._lock:
            self._max_upload = max(self._max_upload, int(max_upload))
            self._session_ttl = float(ttl)
            self._sessions[node] = (int(round_idx), nonce)
            self._session_ended.discard(node)
        return ticket

    def publish_to(self, node_id: int, round_idx: int, data: bytes | bytearray | memoryview) -> None:
        """Serve `data` (an encoded GlobalState) as `node_id`'s start point of `round_idx`: its
        waiting download starts now. Replaces the node's previous one."""
        digest = digest_of(self.checksum, data)
        node = int(node_id)
        with self._lock:
            self._session_states[node] = (int(round_idx), memoryview(data).cast("B"), digest)
        self._wake(node)

    def end_session(self, node_id: int) -> None:
        """No further round for `node_id`: its waiting (or next) download answers `finished`, and
        its uploads are refused until a new `open_session`."""
        node = int(node_id)
        with self._lock:
            self._sessions.pop(node, None)
            self._session_states.pop(node, None)
            self._session_ended.add(node)
        self._wake(node)

    def session_uploads(self, timeout: float) -> list[Upload]:
        """The verified session uploads that arrived (in arrival order), waiting up to `timeout`
        seconds for the first; the caller owns them (`Upload.discard()`)."""
        with self._arrived:
            self._arrived.wait_for(lambda: bool(self._session_uploads), timeout)
            out, self._session_uploads = self._session_uploads, []
        return out

    def _wake(self, node: int) -> None:
        """Wake `node`'s download waiting for its start point (runs on the event loop)."""
        def wake() -> None:
            event = self._session_events.pop(node, None)
            if event is not None:
                event.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(wake)

    def _session_event(self, node: int) -> asyncio.Event:
        """The event `_wake` sets for `node` (event-loop thread only)."""
        if node not in self._session_events:
            self._session_events[node] = asyncio.Event()
        return self._session_events[node]

    def take_refusals(self) -> list[Refusal]:
        with self._lock:
            out, self.refusals = self.refusals, []
        return out

    def _refuse(self, node_id: int, round_idx: int, what: str, reason: str,
                code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED) -> Refused:
        log.warning("data plane: refused %s of node %s (round %s): %s", what, node_id, round_idx, reason)
        with self._lock:
            self.refusals.append(Refusal(int(node_id), int(round_idx), what, reason))
        return Refused(code, reason)

    def _check(self, token: str, node_id: int, kind: str):
        """The token's claims; refused (logged) unless valid for this node and direction, and for
        the current round (uploads) or a round still served (downloads)."""
        with self._lock:
            current, served = self._round, sorted(self._blobs)
            session = self._sessions.get(int(node_id))
            ended = int(node_id) in self._session_ended
        if session is not None or ended:  # an asynchronous session: the node's own round
            return self._check_session(token, node_id, kind, session)
        if current is None and kind == UPLOAD:
            raise self._refuse(node_id, -1, kind, "no round is being served", grpc.StatusCode.UNAVAILABLE)
        current = -1 if current is None else current
        try:
            claims = self.issuer.check(token, node_id, kind)
        except TokenError as err:
            raise self._refuse(node_id, current, kind, str(err)) from None
        if kind == UPLOAD and claims.round != current:
            raise self._refuse(node_id, claims.round, kind, f"token for round {claims.round}, the data plane takes "
                               f"replies for round {current} (that round closed)")
        if kind == DOWNLOAD and claims.round not in served and claims.round <= current:
            raise self._refuse(node_id, claims.round, kind, f"token for round {claims.round}, the data plane serves "
                               f"rounds {served}")
        return claims


    def _take_session_upload(self, upload: Upload, claims) -> pb.UploadReceipt:
        """Store a session's verified upload for `session_uploads`, move the node to its next round
        and answer with that round's ticket; refused if the session moved on while it streamed."""
        node = upload.node_id
        ticket = self._ticket(node, claims.round + 1, self._session_ttl, self._max_upload, 0, "", session=True)
        nonce = self.issuer.check(ticket.upload_token, node, UPLOAD).nonce
        with self._lock:
            taken = self._sessions.get(node) == (claims.round, claims.nonce)
            if taken:
                self._sessions[node] = (claims.round + 1, nonce)
                self._session_uploads.append(upload)
                self._arrived.notify_all()
        if not taken:
            upload.discard()
            raise self._refuse(node, claims.round, UPLOAD, "the node's session moved on while the upload streamed",
                               grpc.StatusCode.FAILED_PRECONDITION)
        return pb.UploadReceipt(size=upload.size, digest=upload.digest, next=ticket)

    def _check_session(self, token: str, node_id: int, kind: str, session: tuple[int, str] | None):
        """`_check` for a node in an asynchronous session: an upload for the round it is at, with
        the one token that counts; a download of that round (or a later one: it waits)."""
        try:
            claims = self.issuer.check(token, node_id, kind)
        except TokenError as err:
            raise self._refuse(node_id, session[0] if session else -1, kind, str(err)) from None
        if session is None:
            if kind == UPLOAD:
                raise self._refuse(node_id, claims.round, kind, "the node's session has ended",
                                   grpc.StatusCode.FAILED_PRECONDITION)
            return claims  # the download answers `finished`
        round_idx, nonce = session
        if kind == UPLOAD and (claims.round != round_idx or claims.nonce != nonce):
            raise self._refuse(node_id, claims.round, kind, f"token for round {claims.round}, the node's session takes "
                               f"round {round_idx} with the token of its latest ticket")
        if kind == DOWNLOAD and claims.round < round_idx:
            raise self._refuse(node_id, claims.round, kind, f"token for round {claims.round}, the node's session is at "
                               f"round {round_idx}")
        return claims
