"""A ClientApp for the hostile-client simulation test: the real one (client/app.py), except that the
node with partition id HOSTILE_PARTITION corrupts every train reply on the wire: the first
float of its first pseudo-gradient tensor becomes NaN (the payload stays well-formed protobuf,
so the server's finiteness check is what must catch it). Query (round-0 gradient) replies and
every other node's replies pass through unchanged.

In an asynchronous session on the gRPC data plane the replies never travel in a Flower message:
there the node poisons each upload of its session the same way (the session's `run_job` wrapped for
the message's duration, the reply encoded whole instead of streamed).

Not part of the app: `test_simulation_drops_a_hostile_client` builds a throwaway app directory
whose pyproject names `harness.apps.hostile_clientapp:app` as the ClientApp.
"""

from __future__ import annotations

import contextlib
import struct

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from client.app import query as real_query
from client.app import train as real_train
from lordo_fed.app.records import payload_bytes, payload_record
from lordo_fed.v1 import wire_pb2 as pb

HOSTILE_PARTITION = 1
app = ClientApp()


def poison(data: bytes) -> bytes:
    """The same WorkerUpdate with NaN as the first value of its first delta tensor (fp32 or bf16)."""
    msg = pb.WorkerUpdate()
    msg.ParseFromString(data)
    t = msg.delta[0]
    nan = struct.pack("<f", float("nan"))
    t.data = (nan if t.codec == pb.RAW else nan[2:]) + t.data[4 if t.codec == pb.RAW else 2:]
    return msg.SerializeToString()


@contextlib.contextmanager
def poisoned_sessions():
    """Every reply a data-plane session of this process uploads meanwhile, poisoned."""
    from lordo_fed.node import session

    real_run_job = session.run_job

    def run_job(job, receive, **kwargs):
        sent, metrics = real_run_job(job, receive, **{**kwargs, "stream_reply": False})
        return poison(sent), metrics

    session.run_job = run_job
    try:
        yield
    finally:
        session.run_job = real_run_job


@app.train()
def train(msg: Message, context: Context) -> Message:
    if int(context.node_config.get("partition-id", 0)) != HOSTILE_PARTITION:
        return real_train(msg, context)
    with poisoned_sessions():
        reply = real_train(msg, context)
    if "update" not in reply.content:  # a session's closing reply (its uploads were poisoned above)
        assert "upload" not in reply.content, "a synchronous upload on the data plane is not poisoned by this app"
        return reply
    bad = poison(payload_bytes(reply.content["update"]))
    content = RecordDict({"update": payload_record(bad), "metrics": reply.content["metrics"]})
    return Message(content=content, reply_to=msg)


app.query()(real_query)
