"""ServerApp: per size, encode a random fp32 GlobalState, push it, poll every 20 ms, decode the reply."""

import json
import time

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import encode_global_state
from lordo_fed.app.records import payload_bytes, payload_record, shorten_pull_backoff
from lordo_fed.metrics import peak_rss_bytes
from lordo_fed.wire.messages import GlobalState


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    shorten_pull_backoff()  # as server/courier.py does
    cfg = context.run_config
    sizes = [float(s) for s in str(cfg["sizes-mb"]).split(",")]
    t_wait = time.time()
    while not list(grid.get_node_ids()):
        if time.time() - t_wait > 60:
            raise RuntimeError("no node connected")
        time.sleep(0.1)
    node = sorted(grid.get_node_ids())[0]
    for i, mb in enumerate(sizes):
        n = max(1, int(mb * 1e6 / 4))
        theta = torch.from_numpy(np.random.default_rng(2 * i).standard_normal(n, dtype=np.float32))
        t0 = time.time()
        data = encode_global_state(GlobalState(round=i + 1, params={"w": theta}), "payloadbench", "fp32")
        t1 = time.time()
        record = payload_record(data)
        t2 = time.time()
        nbytes = len(data)
        del data, theta
        msg = Message(RecordDict({"state": record, "config": ConfigRecord({"floats": n, "seed": 2 * i + 1})}),
                      dst_node_id=node, message_type=MessageType.TRAIN)
        del record
        t3 = time.time()
        ids = [m for m in grid.push_messages([msg]) if m]
        t4 = time.time()
        del msg
        while True:
            tp = time.time()
            got = list(grid.pull_messages(ids))
            if got:
                break
            time.sleep(0.02)
        t5 = time.time()
        reply = got[0]
        if reply.has_error():
            raise RuntimeError(f"client error: {reply.error.reason}")
        m = reply.content["metrics"]
        back = payload_bytes(reply.content["update"])
        t6 = time.time()
        update = decode_update(back, expected_model_id="payloadbench")
        t7 = time.time()
        assert update.delta["w"].numel() == n
        row = {
            "index": i, "size_mb": mb, "down_bytes": nbytes, "up_bytes": len(back),
            "server_encode_s": t1 - t0, "server_record_s": t2 - t1, "push_s": t4 - t3,
            "down_s": float(m["t-start"]) - t3,
            "client_unwrap_s": float(m["unwrap-s"]), "client_decode_s": float(m["decode-s"]),
            "client_encode_s": float(m["encode-s"]), "client_record_s": float(m["record-s"]),
            "up_s": t5 - float(m["t-end"]), "pull_s": t5 - tp,
            "server_unwrap_s": t6 - t5, "server_decode_s": t7 - t6,
            "server_peak_rss_mb": peak_rss_bytes() / 1024**2,
            "client_peak_rss_mb": float(m["peak-rss-mb"]),
        }
        del reply, got, back, update
        with open(cfg["result-path"], "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
