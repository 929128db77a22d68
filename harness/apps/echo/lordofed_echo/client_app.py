"""ClientApp: echo partition-id (node config) and the round back in a MetricRecord."""

import os

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    metrics = MetricRecord({
        "partition-id": int(context.node_config["partition-id"]),
        "round": int(msg.content["config"]["round"]),
        "pid": os.getpid(),
    })
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
