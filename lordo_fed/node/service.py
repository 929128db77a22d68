"""The node worker: a long-lived process per node that runs the node's rounds.

Flower starts a new ClientApp process for every message, which would import torch, rebuild the
model and reload the worker state (~760 MB for 125M) every round. The node worker keeps the
model, the optimizer state and the data cursor on its device between rounds; the ClientApp
hands it each job over a local channel (lordo_fed/node/channel.py) and returns the small
result. With the gRPC data plane the worker downloads the state and uploads its reply itself
(lordo_fed/node/session.py), and in asynchronous rounds runs a whole session of rounds on it.
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
from lordo_fed.node.runtime import Job, ReadOnlyStore, disk_store, run_job
from lordo_fed.node.session import data_plane_round, run_session
from lordo_fed.transport.client import SessionEnded, parse_ticket
from lordo_fed.v1 import node_pb2 as pb
from lordo_fed.v1 import node_pb2_grpc as pb_grpc

log = logging.getLogger("lordo_fed.node")

SESSION_ENDED = b"lordo-fed: session ended"
"""What the lead hands on, in place of a round's state, when its asynchronous session has no
further round (an empty one means its download failed). No encoded GlobalState is this short."""


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
        hand_on = None if self.ranks is None else (lambda receive: self._hand_on(request, receive))
        if not request.ticket:  # the state came inside Flower's message, and the reply goes back in it
            def receive(timeout: float) -> bytes:
                return request.payload
            if hand_on is not None:  # the other ranks run the same job on the same bytes
                receive = hand_on(receive)
            sent, metrics = run_job(job, receive, save_in_background=True)
            result = pb.NodeResult(payload=bytes(sent))  # protobuf takes bytes only (one copy, Flower's path)
        else:
            ticket = parse_ticket(request.ticket)
            if ticket.session:  # asynchronous rounds: round after round on the data plane, then one result
                metrics = run_session(job, ticket, request.node_id, ca, hand_on)
                result = pb.NodeResult()
            else:
                receipt, metrics = data_plane_round(job, ticket, request.node_id, ca, hand_on)
                result = pb.NodeResult(upload_digest=receipt.digest)
        self.jobs += 1
        metrics["node-worker-jobs"] = self.jobs
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
            except SessionEnded:  # the session's normal end: the others leave the job quietly
                ranks.broadcast_bytes(SESSION_ENDED)
                raise
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
            if len(data) == len(SESSION_ENDED) and bytes(data) == SESSION_ENDED:
                raise SessionEnded("the lead's asynchronous session has no further round")
            return data
        try:
            run_job(job, receive, store_for=lambda cfg, pid: ReadOnlyStore(disk_store(cfg, pid)),
                    save_in_background=True, encode_reply=False)
            jobs += 1
        except SessionEnded:  # not a failure: the session's rounds were run as its jobs
            log.info("rank %d: the lead's session of run %d ended", ranks.rank, job.run_id)
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
