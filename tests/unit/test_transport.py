"""The gRPC data plane on 127.0.0.1 (lordo_fed.transport): transfers are exact, and every bad
call is refused, logged with the node and the reason, and leaves nothing behind.

Bad streams are written by hand against the generated stub, as a hostile or broken node would.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from pathlib import Path

import grpc
import pytest
import xxhash

from lordo_fed.transport import client
from lordo_fed.transport.server import DataPlaneServer
from lordo_fed.transport.tokens import TokenError, TokenIssuer
from lordo_fed.v1 import dataplane_pb2 as pb
from lordo_fed.v1 import dataplane_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
NODE, OTHER = 11, 12
MB = 1 << 20


@pytest.fixture
def plane(tmp_path):
    with DataPlaneServer(tmp_path / "spool", chunk_bytes=256 << 10, stall_timeout=1.0) as server:
        yield server


def publish(server: DataPlaneServer, round_idx: int = 1, size: int = MB, max_upload: int = 4 * MB):
    data = os.urandom(size)
    return data, server.publish(round_idx, data, [NODE, OTHER], ttl=60, max_upload=max_upload)


def raw_upload(server: DataPlaneServer, messages, timeout: float = 10.0) -> grpc.RpcError | pb.UploadReceipt:
    with grpc.insecure_channel(server.address) as channel:
        try:
            return pb_grpc.DataPlaneStub(channel).Upload(iter(messages), timeout=timeout)
        except grpc.RpcError as err:
            return err


def assert_refused(server, caplog, result, what: str, reason: str, node: int = NODE):
    assert isinstance(result, grpc.RpcError), result
    assert reason in result.details()
    assert any(f"refused {what} of node {node}" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert server.upload(NODE, 1) is None
    assert not list(server.spool_dir.glob("*")), "a refused upload left bytes on the spool"


DIGESTS = {"xxh3": lambda b: xxhash.xxh3_128(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}
"""Each checksum kind, computed in one call by its library (the transport hashes chunk by chunk)."""


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["in-memory", "spilled"])
def test_round_trip_is_exact(tmp_path, budget, checksum):
    with DataPlaneServer(tmp_path / "spool", chunk_bytes=256 << 10, memory_budget=budget, checksum=checksum) as server:
        state, tickets = publish(server, size=3 * MB + 17)
        assert tickets[NODE].checksum == checksum and tickets[NODE].digest == DIGESTS[checksum](state)
        assert client.download(tickets[NODE], NODE) == state
        reply = os.urandom(2 * MB + 5)
        digest = client.upload(tickets[NODE], NODE, reply).digest
        assert digest == DIGESTS[checksum](reply)
        got = server.upload(NODE, 1)
        assert got.size == len(reply) and got.digest == digest and bytes(got.buffer()) == reply
        assert (got.path is None) == (budget > 0)  # spilled to a file only beyond the budget
        got.discard()
        assert server._memory_used == 0 and not list(server.spool_dir.glob("*"))


def test_bad_tokens_are_refused(plane, caplog):
    caplog.set_level(logging.WARNING, "lordo_fed.dataplane")
    _, tickets = publish(plane)
    t = tickets[NODE]
    cases = [
        (ticket_with(t, download_token=""), NODE, "no token"),
        (ticket_with(t, download_token=t.download_token[:-4] + "AAAA"), NODE, "invalid token"),
        (ticket_with(t, download_token=TokenIssuer().issue(NODE, 1, "download", 60)),
         NODE, "invalid token (not issued by this server run)"),
        (t, OTHER, f"token issued to node {NODE}, presented by node {OTHER}"),
        (ticket_with(t, download_token=t.upload_token), NODE, "an upload token presented for a download"),
    ]
    for ticket, node, reason in cases:
        with pytest.raises(client.DataPlaneError, match="PERMISSION_DENIED") as err:
            client.download(ticket, node)
        assert reason in str(err.value)
        assert any(f"refused download of node {node}" in r.getMessage() and reason in r.getMessage()
                   for r in caplog.records), reason


def test_expired_and_other_round_tokens_are_refused(tmp_path):
    now = [1000.0]
    issuer = TokenIssuer(clock=lambda: now[0])
    token = issuer.issue(NODE, 3, "upload", ttl=10)
    assert issuer.check(token, NODE, "upload", 3).round == 3
    with pytest.raises(TokenError, match="token for round 3, the data plane serves round 4"):
        issuer.check(token, NODE, "upload", 4)  # (the server checks rounds itself: a window for downloads)
    now[0] += 11
    with pytest.raises(TokenError, match="token expired 1.0s ago"):
        issuer.check(token, NODE, "upload", 3)
    # Through the server: after round 2 was published, round 1's state is still served (a node
    # that fell behind trains it and keeps its own state continuous), its reply is refused;
    # after round 3, round 1 is no longer served.
    with DataPlaneServer(tmp_path / "spool") as server:
        state1, old = publish(server, 1)
        publish(server, 2)
        assert client.download(old[NODE], NODE) == state1
        with pytest.raises(client.DataPlaneError, match="token for round 1, the data plane takes replies for round 2"):
            client.upload(old[NODE], NODE, b"x" * 100)
        publish(server, 3)
        with pytest.raises(client.DataPlaneError, match=r"token for round 1, the data plane serves rounds \[2, 3\]"):
            client.download(old[NODE], NODE)


def test_replayed_upload_and_another_nodes_upload_token(plane, caplog):
    caplog.set_level(logging.WARNING, "lordo_fed.dataplane")
    _, tickets = publish(plane)
    client.upload(tickets[NODE], NODE, b"first reply")
    with pytest.raises(client.DataPlaneError, match="upload token already used \\(replayed\\)"):
        client.upload(tickets[NODE], NODE, b"second reply")
    with pytest.raises(client.DataPlaneError, match=f"token issued to node {OTHER}, presented by node {NODE}"):
        client.upload(tickets[OTHER], NODE, b"a reply under another node's token")
    assert bytes(plane.upload(NODE, 1).buffer()) == b"first reply"
    assert plane.upload(OTHER, 1) is None
    reasons = [(r.node_id, r.what, r.reason) for r in plane.take_refusals()]
    assert (NODE, "upload", "upload token already used (replayed)") in reasons


def header(ticket, size: int, data: bytes = b"", checksum: str | None = None) -> pb.UploadChunk:
    return pb.UploadChunk(token=ticket.upload_token, node_id=NODE, size=size, data=data,
                          checksum=ticket.checksum if checksum is None else checksum)


def ticket_with(ticket: pb.Ticket, **fields) -> pb.Ticket:
    out = pb.Ticket()
    out.CopyFrom(ticket)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def test_oversized_truncated_and_mismatched_uploads(plane, caplog):
    caplog.set_level(logging.WARNING, "lordo_fed.dataplane")
    _, tickets = publish(plane, max_upload=4 * MB)
    t = tickets[NODE]
    body = os.urandom(1000)
    digest = DIGESTS["xxh3"](body)  # the data plane's default checksum
    assert_refused(plane, caplog, raw_upload(plane, [header(t, 5 * MB)]), "upload",
                   f"declares {5 * MB} bytes; expected 1..{4 * MB}")
    assert_refused(plane, caplog, raw_upload(plane, [header(t, 1000, body), pb.UploadChunk(data=b"more")]), "upload",
                   "sent more than the 1000 bytes it declared")
    assert_refused(plane, caplog, raw_upload(plane, [header(t, 2000, body), pb.UploadChunk(digest=digest)]), "upload",
                   "stream ended after 1000 of the 2000 declared bytes (truncated)")
    tampered = bytes([body[0] ^ 1]) + body[1:]
    assert_refused(plane, caplog, raw_upload(plane, [header(t, 1000, tampered), pb.UploadChunk(digest=digest)]), "upload",
                   "xxh3 digest mismatch")
    # Another kind of checksum than the ticket's (here: none named, as a peer from before the
    # checksum fields, which reads as sha256) is refused before any data is read.
    sha = DIGESTS["sha256"](body)
    assert_refused(plane, caplog, raw_upload(plane, [header(t, 1000, body, checksum=""), pb.UploadChunk(digest=sha)]),
                   "upload", "declares checksum 'sha256'; expected the ticket's 'xxh3'")
    # The token is spent only by an accepted upload: the node can still send its real reply.
    receipt = raw_upload(plane, [header(t, 1000, body), pb.UploadChunk(digest=digest)])
    assert receipt.digest == digest and bytes(plane.upload(NODE, 1).buffer()) == body


def test_a_stalled_upload_is_dropped_at_its_deadline(plane, caplog):
    caplog.set_level(logging.WARNING, "lordo_fed.dataplane")
    _, tickets = publish(plane)

    def stalling():
        yield header(tickets[NODE], 1000, b"x" * 10)
        time.sleep(3.0)  # the server's stall_timeout is 1 s
        yield pb.UploadChunk(data=b"y" * 990)

    started = time.monotonic()
    result = raw_upload(plane, stalling())
    assert_refused(plane, caplog, result, "upload", "stream stalled for more than 1s after 10 of 1000 bytes")
    assert result.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3.0


def test_a_ticket_that_does_not_parse_or_is_incomplete():
    with pytest.raises(client.DataPlaneError, match="does not parse"):
        client.parse_ticket(b"\xff\xff\xff")
    with pytest.raises(client.DataPlaneError, match="ticket incomplete"):
        client.parse_ticket(pb.Ticket(address="127.0.0.1:1", size=3).SerializeToString())
    with pytest.raises(client.DataPlaneError, match=r"ticket incomplete .*xxh3 digest 'ab'"):
        client.parse_ticket(pb.Ticket(address="127.0.0.1:1", size=3, checksum="xxh3", digest="ab").SerializeToString())
    with pytest.raises(client.DataPlaneError, match=r"names checksum 'md5'; this node knows \('xxh3', 'sha256'\)"):
        client.parse_ticket(pb.Ticket(address="127.0.0.1:1", size=3, checksum="md5", digest="ab" * 16).SerializeToString())


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_a_corrupted_download_is_refused_before_decoding(tmp_path, checksum):
    """The node checks the downloaded bytes against the ticket's digest: state that changed after
    the ticket was made (one flipped bit) is refused, and nothing is returned to decode."""
    with DataPlaneServer(tmp_path / "spool", chunk_bytes=256 << 10, checksum=checksum) as server:
        state = bytearray(os.urandom(MB + 3))
        tickets = server.publish(1, state, [NODE], ttl=60, max_upload=MB)
        state[MB // 2] ^= 0x10  # the served buffer changes under the ticket's digest
        with pytest.raises(client.DataPlaneError, match=f"{checksum} digest mismatch"):
            client.download(tickets[NODE], NODE)


def test_data_plane_tls_settings_name_what_is_missing(tmp_path):
    from lordo_fed.app.config import DataPlaneConfig

    with pytest.raises(ValueError, match="data-plane='grpc' needs TLS: set data-plane-certfile and data-plane-keyfile"):
        DataPlaneConfig().tls()
    assert DataPlaneConfig(insecure=True).tls() is None
    missing = str(tmp_path / "server.pem")
    with pytest.raises(ValueError, match=f"run-config key 'data-plane-certfile'='{missing}': cannot read it"):
        DataPlaneConfig(certfile=missing, keyfile=missing).tls()


def test_an_announced_round_is_downloaded_once_published(plane):
    """Tickets handed out before the round's state exists: the download waits for the publish
    and checks what the stream's first chunk declares; the upload is taken once published."""
    import threading

    tickets = plane.announce(1, [NODE], ttl=60, max_upload=4 * MB)
    assert tickets[NODE].size == 0 and tickets[NODE].digest == ""
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(state=client.download(tickets[NODE], NODE, timeout=30)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), "the download did not wait for the publish"
    state = os.urandom(MB + 3)
    plane.publish(1, state)
    waiter.join(timeout=30)
    assert got["state"] == state
    client.upload(tickets[NODE], NODE, b"reply")
    assert bytes(plane.upload(NODE, 1).buffer()) == b"reply"


