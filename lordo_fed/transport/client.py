"""The data plane's client: a node fetches the round's state and sends its reply, given the
`Ticket` its Flower message carried (lordo_fed.transport.server serves the other side).

Both directions verify what the ticket promises: the download must be exactly `ticket.size`
bytes whose digest is `ticket.digest` (else `DataPlaneError`, and nothing is decoded); the upload
declares its size up front and its digest at the end, and the server's receipt must repeat them.
The digest's kind is the ticket's `checksum` (lordo_fed.transport.checksum: xxh3 by default).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import grpc

from lordo_fed.transport.checksum import CHECKSUMS, checksum_of, is_digest, new_digest
from lordo_fed.wire.protowire import new_buffer
from lordo_fed.transport.framing import CHUNK_DATA, UPLOAD_DATA, frame, unframe
from lordo_fed.transport.server import CHUNK_BYTES, DOWNLOAD_METHOD, UPLOAD_METHOD, raw_bytes, channel_options
from lordo_fed.v1 import dataplane_pb2 as pb


class DataPlaneError(RuntimeError):
    """A transfer that failed or did not match its ticket; the message names the step."""


class SessionEnded(Exception):
    """A session's download found no further round for this node (dataplane.proto, `finished`)."""


def parse_ticket(data: bytes) -> pb.Ticket:
    """A ticket from the bytes a Flower message carried (DataPlaneError if it is not one)."""
    ticket = pb.Ticket()
    try:
        ticket.ParseFromString(bytes(data))
    except Exception as err:  # noqa: BLE001 (protobuf's DecodeError and friends)
        raise DataPlaneError(f"data-plane ticket of {len(data)} bytes does not parse: {err}") from err
    kind = checksum_of(ticket)
    if kind not in CHECKSUMS:
        raise DataPlaneError(f"data-plane ticket names checksum {kind!r}; this node knows {CHECKSUMS}")
    announced = ticket.size == 0 and not ticket.digest  # the state is published later
    if not ticket.address or ticket.size < 0 or (not is_digest(kind, ticket.digest) and not announced):
        raise DataPlaneError(f"data-plane ticket incomplete (address {ticket.address!r}, size {ticket.size}, "
                             f"{kind} digest {ticket.digest!r})")
    return ticket


def transfer_timeout(ticket: pb.Ticket, round_timeout: float) -> float:
    """How long a node waits for a download: the round's deadline, and for a round announced
    ahead of its state also the rest of the round before it (plus a minute of slack)."""
    return round_timeout if ticket.size else 2 * round_timeout + 60


def open_channel(ticket: pb.Ticket, root_certificates: bytes | str | Path | None = None) -> grpc.Channel:
    """A channel to the ticket's data plane: TLS verified with `root_certificates` (PEM bytes or a
    file) when the server serves TLS, plaintext when it does not."""
    if ticket.tls:
        if root_certificates is None:
            raise DataPlaneError(f"the data plane at {ticket.address} serves TLS but this node has no CA "
                                 "certificate (node config 'root-certificates', or --root-certificates of "
                                 "scripts/start_supernodes.sh)")
        if isinstance(root_certificates, (str, Path)):
            try:
                root_certificates = Path(root_certificates).read_bytes()
            except OSError as err:
                raise DataPlaneError(f"CA certificate {root_certificates}: {err}") from err
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(ticket.address, creds, options=channel_options())
    return grpc.insecure_channel(ticket.address, options=channel_options())


