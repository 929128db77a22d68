"""ClientApp: one train message = one LoRDO round of K local steps on this node's partition.

Thin and Flower-facing. The round itself (decode the server's `lordo_fed.v1.GlobalState`, run
the library's `Worker` for K steps, encode the `lordo_fed.v1.WorkerUpdate`) is
`lordo_fed.node.runtime.run_job`, which runs either

- here, in the ClientApp process (simulation, quick starts): the model, data and workers are
  built once per process and kept while Flower keeps it (a Ray actor in simulation; in a
  deployment a new process per message), the worker state goes to a store after every round; or
- in the node's long-lived worker process, when the node config names one (`node-worker =
  "unix:///path/to/socket"`, lordo_fed.node.service): this process then only hands the job
  over and returns the result, and never imports torch.

The state arrives inside the message or, with the server's gRPC data plane, as a ticket to
download it (lordo_fed.transport); the reply goes back the same way.
"""

from __future__ import annotations

import sys
import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from lordo_fed.app.records import (IDENTIFY, ROUND_TIMEOUT, SESSION, TICKET, UPLOAD_DIGEST, explicit_keys,
                                   payload_bytes, payload_record)
from lordo_fed.node.config import NodeConfig

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round. Reply metrics: those of `run_job` (`setup-seconds`, `train-seconds`,
    `codec-seconds`, tokens, train loss...), `transfer-seconds` (data plane: download + upload),
    `client-seconds` (the whole handler, what the server reports as client time),
    `clientapp-torch` (whether this process imported torch) and, when the node config declares
    its `link-rate`, `link-bytes-per-second`."""
    return _handle("train", msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """LoRDO-Global's round-0 exchange: this partition's gradient at θ0 for the low-rank weights."""
    return _handle("query", msg, context)


def _handle(kind: str, msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    node = NodeConfig.from_flower(context.node_config)
    config = msg.content.config_records.get("config")
    if kind == "query" and config is not None and config.get(IDENTIFY):
        # Which partition this node trains: the node config says, no model or data needed.
        return Message(content=RecordDict({"metrics": MetricRecord({"partition-id": node.partition_id})}), reply_to=msg)
    ticket = bytes(config[TICKET]) if config is not None and TICKET in config else b""
    session = bool(ticket and config.get(SESSION, 0))  # asynchronous rounds on the data plane: one reply at the end
    worker = node.node_worker
    if worker:
        from lordo_fed.node.channel import run_on_node_worker

        payload = b"" if ticket else payload_bytes(msg.content["state"])
        result = run_on_node_worker(worker, kind, context.run_id, dict(context.run_config), explicit_keys(msg),
                                    dict(context.node_config), context.node_id, ticket=ticket, payload=payload,
                                    timeout=None if session else 3 * _round_timeout(msg, context) + 60)
        metrics = dict(result.metrics)
        if session:
            content = RecordDict()
        elif ticket:
            content = RecordDict({"upload": ConfigRecord({UPLOAD_DIGEST: result.upload_digest})})
        else:
            content = RecordDict({"update": payload_record(result.payload)})
        metrics["transfer-seconds"] = metrics.get("download-seconds", 0.0) + metrics.get("upload-seconds", 0.0)
    elif session:
        from lordo_fed.node.runtime import Job
        from lordo_fed.node.session import run_session
        from lordo_fed.transport.client import parse_ticket

        job = Job(kind, context.run_id, dict(context.run_config), explicit_keys(msg), dict(context.node_config))
        metrics = run_session(job, parse_ticket(ticket), context.node_id, _root_certificates(context),
                              store_for=lambda cfg, pid: _store(cfg, context, pid))
        content = RecordDict()
        metrics["transfer-seconds"] = metrics["download-seconds"] + metrics["upload-seconds"]
    else:
        from lordo_fed.node.runtime import Job, run_job, runtime_for

        job = Job(kind, context.run_id, dict(context.run_config), explicit_keys(msg), dict(context.node_config))
        sent, metrics = run_job(job, lambda timeout: receive_state(msg, context, timeout),
                                store_for=lambda cfg, pid: _store(cfg, context, pid))
        upload_started = time.perf_counter()
        content = send_reply(msg, context, sent, runtime_for(job).cfg.round_timeout)
        metrics["upload-seconds"] = time.perf_counter() - upload_started
        metrics["transfer-seconds"] = metrics.get("download-seconds", 0.0) + metrics["upload-seconds"]
    if kind == "train":
        if node.link_rate:  # the server's link-bound ideal (lordo_fed.wan.links)
            metrics["link-bytes-per-second"] = node.link_bytes_per_second
        metrics["client-seconds"] = time.perf_counter() - started
        metrics["clientapp-torch"] = int("torch" in sys.modules)
        content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


def _store(cfg, context: Context, pid: int):
    """Where this partition's worker state lives between rounds (`client-state`)."""
    if cfg.client_state == "context":
        from client.state import ContextStore

        return ContextStore(context)
    from lordo_fed.node.runtime import disk_store

    return disk_store(cfg, pid)


def _round_timeout(msg: Message, context: Context) -> float:
    """The run's round deadline as the server composed it (its message says: `ROUND_TIMEOUT`,
    a preset's value included); the run config's own value from a server that does not say. A
    node-worker ClientApp composes no settings (it imports no torch), and only bounds its wait with this."""
    config = msg.content.config_records.get("config")
    if config is not None and ROUND_TIMEOUT in config:
        return float(config[ROUND_TIMEOUT])
    return float(context.run_config.get("round-timeout", 600.0))


def receive_state(msg: Message, context: Context, timeout: float) -> bytes | bytearray:
    """The encoded state a server message brings: inside it (Flower data plane), or fetched from
    the gRPC data plane with the message's ticket (checked against its size and digest)."""
    config = msg.content.config_records.get("config")
    if config is None or TICKET not in config:
        return payload_bytes(msg.content["state"])
    from lordo_fed.transport.client import download, parse_ticket, transfer_timeout

    ticket = parse_ticket(config[TICKET])
    return download(ticket, context.node_id, _root_certificates(context), timeout=transfer_timeout(ticket, timeout))


def send_reply(msg: Message, context: Context, data: bytes, timeout: float) -> RecordDict:
    """The reply's content for an encoded update: the update itself (Flower data plane), or only
    its digest once the gRPC data plane has confirmed the upload."""
    config = msg.content.config_records.get("config")
    if config is None or TICKET not in config:
        return RecordDict({"update": payload_record(data)})
    from lordo_fed.transport.client import parse_ticket, upload

    digest = upload(parse_ticket(config[TICKET]), context.node_id, data, _root_certificates(context), timeout=timeout).digest
    return RecordDict({"upload": ConfigRecord({UPLOAD_DIGEST: digest})})


def _root_certificates(context: Context) -> str | None:
    """The CA certificate a node verifies the data plane's TLS with: node config `root-certificates`."""
    return NodeConfig.from_flower(context.node_config).root_certificates or None
