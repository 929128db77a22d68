"""Stock ClientApp: a tiny torch model, one SGD step (train) or one forward pass (evaluate)."""

import time

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .model import batch, make_model

app = ClientApp()


def _load(msg):
    torch.set_num_threads(1)
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


@app.train()
def train(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    model = _load(msg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(int(context.node_config.get("partition-id", 0)))
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    metrics = MetricRecord({"train_loss": loss.item(), "num-examples": int(x.shape[0]),
                            "client-seconds": time.perf_counter() - t0})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    model = _load(msg)
    x, y = batch(1000 + int(context.node_config.get("partition-id", 0)))
    with torch.no_grad():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    metrics = MetricRecord({"eval_loss": loss.item(), "num-examples": int(x.shape[0]),
                            "client-seconds": time.perf_counter() - t0})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
