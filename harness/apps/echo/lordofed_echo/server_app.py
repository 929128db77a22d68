"""ServerApp: wait for min-nodes, then each round send one train message per connected node
and record who answered; write a JSON summary to run_config["result-path"]."""

import json
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    t_start = time.monotonic()
    min_nodes = int(cfg["min-nodes"])
    while len(list(grid.get_node_ids())) < min_nodes:
        if time.monotonic() - t_start > float(cfg["node-wait-timeout"]):
            raise RuntimeError(f"fewer than {min_nodes} nodes connected")
        time.sleep(0.1)
    out = {"node_wait_s": time.monotonic() - t_start, "rounds": []}
    for rnd in range(1, int(cfg["num-server-rounds"]) + 1):
        if rnd == int(cfg["fail-on-round"]):
            raise RuntimeError(f"fail-on-round={rnd}")
        t0 = time.monotonic()
        node_ids = sorted(grid.get_node_ids())
        messages = [
            Message(
                content=RecordDict({"config": ConfigRecord({"round": rnd})}),
                message_type=MessageType.TRAIN,
                dst_node_id=node_id,
                group_id=str(rnd),
            )
            for node_id in node_ids
        ]
        replies = list(grid.send_and_receive(messages, timeout=float(cfg["round-timeout"])))
        ok = [m for m in replies if not m.has_error()]
        metrics = [m.content["metrics"] for m in ok]
        out["rounds"].append({
            "round": rnd,
            "node_ids": [int(n) for n in node_ids],
            "partition_ids": sorted(int(m["partition-id"]) for m in metrics),
            "echo_rounds": sorted(int(m["round"]) for m in metrics),
            "client_pids": sorted(int(m["pid"]) for m in metrics),
            "errors": len(replies) - len(ok),
            "seconds": time.monotonic() - t0,
        })
    out["total_s"] = time.monotonic() - t_start
    with open(cfg["result-path"], "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
