"""Stand-in ClientApp of benchmarks/server_memory_deployment.py (see its docstring)."""

import time

import torch
from flwr.app import Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from benchmarks.server_memory import random_update
from client.app import receive_state, send_reply
from lordo_fed.wire.codec import model_id
from lordo_fed.wire.decode import decode_global_state
from lordo_fed.wire.encode import encode_update
from lordo_fed.data.tokenizer import load_tokenizer
from lordo_fed.app.records import explicit_keys
from lordo_fed.rounds.methods import lowrank_ranks, resolve_method
from lordo_fed.model import build_model
from lordo_fed.node.runtime import app_config

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _reply(msg, context)


def _reply(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    cfg = app_config(dict(context.run_config), explicit_keys(msg))
    settings = resolve_method(cfg.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps)
    with torch.device("meta"):
        model = build_model(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ranks = lowrank_ranks(model, cfg.model.lowrank_pattern, cfg.inner.rank, settings.inner.name)
    state = decode_global_state(receive_state(msg, context, cfg.round_timeout), model_id(dict(model.named_parameters())))
    update = random_update(shapes, ranks, settings.rounds, int(context.node_config["partition-id"]), state.round,
                           state.opt_step + cfg.rounds.local_steps)
    del state
    data = encode_update(update, model_id(dict(model.named_parameters())), cfg.payload_dtype)
    del update
    content = send_reply(msg, context, data, cfg.round_timeout)
    content["metrics"] = MetricRecord({"client-seconds": time.perf_counter() - started})
    return Message(content=content, reply_to=msg)