def test_a_node_given_its_own_state_downloads_it_and_no_other(plane, caplog):
    """`publish(own=...)`: NODE downloads its own state (its ticket names that state's size and digest), OTHER
    and a node announced earlier the round's; NODE's state cannot be fetched with another node's token; the
    previous round's own states stay served for a node that fell behind, until the round after."""
    caplog.set_level(logging.WARNING, "lordo_fed.dataplane")
    third = 13
    announced = plane.announce(1, [third], ttl=60, max_upload=4 * MB)
    state, mine = os.urandom(MB + 5), os.urandom(MB // 2 + 3)
    tickets = plane.publish(1, state, [NODE, OTHER], ttl=60, max_upload=4 * MB, own={NODE: mine})
    assert (tickets[NODE].size, tickets[NODE].digest) == (len(mine), DIGESTS["xxh3"](mine))
    assert (tickets[OTHER].size, tickets[OTHER].digest) == (len(state), DIGESTS["xxh3"](state))
    assert client.download(tickets[NODE], NODE) == mine
    assert client.download(tickets[OTHER], OTHER) == state
    assert client.download(announced[third], third) == state
    with pytest.raises(client.DataPlaneError, match=f"token issued to node {NODE}, presented by node {OTHER}"):
        client.download(tickets[NODE], OTHER)
    # OTHER's ticket made to name NODE's state: OTHER is served its own, which its check refuses
    with pytest.raises(client.DataPlaneError, match=rf"the server declares {len(state)} bytes .*the ticket {len(mine)}"):
        client.download(ticket_with(tickets[OTHER], size=len(mine), digest=tickets[NODE].digest), OTHER)
    plane.publish(2, os.urandom(100), [NODE], ttl=60)
    assert client.download(tickets[NODE], NODE) == mine  # round 1's own state, one round on
    plane.publish(3, os.urandom(100), [NODE], ttl=60)
    with pytest.raises(client.DataPlaneError, match=r"token for round 1, the data plane serves rounds \[2, 3\]"):
        client.download(tickets[NODE], NODE)


@pytest.mark.parametrize("cls,field,head", [
    (pb.Chunk, 1, {"size": 5 * MB, "digest": "ab" * 16, "checksum": "xxh3"}),
    (pb.Chunk, 1, {}),
    (pb.UploadChunk, 5, {"token": "t.k", "node_id": 2 ** 63 + 5, "size": 7}),
    (pb.UploadChunk, 5, {}),
])
def test_hand_framed_chunks_are_protobufs_bytes(cls, field, head):
    """framing.py writes what protobuf parses back to the same message (byte for byte protobuf's
    own output when the data field has the highest number, as in UploadChunk) and reads what
    protobuf reads, the data as a view into the message (no copy); repeated data fields follow
    protobuf's last-one-wins."""
    from lordo_fed.transport.framing import frame, unframe

    name = cls.DESCRIPTOR.fields_by_number[field].name
    data = os.urandom(1000)
    raw = frame(cls(**head), field, memoryview(data))
    assert cls.FromString(raw) == cls(**head, **{name: data})
    if cls is pb.UploadChunk:
        assert raw == cls(**head, **{name: data}).SerializeToString()
    msg, view = unframe(raw, cls, field)
    assert msg == cls(**head) and bytes(view) == data and view.obj is raw
    # data before the header, and two data fields: protobuf's parse decides
    swapped = cls(**{name: b"first"}).SerializeToString() + cls(**head).SerializeToString() + \
        cls(**{name: data}).SerializeToString()
    msg, view = unframe(swapped, cls, field)
    assert msg == cls(**head) and bytes(view) == data
    assert unframe(cls(**head).SerializeToString(), cls, field)[1].nbytes == 0


def test_a_client_on_the_generated_stubs_interoperates(plane):
    """The hand-framed server serves a node built from the generated protobuf stubs (the
    schema is the contract, not lordo_fed's client)."""
    data, tickets = publish(plane, size=3 * MB + 17)
    ticket = tickets[NODE]
    with grpc.insecure_channel(plane.address) as channel:
        chunks = list(pb_grpc.DataPlaneStub(channel).Download(
            pb.DownloadRequest(token=ticket.download_token, node_id=NODE), timeout=10))
    assert b"".join(c.data for c in chunks) == data
    assert (chunks[0].size, chunks[0].digest, chunks[0].checksum) == (len(data), DIGESTS["xxh3"](data), "xxh3")
    reply = os.urandom(MB + 3)
    receipt = raw_upload(plane, [pb.UploadChunk(token=ticket.upload_token, node_id=NODE, size=len(reply), data=reply,
                                                checksum="xxh3"),
                                 pb.UploadChunk(digest=DIGESTS["xxh3"](reply))])
    assert receipt.size == len(reply)
    assert bytes(plane.upload(NODE, 1).buffer()) == reply


def test_uploads_beyond_max_uploads_wait_their_turn_past_the_stall_deadline(tmp_path):
    """`max_uploads` = 1: a second node's upload, its header checked, waits while the first one
    streams for longer than the stall deadline (1 s), then goes through; never two read at once."""
    import threading

    with DataPlaneServer(tmp_path / "spool", chunk_bytes=256 << 10, stall_timeout=1.0, max_uploads=1) as server:
        _, tickets = publish(server)
        bodies = {NODE: os.urandom(1000), OTHER: os.urandom(1500)}
        first_reading = threading.Event()

        def slow(node: int):  # 10 bytes, then one every 0.4 s: alive, and 2.4 s in all
            body, t = bodies[node], tickets[node]
            yield pb.UploadChunk(token=t.upload_token, node_id=node, size=len(body), checksum=t.checksum)
            yield pb.UploadChunk(data=body[:10])
            first_reading.set()
            for i in range(6):
                time.sleep(0.4)
                yield pb.UploadChunk(data=body[10 + i:11 + i])
            yield pb.UploadChunk(data=body[16:], digest=DIGESTS["xxh3"](body))

        results = {}
        worker = threading.Thread(target=lambda: results.__setitem__(NODE, raw_upload(server, slow(NODE))))
        worker.start()
        assert first_reading.wait(10)
        started = time.monotonic()
        results[OTHER] = client.upload(tickets[OTHER], OTHER, bodies[OTHER]).digest  # queued behind NODE
        waited = time.monotonic() - started
        worker.join(10)
        assert isinstance(results[NODE], pb.UploadReceipt), results[NODE]
        assert waited > 1.5, f"the second upload did not wait for the first ({waited:.2f} s)"
        assert server.peak_active_uploads == 1 and server.active_uploads == 0
        assert server.take_refusals() == []
        for node, body in bodies.items():
            assert bytes(server.upload(node, 1).buffer()) == body


def test_upload_buffers_are_reused_within_the_budget(tmp_path):
    """A discarded upload's buffer serves the next one (no new memory to fault in each round);
    spares count against the memory budget with the uploads held, and make room when needed."""
    with DataPlaneServer(tmp_path / "spool", chunk_bytes=256 << 10, memory_budget=4 * MB) as server:
        _, tickets = publish(server, round_idx=1)
        first = os.urandom(MB + 3)
        client.upload(tickets[NODE], NODE, first)
        got = server.upload(NODE, 1)
        assert bytes(got.buffer()) == first
        base = got._base
        got.discard()
        assert server._memory_used == 0 and len(server._spare) == 1 and server._spare[0] is base
        _, tickets = publish(server, round_idx=2)
        second = os.urandom(MB - 100)  # smaller: fits the spare
        client.upload(tickets[NODE], NODE, second)
        got = server.upload(NODE, 2)
        assert got._base is base and bytes(got.buffer()) == second and got.size == len(second)
        big = os.urandom(2 * MB)  # needs a new buffer: 2 MB + the held 1 MB fit the 4 MB budget
        client.upload(tickets[OTHER], OTHER, big)
        other = server.upload(OTHER, 2)
        assert other.path is None and other._base is not base and bytes(other.buffer()) == big
        got.discard()
        other.discard()  # 1 MB + 2 MB spare: within the budget, both kept
        assert sorted(map(len, server._spare)) == [MB + 3, 2 * MB]
        _, tickets = publish(server, round_idx=3)
        huge = os.urandom(2 * MB + 10)  # fits no spare, and not beside them: they are dropped
        client.upload(tickets[NODE], NODE, huge)
        got = server.upload(NODE, 3)
        assert got.path is None and bytes(got.buffer()) == huge
        assert server._memory_used + sum(map(len, server._spare)) <= server.memory_budget
        got.discard()
        assert server._memory_used == 0


# ----------------------------------------------------------------------------- asynchronous sessions
def test_a_session_runs_rounds_on_the_data_plane_alone(plane, caplog):
    """A node's session: its first ticket (from a Flower message), then each upload's receipt
    carries the next round's ticket, whose download waits until the server publishes the node's
    own start point; the server ends it with `finished`. Each node has its own rounds and state;
    old, replayed, other-round and other-node tokens are refused with a reason; after the end no
    upload is taken."""
    caplog.set_level(logging.WARNING, logger="lordo_fed.dataplane")
    tickets = {node: plane.open_session(node, r, ttl=60, max_upload=MB) for node, r in ((NODE, 3), (OTHER, 1))}
    assert tickets[NODE].session and tickets[NODE].size == 0 and tickets[NODE].round == 3
    starts = {NODE: os.urandom(1000), OTHER: os.urandom(2000)}
    for node, r in ((NODE, 3), (OTHER, 1)):
        plane.publish_to(node, r, starts[node])
    for node in (NODE, OTHER):  # each downloads its own start point
        assert bytes(client.download(tickets[node], node)) == starts[node]
    reply = os.urandom(5000)
    receipt = client.upload(tickets[NODE], NODE, reply)
    nxt = receipt.next
    assert nxt.session and nxt.round == 4 and receipt.digest == DIGESTS["xxh3"](reply)
    (got,) = plane.session_uploads(1.0)
    assert (got.node_id, got.round, bytes(got.buffer())) == (NODE, 3, reply)
    got.discard()
    assert plane.session_uploads(0.0) == []

    # The next download waits for the server's publish (the reply being applied), then gets it.
    result = {}
    waiting = threading.Thread(target=lambda: result.__setitem__("data", bytes(client.download(nxt, NODE))))
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive(), "the download did not wait for the node's next start point"
    second = os.urandom(3000)
    plane.publish_to(NODE, 4, second)
    waiting.join(10)
    assert result["data"] == second

    # Refused: the spent token again, the previous round's download, another node's ticket, a
    # token minted for the right round but not the session's latest.
    with pytest.raises(client.DataPlaneError, match=r"upload token already used \(replayed\)"):
        client.upload(tickets[NODE], NODE, b"again")
    with pytest.raises(client.DataPlaneError, match="the node's session is at round 4"):
        client.download(tickets[NODE], NODE)
    with pytest.raises(client.DataPlaneError, match="token issued to node 12, presented by node 11"):
        client.upload(tickets[OTHER], NODE, b"under another node's token")
    stray = plane._ticket(NODE, 4, 60, MB, 0, "", session=True)  # valid MAC, not the one the receipt gave
    with pytest.raises(client.DataPlaneError, match="with the token of its latest ticket"):
        client.upload(stray, NODE, b"x")
    assert plane.session_uploads(0.0) == []

    # The other node goes on independently; then the server ends both sessions.
    assert client.upload(tickets[OTHER], OTHER, b"other's reply").next.round == 2
    (got,) = plane.session_uploads(1.0)
    assert (got.node_id, got.round) == (OTHER, 1)
    got.discard()
    plane.end_session(NODE)
    with pytest.raises(client.SessionEnded):
        client.download(nxt, NODE)
    with pytest.raises(client.DataPlaneError, match="the node's session has ended"):
        client.upload(nxt, NODE, b"after the end")
    assert plane.session_uploads(0.0) == []
    # A download already waiting when the session ends is answered `finished` too.
    other_next = plane._ticket(OTHER, 2, 60, MB, 0, "", session=True)  # what its receipt carried, in effect
    ended = {}

    def download_next() -> None:
        try:
            client.download(other_next, OTHER)
        except client.SessionEnded as err:
            ended["error"] = err
    waiting = threading.Thread(target=download_next)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive()
    plane.end_session(OTHER)
    waiting.join(10)
    assert "error" in ended
    refused = [r.reason for r in plane.take_refusals()]
    assert len(refused) == 5, refused


def test_a_session_download_is_not_taken_for_a_synchronous_ticket(plane):
    """A server that answers `finished` to a ticket that is not a session's is refused by the node."""
    plane.open_session(NODE, 1, ttl=60, max_upload=MB)
    plane.end_session(NODE)
    ticket = plane._ticket(NODE, 1, 60, MB, 0, "")  # not marked as a session
    with pytest.raises(client.DataPlaneError, match="the server ended a session, and this ticket is not one"):
        client.download(ticket, NODE)


def test_a_session_upload_is_checked_as_a_rounds(plane, caplog):
    """An asynchronous session's upload meets the checks of a synchronous round's (issue 32: "size and
    stall checks ... as in synchronous rounds"): too large, longer or shorter than declared, a digest that
    does not match, a stalled stream, each refused with its reason, nothing kept; the token is spent only
    by the accepted upload, whose receipt carries the next ticket."""
    caplog.set_level(logging.WARNING, "lordo_fed.dataplane")
    t = plane.open_session(NODE, 2, ttl=60, max_upload=4 * MB)
    body = os.urandom(1000)
    digest = DIGESTS["xxh3"](body)

    def refused(messages, reason: str) -> None:
        assert_refused(plane, caplog, raw_upload(plane, messages), "upload", reason)
        assert plane.session_uploads(0.0) == []

    refused([header(t, 5 * MB)], f"declares {5 * MB} bytes; expected 1..{4 * MB}")
    refused([header(t, 1000, body), pb.UploadChunk(data=b"more")], "sent more than the 1000 bytes it declared")
    refused([header(t, 2000, body), pb.UploadChunk(digest=digest)],
            "stream ended after 1000 of the 2000 declared bytes (truncated)")
    refused([header(t, 1000, bytes([body[0] ^ 1]) + body[1:]), pb.UploadChunk(digest=digest)], "xxh3 digest mismatch")
    refused([header(t, 1000, body)], "stream ended after all 1000 declared bytes without their xxh3 digest")

    def stalling():
        yield header(t, 1000, body[:10])
        time.sleep(3.0)  # the server's stall_timeout is 1 s
        yield pb.UploadChunk(data=body[10:])

    started = time.monotonic()
    refused(stalling(), "stream stalled for more than 1s after 10 of 1000 bytes")
    assert time.monotonic() - started < 3.0
    receipt = raw_upload(plane, [header(t, 1000, body), pb.UploadChunk(digest=digest)])
    assert receipt.digest == digest and receipt.next.session and receipt.next.round == 3
    (got,) = plane.session_uploads(1.0)
    assert (got.node_id, got.round, bytes(got.buffer())) == (NODE, 2, body)
    got.discard()
    assert len(plane.take_refusals()) == 6


class SlowEncoding:
    """A stand-in for `StreamingEncode` that writes `data` 256 KiB at a time, each piece only once a download
    asked for bytes of it (`wait_for`), or fails at `fail_at`: a server that waited for the whole encoding
    before streaming would never see it finish (the test fails on the timeout)."""

    def __init__(self, data: bytes, fail_at: int | None = None):
        self.buffer, self._done, self._error = memoryview(bytearray(len(data))), 0, None
        self.waits: list[int] = []
        """Every download's `wait_for(n)`."""
        self._cond = threading.Condition()

        def fill():
            for start in range(0, len(data), 256 << 10):
                with self._cond:
                    if not self._cond.wait_for(lambda: any(n > start for n in self.waits), timeout=20):
                        self._error = TimeoutError(f"no download asked for byte {start}")
                    elif fail_at is not None and start >= fail_at:
                        self._error = RuntimeError("disk on fire")
                    if self._error is not None:
                        self._cond.notify_all()
                        return
                end = min(start + (256 << 10), len(data))
                self.buffer[start:end] = data[start:end]
                with self._cond:
                    self._done = end
                    self._cond.notify_all()

        threading.Thread(target=fill, daemon=True).start()

    @property
    def written(self) -> int:
        return self._done

    def wait_for(self, n: int) -> None:
        with self._cond:
            self.waits.append(n)
            self._cond.notify_all()
            self._wait(min(n, len(self.buffer)))

    def _wait(self, n: int) -> None:
        self._cond.wait_for(lambda: self._error is not None or self._done >= n)
        if self._done < n:
            raise self._error

    def result(self) -> memoryview:
        with self._cond:
            self._wait(len(self.buffer))
        return self.buffer


def download_in_threads(tickets, nodes) -> tuple[dict, dict, list[threading.Thread]]:
    got, stats = {}, {n: {} for n in nodes}

    def fetch(n):
        try:
            got[n] = client.download(tickets[n], n, timeout=30, stats=stats[n])
        except client.DataPlaneError as err:
            got[n] = err

    threads = [threading.Thread(target=fetch, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    return got, stats, threads


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_an_announced_state_is_served_while_it_is_encoded(tmp_path, checksum):
    """`publish_encoding`: both nodes' waiting downloads start before the encoding is done (their first
    byte comes first), get exactly the encoded bytes and check them against the digest that follows
    the data; the server's uploads work as after `publish`. A real StreamingEncode of a GlobalState
    gives the bytes of `encode_global_state`."""
    import torch

    from lordo_fed.wire.encode import StreamingEncode, encode_global_state
    from lordo_fed.wire.messages import GlobalState

    with DataPlaneServer(tmp_path / "spool", chunk_bytes=256 << 10, stall_timeout=5.0, checksum=checksum) as plane:
        tickets = plane.announce(1, [NODE, OTHER], ttl=60, max_upload=4 * MB)
        got, _, threads = download_in_threads(tickets, [NODE, OTHER])
        data = os.urandom(3 * MB + 17)
        slow = SlowEncoding(data)
        assert plane.publish_encoding(1, slow) == DIGESTS[checksum](data)
        for t in threads:
            t.join(timeout=30)
        assert got[NODE] == data and got[OTHER] == data
        # the encoding advanced only as the streams asked for its next piece: each chunk went out once written
        assert len([n for n in slow.waits if n < len(data)]) >= 12, slow.waits
        client.upload(tickets[NODE], NODE, b"reply")
        assert bytes(plane.upload(NODE, 1).buffer()) == b"reply"

        tickets = plane.announce(2, [NODE], ttl=60, max_upload=4 * MB)
        got, _, threads = download_in_threads(tickets, [NODE])
        state = GlobalState(round=2, params={"w": torch.randn(300, 500), "b": torch.randn(7)})
        plane.publish_encoding(2, StreamingEncode(state, "m"))
        threads[0].join(timeout=30)
        assert got[NODE] == encode_global_state(state, "m")


def test_an_encoding_that_fails_ends_the_downloads_with_its_reason(plane, caplog):
    tickets = plane.announce(1, [NODE], ttl=60, max_upload=4 * MB)
    got, _, threads = download_in_threads(tickets, [NODE])
    with pytest.raises(RuntimeError, match="disk on fire"):
        plane.publish_encoding(1, SlowEncoding(os.urandom(3 * MB), fail_at=MB))
    threads[0].join(timeout=30)
    assert isinstance(got[NODE], client.DataPlaneError)
    assert "the server's encoding of round 1's state failed: RuntimeError: disk on fire" in str(got[NODE])


def fake_download_server(messages: list[bytes]):
    """A gRPC server whose Download streams `messages` as they are (a broken or hostile data plane)."""
    from concurrent.futures import ThreadPoolExecutor

    from lordo_fed.transport.server import DOWNLOAD_METHOD, SERVICE

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        DOWNLOAD_METHOD.rsplit("/", 1)[1]: grpc.unary_stream_rpc_method_handler(
            lambda request, context: iter(messages), response_serializer=lambda b: b)})
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.mark.parametrize("case,reason", [
    ("wrong", "xxh3 digest mismatch"),
    ("none", "8 bytes and no xxh3 digest after them (truncated)"),
    ("early", "a xxh3 digest after 4 of 8 bytes; expected one xxh3 digest, after the data, when the header declared none"),
    ("twice", "a xxh3 digest after 8 of 8 bytes; expected one xxh3 digest"),
    ("declared", "a xxh3 digest after 8 of 8 bytes; expected one xxh3 digest"),
    ("kind", "a sha256 digest after 8 of 8 bytes"),
])
def test_a_download_refuses_a_trailing_digest_out_of_place(case, reason):
    """What a node accepts after a header without digest: one digest of the ticket's kind, after exactly
    the declared bytes; anything else ends the download with a reason, and nothing is returned."""
    from lordo_fed.transport.framing import CHUNK_DATA, frame

    data = b"12345678"
    right = DIGESTS["xxh3"](data)
    header = pb.Chunk(size=8, digest=right if case == "declared" else "", checksum="xxh3").SerializeToString()
    part = [frame(pb.Chunk(), CHUNK_DATA, data[:4]), frame(pb.Chunk(), CHUNK_DATA, data[4:])]
    trailer = lambda d, kind="xxh3": pb.Chunk(digest=d, checksum=kind).SerializeToString()
    streams = {"wrong": [header, *part, trailer("0" * 32)], "none": [header, *part],
               "early": [header, part[0], trailer(right), part[1]], "twice": [header, *part, trailer(right), trailer(right)],
               "declared": [header, *part, trailer(right)], "kind": [header, *part, trailer("0" * 64, "sha256")]}
    server, port = fake_download_server(streams[case])
    try:
        ticket = pb.Ticket(address=f"127.0.0.1:{port}", round=1, checksum="xxh3", download_token="t")
        with pytest.raises(client.DataPlaneError, match=re.escape(reason)):
            client.download(ticket, NODE, timeout=10)
    finally:
        server.stop(0)
