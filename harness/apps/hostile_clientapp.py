"""A ClientApp for the hostile-client simulation test: the real one (client/app.py), except that the
node with partition id HOSTILE_PARTITION corrupts every train reply on the wire: the first
float of its first pseudo-gradient tensor becomes NaN (the payload stays well-formed protobuf,
so the server's finiteness check is what must catch it). Query (round-0 gradient) replies and
every other node's replies pass through unchanged.

Not part of the app: `test_simulation_drops_a_hostile_client` builds a throwaway app directory
whose pyproject names `harness.apps.hostile_clientapp:app` as the ClientApp.
"""

from __future__ import annotations

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


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = real_train(msg, context)
    if int(context.node_config.get("partition-id", 0)) != HOSTILE_PARTITION:
        return reply
    bad = poison(payload_bytes(reply.content["update"]))
    content = RecordDict({"update": payload_record(bad), "metrics": reply.content["metrics"]})
    return Message(content=content, reply_to=msg)


app.query()(real_query)
