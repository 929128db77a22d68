"""Stock ServerApp: FedAvg.start() (train phase + evaluate phase per round, grid.send_and_receive
polling every 3 s), timed from the strategy's hooks; writes JSON lines to run_config["result-path"]."""

import json
import time

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from .model import make_model

app = ServerApp()


class TimedFedAvg(FedAvg):
    def __init__(self, path, **kw):
        super().__init__(**kw)
        self.path, self.t = path, {}

    def configure_train(self, server_round, arrays, config, grid):
        self.t = {"round": server_round, "train_start": time.perf_counter()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.t["train_end"] = time.perf_counter()
        self.t["train_client"] = max((float(m.content["metrics"]["client-seconds"]) for m in replies
                                      if not m.has_error()), default=0.0)
        self.t["train_ok"] = sum(not m.has_error() for m in replies)
        self.t["payload_bytes"] = sum(a.numpy().nbytes for a in replies[0].content["arrays"].values()) if replies else 0
        return super().aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round, arrays, config, grid):
        self.t["eval_start"] = time.perf_counter()
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        replies = list(replies)
        t = self.t
        t["eval_end"] = time.perf_counter()
        t["eval_client"] = max((float(m.content["metrics"]["client-seconds"]) for m in replies
                                if not m.has_error()), default=0.0)
        t["eval_ok"] = sum(not m.has_error() for m in replies)
        row = {
            "round": server_round, "clients_ok": min(t["train_ok"], t["eval_ok"]),
            "train_phase_seconds": t["train_end"] - t["train_start"],
            "evaluate_phase_seconds": t["eval_end"] - t["eval_start"],
            "round_seconds": t["eval_end"] - t["train_start"],
            "client_seconds": t["train_client"] + t["eval_client"],
            "payload_bytes": t["payload_bytes"], "t_end": t["eval_end"],
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return super().aggregate_evaluate(server_round, replies)


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = TimedFedAvg(context.run_config["result-path"], min_train_nodes=2, min_evaluate_nodes=2,
                           min_available_nodes=2)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(make_model().state_dict()),
                   num_rounds=int(context.run_config["num-server-rounds"]))
