"""The data plane's gRPC handlers, methods of `DataPlaneServer` (lordo_fed.transport.server serves
them; `DataPlaneHandlers` is its base class, in a file of its own for length): a download streams a
round's state (or a session's own start point) in chunks, an upload is checked as it streams (token,
declared size, the checksum) into a buffer or a spool file (`_Sink`) and stored only once whole and
verified (an `Upload`). Every refusal goes through `DataPlaneServer._refuse` (logged, kept for the
round's report as a `Refusal`) and ends the call with its status code (`Refused`)."""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from lordo_fed.transport.checksum import checksum_of, new_digest
from lordo_fed.transport.framing import CHUNK_DATA, frame
from lordo_fed.transport.tokens import DOWNLOAD, UPLOAD
from lordo_fed.v1 import dataplane_pb2 as pb
from lordo_fed.wire.protowire import new_buffer


@dataclass
class Upload:
    """A verified reply: exactly `size` bytes whose digest is `digest`, held in memory (`data`)
    or spilled to the spool file `path`. `buffer()` gives the bytes either way (an mmap of the
    file: the page cache, not the process, holds a spilled reply); `discard()` frees them."""

    node_id: int
    round: int
    size: int
    digest: str
    """Lowercase hex, of the data plane's checksum kind."""
    seconds: float
    """From the first to the last byte received."""
    data: memoryview | None = None
    """The bytes, when held in memory: the first `size` bytes of a buffer the data plane reuses
    for later uploads once this one is discarded (no view of it may outlive `discard()`)."""
    path: Path | None = None
    _base: memoryview | None = None
    _release: Callable[[memoryview], None] | None = None

    def buffer(self) -> memoryview:
        if self.data is not None:
            return memoryview(self.data)
        if self.path is None:
            raise RuntimeError(f"upload of node {self.node_id} (round {self.round}) was discarded")
        if self.size == 0:
            return memoryview(b"")
        with open(self.path, "rb") as f:
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))

    def discard(self) -> None:
        if self._base is not None and self._release is not None:
            self._release(self._base)
        self.data, self._base = None, None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


@dataclass(frozen=True)
class Refusal:
    node_id: int
    round: int
    what: str
    """'download' or 'upload'."""
    reason: str


class Refused(Exception):
    """A call the data plane refuses: the gRPC status it ends with, and the reason (logged)."""

    def __init__(self, code: grpc.StatusCode, reason: str):
        super().__init__(reason)
        self.code = code


