"""A node's rounds on the gRPC data plane: one round from a ticket (download, train, upload), and
an asynchronous session, round after round with no Flower message between them.

In a session (docs/deployment.md, "Asynchronous rounds on the data plane") Flower delivers one
message per node with the ticket of its first round. The node downloads its start point, trains
its local steps, uploads its reply; the upload's receipt carries the ticket of its next round,
whose download waits until the server has applied the reply (HeLoCo's correction, the outer step)
and published the node's next start point (the look-ahead). When the server has no further round
for the node, that download answers `finished` and the session ends; the Flower reply then
reports the session's rounds.

Hosts: the node worker (lordo_fed/node/service.py) and the in-process ClientApp (client/app.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from lordo_fed.app.config import AppConfig
from lordo_fed.node.runtime import Job, disk_store, run_job, runtime_for, wait_for_saves
from lordo_fed.node.store import StateStore
from lordo_fed.transport.client import DataPlaneError, SessionEnded, download, transfer_timeout, upload
from lordo_fed.v1 import dataplane_pb2 as pb
from lordo_fed.wire.encode import StreamingEncode

log = logging.getLogger("lordo_fed.node")

Receive = Callable[[float], bytes | bytearray | memoryview]


def data_plane_round(job: Job, ticket: pb.Ticket, node_id: int, root_certificates=None,
                     hand_on: Callable[[Receive], Receive] | None = None,
                     store_for: Callable[[AppConfig, int], StateStore] = disk_store
                     ) -> tuple[pb.UploadReceipt, dict[str, float]]:
    """One round from a data-plane ticket: download the state it names, run `job` on it
    (`run_job`: the worker state saved in the background), upload the reply while it is encoded.
    `hand_on` wraps the download for the other ranks of the node (lordo_fed/node/service.py).
    Returns the server's receipt and the round's metrics (`run_job`'s, plus `download-wait-seconds`,
    `upload-seconds`). Raises SessionEnded when a session has no further round."""
    stats: dict[str, float] = {}

    def receive(timeout: float):
        stats["started"] = time.perf_counter()
        return download(ticket, node_id, root_certificates, timeout=transfer_timeout(ticket, timeout), stats=stats)
    if hand_on is not None:
        receive = hand_on(receive)
    sent, metrics = run_job(job, receive, store_for=store_for, save_in_background=True, stream_reply=True)
    if "first_byte" in stats:  # before the first byte, the node waited for the server to publish
        metrics["download-wait-seconds"] = stats["first_byte"] - stats["started"]
    upload_started = time.perf_counter()
    timeout = runtime_for(job).cfg.round_timeout
    if isinstance(sent, StreamingEncode):  # the upload streams the reply while it is encoded
        try:
            receipt = upload(ticket, node_id, sent.buffer, root_certificates, timeout=timeout, ready=sent.wait_for)
        except DataPlaneError:
            sent.result()  # an encoding error is the cause: raise it instead
            raise
        sent.result()
        metrics["encode-seconds"] = sent.seconds
        metrics["codec-seconds"] = metrics.get("decode-seconds", 0.0) + sent.seconds
    else:
        receipt = upload(ticket, node_id, sent, root_certificates, timeout=timeout)
    metrics["upload-seconds"] = time.perf_counter() - upload_started
    return receipt, metrics


def run_session(job: Job, ticket: pb.Ticket, node_id: int, root_certificates=None,
                hand_on: Callable[[Receive], Receive] | None = None,
                store_for: Callable[[AppConfig, int], StateStore] = disk_store) -> dict[str, float]:
    """An asynchronous session from its first ticket to the server's `finished`: rounds one after
    another, each on the ticket the previous upload's receipt carried. Returns the session's
    metrics: `session-rounds`, and the sums of `train-seconds`, `download-wait-seconds` (waiting
    for the server's next start point), `download-seconds` and `upload-seconds`. A failed round
    raises (the Flower reply then carries the error, and the server sends the round again)."""
    if not ticket.session:
        raise DataPlaneError(f"ticket of round {ticket.round} is not a session's")
    totals = {"session-rounds": 0.0, "train-seconds": 0.0, "download-wait-seconds": 0.0, "download-seconds": 0.0,
              "upload-seconds": 0.0}
    started = time.perf_counter()
    try:
        while True:
            try:
                receipt, metrics = data_plane_round(job, ticket, node_id, root_certificates, hand_on, store_for)
            except SessionEnded:
                break
            totals["session-rounds"] += 1
            for key in totals.keys() - {"session-rounds"}:
                totals[key] += float(metrics.get(key, 0.0))
            for key in ("partition-id", "local-steps", "slowdown"):
                totals[key] = float(metrics[key])
            ticket = receipt.next
    finally:
        wait_for_saves()  # the last round's state is on disk before the session reports
    totals["session-seconds"] = time.perf_counter() - started
    log.info("node %d: session ended after %d rounds", node_id, int(totals["session-rounds"]))
    return totals
