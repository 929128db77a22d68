"""ClientApp: decode the GlobalState, reply with a random fp32 WorkerUpdate of the same size."""

import time

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from lordo_fed.wire.decode import decode_global_state
from lordo_fed.wire.encode import encode_update
from lordo_fed.app.records import payload_bytes, payload_record
from lordo_fed.metrics import peak_rss_bytes
from lordo_fed.wire.messages import WorkerUpdate


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    t0 = time.time()
    data = payload_bytes(msg.content["state"])
    t1 = time.time()
    state = decode_global_state(data, expected_model_id="payloadbench")
    t2 = time.time()
    del data
    n = int(msg.content["config"]["floats"])
    assert state.params["w"].numel() == n
    del state
    rng = np.random.default_rng(int(msg.content["config"]["seed"]))
    delta = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    t3 = time.time()
    out = encode_update(WorkerUpdate(worker_id=0, round=1, delta={"w": delta}, moments={}, tokens=1, opt_step=0),
                        "payloadbench", "fp32")
    t4 = time.time()
    del delta
    record = payload_record(out)
    del out
    t5 = time.time()
    metrics = MetricRecord({"t-start": t0, "unwrap-s": t1 - t0, "decode-s": t2 - t1, "encode-s": t4 - t3,
                            "record-s": t5 - t4, "peak-rss-mb": peak_rss_bytes() / 1024**2,
                            "t-end": time.time()})
    return Message(RecordDict({"update": record, "metrics": metrics}), reply_to=msg)
