"""The data plane's gRPC handlers (lordo_fed.transport.server serves them): a download streams a
round's state (or a session's own start point) in chunks, an upload is checked as it streams
(token, declared size, the checksum) into a buffer or a spool file (`_Sink`) and stored only once
whole and verified. Every refusal goes through `DataPlaneServer._refuse` (logged, kept for the
round's report) and ends the call with its status code."""

from __future__ import annotations

import asyncio
import os
import time

import grpc

from lordo_fed.transport.checksum import checksum_of, new_digest
from lordo_fed.transport.framing import frame
from lordo_fed.transport.server import CHUNK_DATA, DataPlaneServer, Upload, Refused
from lordo_fed.transport.tokens import DOWNLOAD, UPLOAD
from lordo_fed.v1 import dataplane_pb2 as pb


class Servicer:
    def __init__(self, plane: DataPlaneServer):
        self.plane = plane

    async def Download(self, request: pb.DownloadRequest, context: grpc.aio.ServicerContext):
        plane = self.plane
        try:
            claims = plane._check(request.token, request.node_id, DOWNLOAD)
            with plane._lock:
                in_session = int(request.node_id) in plane._sessions or int(request.node_id) in plane._session_ended
            if in_session:
                blob, digest = await self._session_state(request.node_id, claims)
                if blob is None:
                    await context.write(pb.Chunk(finished=True).SerializeToString())
                    return
                await self._stream(context, request.node_id, claims.round, blob, digest)
                return
            served = plane.served(claims.round, request.node_id)  # the node's own state, or the round's
            if served is None and claims.round > (plane._round if plane._round is not None else -1):
                # An announced round: wait for its state, at most until the token expires.
                try:
                    await asyncio.wait_for(plane._published(claims.round).wait(), max(0.0, claims.expires - time.time()))
                except asyncio.TimeoutError:
                    raise plane._refuse(request.node_id, claims.round, DOWNLOAD, f"round {claims.round} was not "
                                        "published before the token expired", grpc.StatusCode.DEADLINE_EXCEEDED) from None
                served = plane.served(claims.round, request.node_id)
            if served is None:  # published over between the check and now
                raise plane._refuse(request.node_id, claims.round, DOWNLOAD, f"round {claims.round} is no longer served")
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
        plane = self.plane
        step = plane.chunk_bytes
        loop = asyncio.get_running_loop()
        encoding, pending = filling if filling is not None and digest is None else (None, None)
        header = pb.Chunk(size=len(blob), digest=digest or "", checksum=plane.checksum).SerializeToString()
        for offset in range(-step, len(blob), step):
            if encoding is not None and offset >= 0 and encoding.written < min(offset + step, len(blob)):
                await self._encoded(loop.run_in_executor(None, encoding.wait_for, offset + step), node, round_idx,
                                    f"byte {offset} of {len(blob)}")
            chunk = header if offset < 0 else frame(pb.Chunk(), CHUNK_DATA, blob[offset:offset + step])
            try:
                await asyncio.wait_for(context.write(chunk), plane.stall_timeout)
            except asyncio.TimeoutError:
                raise plane._refuse(node, round_idx, DOWNLOAD,
                                    f"stream stalled for more than {plane.stall_timeout:g}s at byte {max(offset, 0)} of "
                                    f"{len(blob)}", grpc.StatusCode.DEADLINE_EXCEEDED) from None
        if pending is not None:
            digest = await self._encoded(asyncio.wrap_future(pending), node, round_idx, "the digest")
            try:
                await asyncio.wait_for(context.write(pb.Chunk(digest=digest, checksum=plane.checksum).SerializeToString()),
                                       plane.stall_timeout)
            except asyncio.TimeoutError:
                raise plane._refuse(node, round_idx, DOWNLOAD, f"stream stalled for more than {plane.stall_timeout:g}s "
                                    "at the digest", grpc.StatusCode.DEADLINE_EXCEEDED) from None

    async def _encoded(self, waiting, node: int, round_idx: int, what: str):
        """The result of `waiting` (the server's encoding reaching `what`), within the stall deadline;
        an encoding that failed or stalled ends the download with the reason (raises Refused)."""
        plane = self.plane
        try:
            return await asyncio.wait_for(waiting, plane.stall_timeout)
        except asyncio.TimeoutError:
            raise plane._refuse(node, round_idx, DOWNLOAD, f"the server's encoding of round {round_idx}'s state stalled "
                                f"for more than {plane.stall_timeout:g}s before {what}",
                                grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except Exception as err:  # noqa: BLE001 (the server's own encoding failed: not the node's fault)
            raise plane._refuse(node, round_idx, DOWNLOAD, f"the server's encoding of round {round_idx}'s state failed: "
                                f"{type(err).__name__}: {err}", grpc.StatusCode.INTERNAL) from None

    async def _session_state(self, node_id: int, claims) -> tuple[memoryview | None, str]:
        """The start point of a session's round `claims.round` once published (None: the session
        ended), waiting at most until the token expires (raises Refused)."""
        plane, node = self.plane, int(node_id)
        while True:
            with plane._lock:
                ended = node in plane._session_ended
                state = plane._session_states.get(node)
            if ended:
                return None, ""
            if state is not None and state[0] == claims.round:
                return state[1], state[2]
            if state is not None and state[0] > claims.round:
                raise plane._refuse(node, claims.round, DOWNLOAD, f"round {claims.round} is no longer served (the "
                                    f"node's start point is of round {state[0]})")
            # No await between the check above and this wait: `_wake` (also on this loop) cannot slip between.
            try:
                await asyncio.wait_for(plane._session_event(node).wait(), max(0.0, claims.expires - time.time()))
            except asyncio.TimeoutError:
                raise plane._refuse(node, claims.round, DOWNLOAD, f"round {claims.round} was not published before the "
                                    "token expired", grpc.StatusCode.DEADLINE_EXCEEDED) from None

    async def Upload(self, request_iterator, context: grpc.aio.ServicerContext):
        plane = self.plane
        node, round_idx, slot = -1, -1, False
        try:
            first, first_data = await self._read(context, node, round_idx, 0, None)
            if first is None:
                raise plane._refuse(node, round_idx, UPLOAD, "empty upload stream", grpc.StatusCode.INVALID_ARGUMENT)
            node = first.node_id
            claims = plane._check(first.token, node, UPLOAD)
            round_idx = claims.round
            with plane._lock:
                limit = plane._max_upload
            if first.size <= 0 or first.size > limit:
                raise plane._refuse(node, round_idx, UPLOAD, f"declares {first.size} bytes; expected 1..{limit} "
                                    "(the round's largest reply)", grpc.StatusCode.INVALID_ARGUMENT)
            if checksum_of(first) != plane.checksum:
                raise plane._refuse(node, round_idx, UPLOAD, f"declares checksum {checksum_of(first)!r}; "
                                    f"expected the ticket's {plane.checksum!r}", grpc.StatusCode.INVALID_ARGUMENT)
            # A turn among the uploads read at once (`max_uploads`), waited for at most until the
            # token expires; only a checked header waits.
            try:
                await asyncio.wait_for(plane._upload_slots.acquire(), max(0.0, claims.expires - time.time()))
            except asyncio.TimeoutError:
                raise plane._refuse(node, round_idx, UPLOAD, "waited for a turn among the uploads read at once "
                                    f"(data-plane-max-uploads={plane.max_uploads}) until the token expired",
                                    grpc.StatusCode.DEADLINE_EXCEEDED) from None
            slot = True
            with plane._lock:
                plane.active_uploads += 1
                plane.peak_active_uploads = max(plane.peak_active_uploads, plane.active_uploads)
            with plane._lock:
                session = node in plane._sessions
            return await self._receive(context, first, first_data, claims, session)
        except Refused as err:
            await context.abort(err.code, str(err))
        except asyncio.CancelledError:
            plane._refuse(node, round_idx, UPLOAD, "connection lost mid-upload (the node stopped or cancelled)",
                          grpc.StatusCode.CANCELLED)
            raise
        finally:
            if slot:
                with plane._lock:
                    plane.active_uploads -= 1
                plane._upload_slots.release()

    async def _receive(self, context, first: pb.UploadChunk, first_data, claims, session: bool) -> pb.UploadReceipt:
        """The rest of an upload whose header (token, size) checked out: its bytes, stored as they
        come, and their digest (raises Refused); a `session`'s receipt carries its next ticket."""
        plane = self.plane
        node, round_idx, declared, sink = first.node_id, claims.round, first.size, None
        try:
            sink = _Sink(plane, node, round_idx, declared)
            loop = asyncio.get_running_loop()
            received, declared_digest, started = 0, "", time.perf_counter()
            pending = None  # hashing and storing chunk i (in a thread) overlaps receiving chunk i+1
            msg, data = first, first_data
            while msg is not None:
                if data:
                    if received + len(data) > declared:
                        raise plane._refuse(node, round_idx, UPLOAD, f"sent more than the {declared} bytes it "
                                            "declared", grpc.StatusCode.INVALID_ARGUMENT)
                    if pending is not None:
                        await pending
                    pending = loop.run_in_executor(plane._io, sink.write, received, data)
                    received += len(data)
                declared_digest = msg.digest or declared_digest
                msg, data = await self._read(context, node, round_idx, received, declared)
            if pending is not None:
                await pending
            if received != declared:
                raise plane._refuse(node, round_idx, UPLOAD, f"stream ended after {received} of the {declared} "
                                    "declared bytes (truncated)", grpc.StatusCode.INVALID_ARGUMENT)
            digest = sink.digest.hexdigest()
            if digest != declared_digest:
                raise plane._refuse(node, round_idx, UPLOAD, f"{plane.checksum} digest mismatch: received bytes hash to "
                                    f"{digest[:16]}..., the node declared {declared_digest[:16] or 'none'}...",
                                    grpc.StatusCode.DATA_LOSS)
            if not plane.issuer.spend(claims):
                raise plane._refuse(node, round_idx, UPLOAD, "upload token already used (replayed)")
            upload = sink.finish(digest, time.perf_counter() - started)
            sink = None
            if session:
                return plane._take_session_upload(upload, claims)
            with plane._lock:
                current = plane._round == round_idx
                if current:
                    plane._uploads[(node, round_idx)] = upload
                    plane._arrived.notify_all()
            if not current:
                upload.discard()  # the round closed while this one streamed
            return pb.UploadReceipt(size=received, digest=digest)
        finally:
            if sink is not None:
                sink.abandon()

    async def _read(self, context, node: int, round_idx: int, received: int, declared: int | None):
        """The next upload message and its data (lordo_fed.transport.framing), (None, None) at the
        end of the stream; a stall past the deadline is refused."""
        plane = self.plane
        try:
            msg = await asyncio.wait_for(context.read(), plane.stall_timeout)
        except asyncio.TimeoutError:
            raise plane._refuse(node, round_idx, UPLOAD, f"stream stalled for more than {plane.stall_timeout:g}s "
                                f"after {received} of {declared if declared is not None else '?'} bytes",
                                grpc.StatusCode.DEADLINE_EXCEEDED) from None
        return (None, None) if msg is grpc.aio.EOF else msg


class _Sink:
    """Where one upload's bytes go while they stream: a buffer when the memory budget allows (a
    spare one of an earlier upload when one fits), else a spool file (renamed into place only
    once verified); hashed on the way in."""

    def __init__(self, plane: DataPlaneServer, node: int, round_idx: int, size: int):
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