def download(ticket: pb.Ticket, node_id: int, root_certificates=None, timeout: float | None = None,
             stats: dict[str, float] | None = None) -> memoryview:
    """The round's encoded GlobalState, checked against the size and digest that the ticket
    names or, for a round announced before its state existed, that the stream declares: the size
    in its first chunk, the digest there too or, for a state served while it is encoded, in a last
    chunk after the data (the call waits for the server to publish the round). Returns a writable buffer
    of this node's own (the decoder may adopt it, lordo_fed.wire.protowire.new_buffer). `stats`, when given,
    gets `first_byte`: the time.perf_counter() of the first chunk (before it, the node waited).
    Raises SessionEnded when a session's server has no further round for this node."""
    out, view = None, None
    size, expected, kind = ticket.size, ticket.digest, checksum_of(ticket)
    digest, offset = new_digest(kind), 0
    with open_channel(ticket, root_certificates) as channel:
        call = channel.unary_stream(DOWNLOAD_METHOD, request_serializer=pb.DownloadRequest.SerializeToString,
                                    response_deserializer=raw_bytes)
        stream = call(pb.DownloadRequest(token=ticket.download_token, node_id=int(node_id)), timeout=timeout)
        try:
            for raw in stream:
                chunk, data = unframe(raw, pb.Chunk, CHUNK_DATA)
                if out is None:
                    if stats is not None:
                        stats["first_byte"] = time.perf_counter()
                    if chunk.finished:
                        stream.cancel()
                        if not ticket.session:
                            raise DataPlaneError(f"download from {ticket.address}: the server ended a session, "
                                                 "and this ticket is not one")
                        raise SessionEnded(f"the data plane at {ticket.address} has no round {ticket.round} for "
                                           f"node {node_id}")
                    if chunk.digest and checksum_of(chunk) != kind:
                        stream.cancel()
                        raise DataPlaneError(f"download from {ticket.address}: the stream's checksum is "
                                             f"{checksum_of(chunk)!r}, the ticket's {kind!r}")
                    if expected and chunk.digest and (chunk.digest != expected or chunk.size != size):
                        stream.cancel()
                        raise DataPlaneError(f"download from {ticket.address}: the server declares {chunk.size} bytes "
                                             f"({chunk.digest[:16]}...), the ticket {size} ({expected[:16]}...)")
                    if not expected:
                        size, expected = chunk.size, chunk.digest
                        if size <= 0 or (expected and not is_digest(kind, expected)):
                            stream.cancel()
                            raise DataPlaneError(f"download from {ticket.address}: the stream declares no size/{kind} "
                                                 "digest for an announced round")
                    out = view = new_buffer(size)  # written once, by the chunks: no memset first
                elif chunk.digest:  # a state served while it was encoded: its digest follows the data
                    if expected or offset != size or data or checksum_of(chunk) != kind or not is_digest(kind, chunk.digest):
                        stream.cancel()
                        raise DataPlaneError(f"download from {ticket.address}: a {checksum_of(chunk)} digest after "
                                             f"{offset} of {size} bytes; expected one {kind} digest, after the data, "
                                             "when the header declared none")
                    expected = chunk.digest
                    continue
                n = len(data)
                if offset + n > size:
                    stream.cancel()
                    raise DataPlaneError(f"download from {ticket.address}: more than the declared {size} bytes")
                view[offset:offset + n] = data
                digest.update(data)
                offset += n
        except grpc.RpcError as err:
            raise DataPlaneError(f"download from {ticket.address} failed after {offset} of {size or '?'} bytes: "
                                 f"{err.code().name}: {err.details()}") from err
    if out is None or offset != size:
        raise DataPlaneError(f"download from {ticket.address}: {offset} of {size} bytes (truncated)")
    if not expected:
        raise DataPlaneError(f"download from {ticket.address}: {size} bytes and no {kind} digest after them (truncated)")
    if digest.hexdigest() != expected:
        raise DataPlaneError(f"download from {ticket.address}: {kind} digest mismatch (got {digest.hexdigest()[:16]}..., "
                             f"expected {expected[:16]}...)")
    return out


def _chunks(ticket: pb.Ticket, node_id: int, data: memoryview, step: int, digest,
            ready: Callable[[int], None] | None) -> Iterator[bytes]:
    """The header alone first (token, node, size: the server checks it, and may queue the upload
    behind others, before any data is sent), then the data, hashed as it goes, then the digest
    (protocol: dataplane.proto; serialized by lordo_fed.transport.framing)."""
    yield pb.UploadChunk(token=ticket.upload_token, node_id=int(node_id), size=len(data),
                         checksum=checksum_of(ticket)).SerializeToString()
    for offset in range(0, len(data), step):
        if ready is not None:
            ready(min(offset + step, len(data)))  # the bytes are still being written (StreamingEncode)
        piece = data[offset:offset + step]
        digest.update(piece)
        yield frame(pb.UploadChunk(), UPLOAD_DATA, piece)
    yield pb.UploadChunk(digest=digest.hexdigest()).SerializeToString()


def upload(ticket: pb.Ticket, node_id: int, data: bytes | bytearray | memoryview, root_certificates=None,
           timeout: float | None = None, chunk_bytes: int = CHUNK_BYTES,
           ready: Callable[[int], None] | None = None) -> pb.UploadReceipt:
    """Send this node's encoded WorkerUpdate; returns the server's receipt once it confirmed it:
    the digest (of the ticket's checksum kind) and, in a session, the next round's ticket.
    `ready(n)`, when given, blocks until the first `n` bytes of `data` are final: the upload then
    streams a payload that is still being encoded (lordo_fed.wire.encode.StreamingEncode)."""
    view = memoryview(data).cast("B")
    digest = new_digest(checksum_of(ticket))
    with open_channel(ticket, root_certificates) as channel:
        try:
            call = channel.stream_unary(UPLOAD_METHOD, request_serializer=raw_bytes,
                                        response_deserializer=pb.UploadReceipt.FromString)
            receipt = call(_chunks(ticket, node_id, view, chunk_bytes, digest, ready), timeout=timeout)
        except grpc.RpcError as err:
            raise DataPlaneError(f"upload of {len(view)} bytes to {ticket.address} refused or failed: "
                                 f"{err.code().name}: {err.details()}") from err
    sent = digest.hexdigest()
    if receipt.digest != sent or receipt.size != len(view):
        raise DataPlaneError(f"upload to {ticket.address}: the receipt ({receipt.size} bytes, {receipt.digest[:16]}...) "
                             f"does not match what was sent ({len(view)} bytes, {sent[:16]}...)")
    if ticket.session and not (receipt.HasField("next") and receipt.next.session):
        raise DataPlaneError(f"upload to {ticket.address}: a session's receipt without the next round's ticket")
    return receipt
