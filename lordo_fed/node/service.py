"""The node worker: a long-lived process per node that runs the node's rounds.

Flower starts a new ClientApp process for every message, which would import torch, rebuild the
model and reload the worker state (~760 MB for 125M) every round. The node worker keeps the
model, the optimizer state and the data cursor on its device between rounds; the ClientApp
hands it each job over a local channel (lordo_fed/node/channel.py) and returns the small
result. With the gRPC data plane the worker downloads the state and uploads its reply itself.
After each round it persists the worker state to disk on a thread, off the critical path (the
next round waits for it), so a restarted worker resumes from disk without losing a round.

    python -m lordo_fed.node --listen unix:///run/lordo/node-0.sock
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from lordo_fed.appconfig import PRESET_DIR
from lordo_fed.node.channel import OPTIONS, check_local
from lordo_fed.node.runtime import Job, run_job, runtime_for
from lordo_fed.codec import StreamingEncode
from lordo_fed.transport.client import DataPlaneError, download, parse_ticket, transfer_timeout, upload
from lordo_fed.v1 import node_pb2 as pb
from lordo_fed.v1 import node_pb2_grpc as pb_grpc

log = logging.getLogger("lordo_fed.node")


class NodeWorkerServicer(pb_grpc.NodeWorkerServicer):
    """Runs the jobs of one node, one at a time (they share the node's device and state)."""

    def __init__(self, presets: Path = PRESET_DIR):
        self.presets = presets
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
        ca = str(job.node_config.get("root-certificates", "")) or None
        ticket = parse_ticket(request.ticket) if request.ticket else None
        stats: dict[str, float] = {}
        if ticket is not None:
            def receive(timeout: float) -> bytearray:
                stats["started"] = time.perf_counter()
                return download(ticket, request.node_id, ca, timeout=transfer_timeout(ticket, timeout), stats=stats)
        else:
            def receive(timeout: float) -> bytes:
                return request.payload
        presets = Path(request.presets_dir) if request.presets_dir else self.presets
        sent, metrics = run_job(job, receive, presets=presets, save_in_background=True, stream_reply=ticket is not None)
        self.jobs += 1
        metrics["node-worker-jobs"] = self.jobs
        if "first_byte" in stats:  # before the first byte, the node waited for the server to publish
            metrics["download-wait-seconds"] = stats["first_byte"] - stats["started"]
        if ticket is None:
            result = pb.NodeResult(payload=bytes(sent))  # protobuf takes bytes only (one copy, Flower's path)
        else:
            upload_started = time.perf_counter()
            timeout = runtime_for(job, presets).cfg.round_timeout
            if isinstance(sent, StreamingEncode):  # the upload streams the reply while it is encoded
                try:
                    sha = upload(ticket, request.node_id, sent.buffer, ca, timeout=timeout, ready=sent.wait_for)
                except DataPlaneError:
                    sent.result()  # an encoding error is the cause: raise it instead
                    raise
                sent.result()
                metrics["encode-seconds"] = sent.seconds
                metrics["codec-seconds"] = metrics.get("decode-seconds", 0.0) + sent.seconds
            else:
                sha = upload(ticket, request.node_id, sent, ca, timeout=timeout)
            metrics["upload-seconds"] = time.perf_counter() - upload_started
            result = pb.NodeResult(upload_sha256=sha)
        metrics["worker-seconds"] = time.perf_counter() - started
        for key, value in metrics.items():
            result.metrics[key] = float(value)
        return result


def serve(listen: str, presets: Path = PRESET_DIR) -> grpc.Server:
    """Start the node worker's gRPC server on `listen` (a unix socket or a loopback port)."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=OPTIONS)
    pb_grpc.add_NodeWorkerServicer_to_server(NodeWorkerServicer(presets), server)
    if server.add_insecure_port(check_local(listen)) == 0:
        raise OSError(f"node worker: cannot listen on {listen}")
    server.start()
    return server