class DataPlaneHandlers:
    """The gRPC handlers of `DataPlaneServer` and its pool of upload buffers: methods of the server,
    in a file of their own for length; the state they read (`_lock`, the rounds, the sessions) is the
    server's (`DataPlaneServer.__init__`)."""

    async def _serve_download(self, request: pb.DownloadRequest, context: grpc.aio.ServicerContext):
        try:
            claims = self._check(request.token, request.node_id, DOWNLOAD)
            with self._lock:
                in_session = int(request.node_id) in self._sessions or int(request.node_id) in self._session_ended
            if in_session:
                blob, digest = await self._session_state(request.node_id, claims)
                if blob is None:
                    await context.write(pb.Chunk(finished=True).SerializeToString())
                    return
                await self._stream(context, request.node_id, claims.round, blob, digest)
                return
            served = self.served(claims.round, request.node_id)  # the node's own state, or the round's
            if served is None and claims.round > (self._round if self._round is not None else -1):
                # An announced round: wait for its state, at most until the token expires.
                try:
                    await asyncio.wait_for(self._published(claims.round).wait(), max(0.0, claims.expires - time.time()))
                except asyncio.TimeoutError:
                    raise self._refuse(request.node_id, claims.round, DOWNLOAD, f"round {claims.round} was not "
                                       "published before the token expired", grpc.StatusCode.DEADLINE_EXCEEDED) from None
                served = self.served(claims.round, request.node_id)
            if served is None:  # published over between the check and now
                raise self._refuse(request.node_id, claims.round, DOWNLOAD, f"round {claims.round} is no longer served")
            await self._stream(context, request.node_id, claims.round, *served)
        except Refused as err:
            await context.abort(err.code, str(err))

    async def _stream(self, context, node: int, round_idx: int, blob: memoryview, digest: str | None,
                      filling: tuple | None = None) -> None:
        """A download's chunks: the header (size, digest) alone first, so the node knows the
        round is published at once whatever the chunk size (it times its wait by it), then the
        data; a stall past the deadline is refused (raises Refused). A state still being encoded
        (`filling`: `DataPlaneServer.publish_encoding`) goes out chunk by chunk as it is written,
        its header without the digest, which follows the data in a last chunk."""
        step = self.chunk_bytes
        loop = asyncio.get_running_loop()
        encoding, pending = filling if filling is not None and digest is None else (None, None)
        header = pb.Chunk(size=len(blob), digest=digest or "", checksum=self.checksum).SerializeToString()
        for offset in range(-step, len(blob), step):
            if encoding is not None and offset >= 0 and encoding.written < min(offset + step, len(blob)):
                await self._encoded(loop.run_in_executor(None, encoding.wait_for, offset + step), node, round_idx,
                                    f"byte {offset} of {len(blob)}")
            chunk = header if offset < 0 else frame(pb.Chunk(), CHUNK_DATA, blob[offset:offset + step])
            try:
                await asyncio.wait_for(context.write(chunk), self.stall_timeout)
            except asyncio.TimeoutError:
                raise self._refuse(node, round_idx, DOWNLOAD,
                                   f"stream stalled for more than {self.stall_timeout:g}s at byte {max(offset, 0)} of "
                                   f"{len(blob)}", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        if pending is not None:
            digest = await self._encoded(asyncio.wrap_future(pending), node, round_idx, "the digest")
            try:
                await asyncio.wait_for(context.write(pb.Chunk(digest=digest, checksum=self.checksum).SerializeToString()),
                                       self.stall_timeout)
            except asyncio.TimeoutError:
                raise self._refuse(node, round_idx, DOWNLOAD, f"stream stalled for more than {self.stall_timeout:g}s "
                                   "at the digest", grpc.StatusCode.DEADLINE_EXCEEDED) from None

    async def _encoded(self, waiting, node: int, round_idx: int, what: str):
        """The result of `waiting` (the server's encoding reaching `what`), within the stall deadline;
        an encoding that failed or stalled ends the download with the reason (raises Refused)."""
        try:
            return await asyncio.wait_for(waiting, self.stall_timeout)
        except asyncio.TimeoutError:
            raise self._refuse(node, round_idx, DOWNLOAD, f"the server's encoding of round {round_idx}'s state stalled "
                               f"for more than {self.stall_timeout:g}s before {what}",
                               grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except Exception as err:  # noqa: BLE001 (the server's own encoding failed: not the node's fault)
            raise self._refuse(node, round_idx, DOWNLOAD, f"the server's encoding of round {round_idx}'s state failed: "
                               f"{type(err).__name__}: {err}", grpc.StatusCode.INTERNAL) from None

    async def _session_state(self, node_id: int, claims) -> tuple[memoryview | None, str]:
        """The start point of a session's round `claims.round` once published (None: the session
        ended), waiting at most until the token expires (raises Refused)."""
        node = int(node_id)
        while True:
            with self._lock:
                ended = node in self._session_ended
                state = self._session_states.get(node)
            if ended:
                return None, ""
            if state is not None and state[0] == claims.round:
                return state[1], state[2]
            if state is not None and state[0] > claims.round:
                raise self._refuse(node, claims.round, DOWNLOAD, f"round {claims.round} is no longer served (the "
                                   f"node's start point is of round {state[0]})")
            # No await between the check above and this wait: `_wake` (also on this loop) cannot slip between.
            try:
                await asyncio.wait_for(self._session_event(node).wait(), max(0.0, claims.expires - time.time()))
            except asyncio.TimeoutError:
                raise self._refuse(node, claims.round, DOWNLOAD, f"round {claims.round} was not published before the "
                                   "token expired", grpc.StatusCode.DEADLINE_EXCEEDED) from None

    async def _serve_upload(self, request_iterator, context: grpc.aio.ServicerContext):
        node, round_idx, slot = -1, -1, False
        try:
            first, first_data = await self._read(context, node, round_idx, 0, None)
            if first is None:
                raise self._refuse(node, round_idx, UPLOAD, "empty upload stream", grpc.StatusCode.INVALID_ARGUMENT)
            node = first.node_id
            claims = self._check(first.token, node, UPLOAD)
            round_idx = claims.round
            with self._lock:
                limit = self._max_upload
            if first.size <= 0 or first.size > limit:
                raise self._refuse(node, round_idx, UPLOAD, f"declares {first.size} bytes; expected 1..{limit} "
                                   "(the round's largest reply)", grpc.StatusCode.INVALID_ARGUMENT)
            if checksum_of(first) != self.checksum:
                raise self._refuse(node, round_idx, UPLOAD, f"declares checksum {checksum_of(first)!r}; "
                                   f"expected the ticket's {self.checksum!r}", grpc.StatusCode.INVALID_ARGUMENT)
            # A turn among the uploads read at once (`max_uploads`), waited for at most until the
            # token expires; only a checked header waits.
            try:
                await asyncio.wait_for(self._upload_slots.acquire(), max(0.0, claims.expires - time.time()))
            except asyncio.TimeoutError:
                raise self._refuse(node, round_idx, UPLOAD, "waited for a turn among the uploads read at once "
                                   f"(data-plane-max-uploads={self.max_uploads}) until the token expired",
                                   grpc.StatusCode.DEADLINE_EXCEEDED) from None
            slot = True
            with self._lock:
                self.active_uploads += 1
                self.peak_active_uploads = max(self.peak_active_uploads, self.active_uploads)
            with self._lock:
                session = node in self._sessions
            return await self._receive(context, first, first_data, claims, session)
        except Refused as err:
            await context.abort(err.code, str(err))
        except asyncio.CancelledError:
            self._refuse(node, round_idx, UPLOAD, "connection lost mid-upload (the node stopped or cancelled)",
                         grpc.StatusCode.CANCELLED)
            raise
        finally:
            if slot:
                with self._lock:
                    self.active_uploads -= 1
                self._upload_slots.release()

    async def _receive(self, context, first: pb.UploadChunk, first_data, claims, session: bool) -> pb.UploadReceipt:
        """The rest of an upload whose header (token, size) checked out: its bytes, stored as they
        come, and their digest (raises Refused); a `session`'s receipt carries its next ticket."""
        node, round_idx, declared, sink = first.node_id, claims.round, first.size, None
        try:
            sink = _Sink(self, node, round_idx, declared)
            loop = asyncio.get_running_loop()
            received, declared_digest, started = 0, "", time.perf_counter()
            pending = None  # hashing and storing chunk i (in a thread) overlaps receiving chunk i+1
            msg, data = first, first_data
            while msg is not None:
                if data:
                    if received + len(data) > declared:
                        raise self._refuse(node, round_idx, UPLOAD, f"sent more than the {declared} bytes it "
                                           "declared", grpc.StatusCode.INVALID_ARGUMENT)
                    if pending is not None:
                        await pending
                    pending = loop.run_in_executor(self._io, sink.write, received, data)
                    received += len(data)
                declared_digest = msg.digest or declared_digest
                msg, data = await self._read(context, node, round_idx, received, declared)
            if pending is not None:
                await pending
            if received != declared:
                raise self._refuse(node, round_idx, UPLOAD, f"stream ended after {received} of the {declared} "
                                   "declared bytes (truncated)", grpc.StatusCode.INVALID_ARGUMENT)
            if not declared_digest:  # e.g. a node killed between its last data chunk and its digest
                raise self._refuse(node, round_idx, UPLOAD, f"stream ended after all {declared} declared bytes "
                                   f"without their {self.checksum} digest", grpc.StatusCode.DATA_LOSS)
            digest = sink.digest.hexdigest()
            if digest != declared_digest:
                raise self._refuse(node, round_idx, UPLOAD, f"{self.checksum} digest mismatch: received bytes hash to "
                                   f"{digest[:16]}..., the node declared {declared_digest[:16]}...",
                                   grpc.StatusCode.DATA_LOSS)
            if not self.issuer.spend(claims):
                raise self._refuse(node, round_idx, UPLOAD, "upload token already used (replayed)")
            upload = sink.finish(digest, time.perf_counter() - started)
            sink = None
            if session:
                return self._take_session_upload(upload, claims)
            with self._lock:
                current = self._round == round_idx
                if current:
                    self._uploads[(node, round_idx)] = upload
                    self._arrived.notify_all()
            if not current:
                upload.discard()  # the round closed while this one streamed
            return pb.UploadReceipt(size=received, digest=digest)
        finally:
            if sink is not None:
                sink.abandon()

    async def _read(self, context, node: int, round_idx: int, received: int, declared: int | None):
        """The next upload message and its data (lordo_fed.transport.framing), (None, None) at the
        end of the stream; a stall past the deadline is refused."""
        try:
            msg = await asyncio.wait_for(context.read(), self.stall_timeout)
        except asyncio.TimeoutError:
            raise self._refuse(node, round_idx, UPLOAD, f"stream stalled for more than {self.stall_timeout:g}s "
                               f"after {received} of {declared if declared is not None else '?'} bytes",
                               grpc.StatusCode.DEADLINE_EXCEEDED) from None
        return (None, None) if msg is grpc.aio.EOF else msg

    def _take_buffer(self, nbytes: int) -> memoryview | None:
        """A buffer of at least `nbytes` for an upload (a spare one when one fits), counted against
        the memory budget with the spares; None when the budget cannot hold it (the upload spills).
        A new one is `new_buffer`'s: not zero-filled (a `bytearray`'s memset of 200 MB ran on the
        event loop, every stream waiting). Spares are told apart by identity, never by `==`, which
        would compare their contents."""
        with self._lock:
            fits = [b for b in self._spare if len(b) >= nbytes]
            if fits:
                buf = min(fits, key=len)
                self._drop_spare(buf)
                self._memory_used += len(buf)
                return buf
            while self._spare and self._memory_used + sum(map(len, self._spare)) + nbytes > self.memory_budget:
                self._drop_spare(min(self._spare, key=len))  # make room: smallest spares first
            if self._memory_used + sum(map(len, self._spare)) + nbytes > self.memory_budget:
                return None
            self._memory_used += nbytes
        return new_buffer(nbytes)

    def _drop_spare(self, buf: memoryview) -> None:
        self._spare = [b for b in self._spare if b is not buf]

    def _release(self, buf: memoryview) -> None:
        """An upload's buffer is free: kept as a spare while the budget holds it."""
        with self._lock:
            self._memory_used -= len(buf)
            if self._memory_used + sum(map(len, self._spare)) + len(buf) <= self.memory_budget:
                self._spare.append(buf)


class _Sink:
    """Where one upload's bytes go while they stream: a buffer when the memory budget allows (a
    spare one of an earlier upload when one fits), else a spool file (renamed into place only
    once verified); hashed on the way in."""

    def __init__(self, plane: DataPlaneHandlers, node: int, round_idx: int, size: int):
        self.plane, self.node, self.round, self.size = plane, node, round_idx, size
        self.digest = new_digest(plane.checksum)
        self.base = plane._take_buffer(size)
        self.data = memoryview(self.base)[:size] if self.base is not None else None
        self.part = None
        self.file = None
        if self.data is None:
            self.part = plane.spool_dir / f"round{round_idx}-node{node}-{os.getpid()}-{id(self)}.part"
            self.file = open(self.part, "wb")

    def write(self, offset: int, chunk: memoryview) -> None:
        self.digest.update(chunk)
        if self.data is not None:
            # a memoryview slice assignment is a memcpy (a bytearray's ran ~9x slower here)
            self.data[offset:offset + len(chunk)] = chunk
        else:
            self.file.write(chunk)

    def finish(self, digest: str, seconds: float) -> Upload:
        upload = Upload(self.node, self.round, self.size, digest, seconds, data=self.data,
                        _base=self.base, _release=self.plane._release)
        if self.file is not None:
            self.file.close()
            final = self.plane.spool_dir / f"round{self.round}-node{self.node}.bin"
            os.replace(self.part, final)
            upload.path = final
        return upload

    def abandon(self) -> None:
        if self.base is not None:
            self.data = None
            self.plane._release(self.base)
            self.base = None
        if self.file is not None:
            self.file.close()
            self.part.unlink(missing_ok=True)
