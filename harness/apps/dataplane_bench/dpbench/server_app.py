"""ServerApp: per planned exchange (mode:MB), encode a random fp32 GlobalState once, send it to
every node (a data-plane ticket each, or the payload inside the message), wait for all replies
(polling every 20 ms), take and decode them; one JSON row per exchange."""

import json
import time
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

import lordo_fed
from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import encode_global_state
from lordo_fed.app.records import TICKET, UPLOAD_DIGEST, payload_bytes, payload_record, shorten_pull_backoff
from lordo_fed.metrics import peak_rss_bytes
from lordo_fed.wire.messages import GlobalState
from lordo_fed.transport.server import DataPlaneServer

from .common import draw, samples

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    shorten_pull_backoff()  # as server/courier.py does
    cfg = context.run_config
    plan = [(m, float(mb)) for m, mb in (p.split(":") for p in str(cfg["plan"]).split(","))]
    want = int(cfg["nodes"])
    t_wait = time.time()
    while len(list(grid.get_node_ids())) < want:
        if time.time() - t_wait > 60:
            raise RuntimeError(f"fewer than {want} nodes connected")
        time.sleep(0.1)
    nodes = sorted(grid.get_node_ids())[:want]
    plane = None
    if any(mode == "grpc" for mode, _ in plan):
        tls = None
        if cfg["certfile"]:
            tls = (Path(str(cfg["certfile"])).read_bytes(), Path(str(cfg["keyfile"])).read_bytes())
        plane = DataPlaneServer(str(cfg["spool-dir"]), tls=tls).start()
    try:
        for i, (mode, mb) in enumerate(plan):
            row = exchange(grid, plane, nodes, i + 1, mode, mb, float(cfg["timeout"]))
            row["lordo_fed"] = lordo_fed.__file__
            with open(str(cfg["result-path"]), "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        if plane is not None:
            plane.stop()


def exchange(grid, plane, nodes, rnd, mode, mb, timeout):
    n = max(1, int(mb * 1e6 / 4))
    seed = 1000 * rnd
    node_seed = {nd: seed + k + 1 for k, nd in enumerate(nodes)}
    theta = draw(seed, n)
    base = {"floats": n, "samples": samples(theta)}
    t0, c0 = time.time(), time.process_time()
    data = encode_global_state(GlobalState(round=rnd, params={"w": theta}), "dpbench", "fp32")
    t1, c1 = time.time(), time.process_time()
    nbytes = len(data)
    if mode == "grpc":  # server/courier.py `Courier.outgoing`: publish once, a ticket per node
        tickets = plane.publish(rnd, data, nodes, ttl=timeout + 60, max_upload=nbytes + (1 << 20))
        t2, c2 = time.time(), time.process_time()
        msgs = [Message(RecordDict({"config": ConfigRecord({**base, "bytes": nbytes, "node-seed": node_seed[nd],
                                                            TICKET: tickets[nd].SerializeToString()})}),
                        dst_node_id=nd, message_type=MessageType.TRAIN) for nd in nodes]
    else:
        record = payload_record(data)
        t2, c2 = time.time(), time.process_time()
        msgs = [Message(RecordDict({"state": record, "config": ConfigRecord({**base, "bytes": nbytes,
                                                                             "node-seed": node_seed[nd]})}),
                        dst_node_id=nd, message_type=MessageType.TRAIN) for nd in nodes]
        del record, data
    del theta
    t3 = time.time()
    ids = [m for m in grid.push_messages(msgs) if m]
    t4 = time.time()
    del msgs
    if len(ids) != len(nodes):
        raise RuntimeError(f"pushed {len(ids)} of {len(nodes)} messages")
    replies, arrived = {}, {}
    while len(replies) < len(ids):
        if time.time() - t3 > timeout:
            raise RuntimeError(f"exchange {rnd}: {len(replies)} of {len(ids)} replies after {timeout:g} s")
        pending = [m for m in ids if m not in replies]
        got = list(grid.pull_messages(pending))
        now = time.time()
        for reply in got:
            replies[reply.metadata.reply_to_message_id] = reply
            arrived[reply.metadata.src_node_id] = now
        if len(replies) < len(ids):
            time.sleep(0.02)
    t5 = time.time()
    updates, decode_s, decode_cpu, checks, held = {}, {}, {}, {}, []
    for reply in replies.values():
        nd = reply.metadata.src_node_id
        if reply.has_error():
            raise RuntimeError(f"node {nd}: {reply.error.reason}")
        td, cd = time.time(), time.process_time()
        upload = None
        if mode == "grpc":  # server/courier.py `Courier._upload_of`
            upload = plane.upload(nd, rnd)
            declared = str(reply.content.config_records["upload"][UPLOAD_DIGEST])
            if upload is None or upload.digest != declared:
                raise RuntimeError(f"node {nd}: no verified upload matching digest {declared[:16]}...")
            buf = upload.buffer()
        else:
            buf = payload_bytes(reply.content["update"])
        # as `Courier.screened`: a data-plane upload is decoded in place (its tensors are views of
        # the upload's buffer, which stays held until the round is done with them: `held` below)
        updates[nd] = decode_update(buf, expected_model_id="dpbench", adopt=upload is not None)
        # the data plane hashed the bytes as they arrived and matched the node's digest (and the
        # reply vouches for the same): checked above; the Flower path has no digest of its own
        checks[nd] = {"up_bytes_received": len(buf), "up_digest_ok": True if upload is not None else None}
        del buf
        if upload is not None:
            held.append(upload)
        decode_s[nd], decode_cpu[nd] = time.time() - td, time.process_time() - cd
    t_end = time.time()
    rows = {}
    for nd in nodes:  # checks, outside the timed part
        m = replies_by_node(replies)[nd].content["metrics"]
        delta = updates[nd].delta["w"]
        rows[str(nd)] = {
            "control_down_s": float(m["t-start"]) - t3, "gen_s": float(m["gen-s"]), "download_s": float(m["down-s"]),
            "t_download": [float(m["t-down"]) - t0, float(m["t-down"]) + float(m["down-s"]) - t0],
            "client_decode_s": float(m["decode-s"]), "client_encode_s": float(m["encode-s"]),
            "upload_s": float(m["up-s"]),
            "t_upload": [float(m["t-up"]) - t0, float(m["t-up"]) + float(m["up-s"]) - t0],
            "control_up_s": arrived[nd] - float(m["t-end"]), "server_decode_s": decode_s[nd],
            "server_decode_cpu_s": decode_cpu[nd], "download_cpu_s": float(m["down-cpu"]),
            "client_decode_cpu_s": float(m["decode-cpu"]), "client_encode_cpu_s": float(m["encode-cpu"]),
            "upload_cpu_s": float(m["up-cpu"]),
            "down_bytes": int(m["down-bytes"]), "up_bytes": int(m["up-bytes"]),
            "down_ok": bool(m["down-ok"]), "up_content_ok": bool(torch.equal(delta, draw(node_seed[nd], n))),
            "client_peak_rss_mb": float(m["peak-rss-mb"]),
            **checks[nd],
        }
        rows[str(nd)]["verified"] = bool(
            rows[str(nd)]["down_ok"] and rows[str(nd)]["up_content_ok"] and rows[str(nd)]["down_bytes"] == nbytes
            and rows[str(nd)]["up_bytes"] == rows[str(nd)]["up_bytes_received"] and rows[str(nd)]["up_digest_ok"] is not False)
    del updates, delta
    for upload in held:  # the round is done with the replies (Courier: after aggregation)
        upload.discard()
    gen = max(r["gen_s"] for r in rows.values())
    return {
        "round": rnd, "mode": mode, "size_mb": mb, "payload_bytes_down": nbytes,
        "bytes_moved": sum(r["down_bytes"] + r["up_bytes"] for r in rows.values()),
        "exchange_s": t_end - t0 - gen, "client_gen_excluded_s": gen,
        "server_encode_s": t1 - t0, "publish_s": t2 - t1, "push_s": t4 - t3,
        "server_encode_cpu_s": c1 - c0, "publish_cpu_s": c2 - c1,
        "replies_s": t5 - t0, "server_decode_s": t_end - t5, "tls": bool(plane is not None and plane.tls),
        "server_peak_rss_mb": peak_rss_bytes() / 1024**2, "nodes": rows,
        "verified": all(r["verified"] for r in rows.values()),
    }


def replies_by_node(replies):
    return {r.metadata.src_node_id: r for r in replies.values()}
