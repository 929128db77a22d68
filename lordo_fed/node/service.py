"""The node worker: a long-lived process per node that runs the node's rounds.

Flower starts a new ClientApp process for every message, which would import torch, rebuild the
model and reload the worker state (~760 MB for 125M) every round. The node worker keeps the
model, the optimizer state and the data cursor on its device between rounds; the ClientApp
hands it each job over a local channel (lordo_fed/node/channel.py) and returns the small
result. With the gRPC data plane the worker downloads the state and uploads its reply itself.
After each round it persists the worker state to disk on a thread, off the critical path (the
next round waits for it), so a restarted worker resumes from disk without losing a round.

    python -m lordo_fed.node --listen unix:///run/lordo/node-0.sock
    torchrun --standalone --nproc-per-node 8 -m lordo_fed.node --listen unix:///run/lordo/node-0.sock

Under torchrun the node is N ranks (lordo_fed/node/ranks.py): the lead (rank 0) serves the
ClientApp and talks to the data plane; it hands each job and the state it downloaded to the other
ranks (`follow`), all ranks train the round together, and the lead alone uploads and saves.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from lordo_fed.node.channel import OPTIONS, check_local
from lordo_fed.node import runtime
from lordo_fed.node.ranks import LocalRanks
from lordo_fed.node.runtime import Job, ReadOnlyStore, disk_store, run_job, runtime_for
from lordo_fed.wire.encode import StreamingEncode
from lordo_fed.transport.client import DataPlaneError, download, parse_ticket, transfer_timeout, upload
from lordo_fed.v1 import node_pb2 as pb
from lordo_fed.v1 import node_pb2_grpc as pb_grpc

log = logging.getLogger("lordo_fed.node")


class NodeWorkerServicer(pb_grpc.NodeWorkerServicer):
    """Runs the jobs of one node, one at a time (they share the node's device and state)."""

    def __init__(self, ranks: LocalRanks | None = None):
        self.ranks = ranks
        """A node of several ranks: this is its lead, which hands every job on to the others."""
        self._lock = threading.Lock()
        self.jobs = 0

    def Run(self, request: pb.NodeJob, context: grpc.ServicerContext) -> pb.NodeResult:
        with self._lock:
            try:
                return self._run(request)
            except Exception as err:  # noqa: BLE001 (reported to the ClientApp, which fails the message)
                log.exception("job %s of run %d failed", request.kind, request.run_id)
                context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    def _run(self, request: pb.NodeJob) -> pb.NodeResult:
        started = time.perf_counter()
        job = Job(request.kind, request.run_id, json.loads(request.run_config_json), tuple(request.explicit_keys),
                  json.loads(request.node_config_json))
        ca = job.node.root_certificates or None
        ticket = parse_ticket(request.ticket) if request.ticket else None
        stats: dict[str, float] = {}
        if ticket is not None:
            def receive(timeout: float) -> bytearray:
                stats["started"] = time.perf_counter()
                return download(ticket, request.node_id, ca, timeout=transfer_timeout(ticket, timeout), stats=stats)
        else:
            def receive(timeout: float) -> bytes:
                return request.payload
        if self.ranks is not None:  # the other ranks run the same job on the same bytes
            receive = self._hand_on(request, receive)
        sent, metrics = run_job(job, receive, save_in_background=True, stream_reply=ticket is not None)
        self.jobs += 1
        metrics["node-worker-jobs"] = self.jobs
        if "first_byte" in stats:  # before the first byte, the node waited for the server to publish
            metrics["download-wait-seconds"] = stats["first_byte"] - stats["started"]
        if ticket is None:
            result = pb.NodeResult(payload=bytes(sent))  # protobuf takes bytes only (one copy, Flower's path)
        else:
            upload_started = time.perf_counter()
            timeout = runtime_for(job).cfg.round_timeout
            if isinstance(sent, StreamingEncode):  # the upload streams the reply while it is encoded
                try:
                    digest = upload(ticket, request.node_id, sent.buffer, ca, timeout=timeout, ready=sent.wait_for)
                except DataPlaneError:
                    sent.result()  # an encoding error is the cause: raise it instead
                    raise
                sent.result()
                metrics["encode-seconds"] = sent.seconds
                metrics["codec-seconds"] = metrics.get("decode-seconds", 0.0) + sent.seconds
            else:
                digest = upload(ticket, request.node_id, sent, ca, timeout=timeout)
            metrics["upload-seconds"] = time.perf_counter() - upload_started
            result = pb.NodeResult(upload_digest=digest)
        metrics["worker-seconds"] = time.perf_counter() - started
        for key, value in metrics.items():
            result.metrics[key] = float(value)
        return result


    def _hand_on(self, request: pb.NodeJob, receive):
        """Send the job to the other ranks now, and `receive` wrapped so that the state it
        returns (or an empty one: its download failed) goes to them too."""
        ranks = self.ranks
        ranks.broadcast_bytes(json.dumps({
            "kind": request.kind, "run_id": request.run_id, "run_config_json": request.run_config_json,
            "explicit_keys": list(request.explicit_keys), "node_config_json": request.node_config_json}).encode())

        def handed_on(timeout: float):
            try:
                data = receive(timeout)
            except BaseException:
                ranks.broadcast_bytes(b"")
                raise
            return ranks.broadcast_bytes(data)
        return handed_on


def follow(ranks: LocalRanks) -> None:
    """A rank that is not its node's lead: run every job the lead hands on, on the state it hands
    on, until it hands on an empty job (its shutdown). Such a rank loads the lead's copy of the
    node's state (`ReadOnlyStore`) and saves, encodes and uploads nothing."""
    jobs = 0
    while True:
        raw = ranks.broadcast_bytes(None)
        if not raw:
            log.info("rank %d: the lead stopped; %d jobs run", ranks.rank, jobs)
            return
        spec = json.loads(bytes(raw))
        job = Job(spec["kind"], spec["run_id"], json.loads(spec["run_config_json"]), tuple(spec["explicit_keys"]),
                  json.loads(spec["node_config_json"]))

        def receive(timeout: float) -> bytearray:
            data = ranks.broadcast_bytes(None)
            if not data:
                raise RuntimeError("the lead rank could not get the round's state (its download failed)")
            return data
        try:
            run_job(job, receive, store_for=lambda cfg, pid: ReadOnlyStore(disk_store(cfg, pid)),
                    save_in_background=True, encode_reply=False)
            jobs += 1
        except Exception:  # noqa: BLE001 (the lead reports the job's failure to the server)
            log.exception("rank %d: job %s of run %d failed", ranks.rank, job.kind, job.run_id)


def stop_followers(ranks: LocalRanks | None) -> None:
    """The lead's shutdown: the other ranks leave `follow`."""
    if ranks is not None and ranks.lead and ranks.world > 1:
        try:
            ranks.broadcast_bytes(b"")
        except Exception as err:  # noqa: BLE001 (torchrun may have stopped them already: SIGTERM reaches every rank)
            log.info("the other ranks are gone already (%s)", err)


def serve(listen: str, ranks: LocalRanks | None = None) -> grpc.Server:
    """Start the node worker's gRPC server on `listen` (a unix socket or a loopback port); with
    `ranks`, as the lead of a node of several ranks."""
    runtime.LOCAL_RANKS = ranks
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=OPTIONS)
    pb_grpc.add_NodeWorkerServicer_to_server(NodeWorkerServicer(ranks), server)
    if server.add_insecure_port(check_local(listen)) == 0:
        raise OSError(f"node worker: cannot listen on {listen}")
    server.start()
    return server
