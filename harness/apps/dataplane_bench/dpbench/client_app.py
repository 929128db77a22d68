"""ClientApp: fetch and decode the GlobalState (data plane with the ticket, or inside the message),
encode a random fp32 WorkerUpdate of the same size, send it (upload + its digest in the reply, or
inside the reply); timestamps in the reply's metrics."""

import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from lordo_fed.wire.decode import adoptable, decode_global_state
from lordo_fed.wire.encode import encode_update
from lordo_fed.app.records import TICKET, UPLOAD_DIGEST, payload_bytes, payload_record
from lordo_fed.metrics import peak_rss_bytes
from lordo_fed.wire.messages import WorkerUpdate
from lordo_fed.transport.client import download, parse_ticket, upload

from .common import draw, samples

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    h0 = time.time()
    cfg = msg.content["config"]
    n = int(cfg["floats"])
    delta = draw(int(cfg["node-seed"]), n)  # drawn before the timed part (its seconds are subtracted)
    h1, c1 = time.time(), time.process_time()
    root = str(context.node_config.get("root-certificates", "")) or None
    ticket = parse_ticket(cfg[TICKET]) if TICKET in cfg else None
    timeout = 600.0
    # client/app.py `receive_state`
    data = download(ticket, context.node_id, root, timeout=timeout) if ticket else payload_bytes(msg.content["state"])
    h2, c2 = time.time(), time.process_time()
    state = decode_global_state(data, expected_model_id="dpbench", adopt=adoptable(data))  # as run_job
    h3, c3 = time.time(), time.process_time()
    theta = state.params["w"]
    down_ok = theta.numel() == n and samples(theta) == [float(x) for x in cfg["samples"]]
    down_bytes = len(data)
    del data, state, theta
    h4, c4 = time.time(), time.process_time()
    out = encode_update(WorkerUpdate(worker_id=int(context.node_config.get("partition-id", 0)), round=1,
                                     delta={"w": delta}, moments={}, tokens=1, opt_step=0), "dpbench", "fp32")
    h5, c5 = time.time(), time.process_time()
    del delta
    up_bytes = len(out)
    # client/app.py `send_reply`
    if ticket:
        digest = upload(ticket, context.node_id, out, root, timeout=timeout).digest
        content = RecordDict({"upload": ConfigRecord({UPLOAD_DIGEST: digest})})
    else:
        content = RecordDict({"update": payload_record(out)})
    h6, c6 = time.time(), time.process_time()
    del out
    content["metrics"] = MetricRecord({
        "t-start": h0, "gen-s": h1 - h0, "t-down": h1, "down-s": h2 - h1, "decode-s": h3 - h2,
        "encode-s": h5 - h4, "t-up": h5, "up-s": h6 - h5, "down-ok": int(down_ok), "down-bytes": down_bytes,
        "up-bytes": up_bytes, "down-cpu": c2 - c1, "decode-cpu": c3 - c2, "encode-cpu": c5 - c4, "up-cpu": c6 - c5,
        "peak-rss-mb": peak_rss_bytes() / 1024**2, "t-end": time.time()})
    return Message(content, reply_to=msg)
