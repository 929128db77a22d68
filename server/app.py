"""ServerApp: read the run's settings (stopping before round 1 on any bad value), run the strategy."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from lordo_fed.app.config import load_app_config
from lordo_fed.rounds.methods import METHODS
from server.async_strategy import AsyncLoRDOStrategy
from server.strategy import LoRDOStrategy

app = ServerApp()


def explicit_run_config_keys(grid: Grid) -> tuple[str, ...]:
    """The run-config keys the user set for this run (`--run-config`: Flower's
    `Run.override_config`), which must win over a preset even when they equal pyproject's default."""
    try:
        return tuple(sorted(grid.run.override_config))
    except (AttributeError, TypeError):  # a Grid without its Run (not one Flower starts an app with)
        return ()


@app.main()
def main(grid: Grid, context: Context) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request otherwise
    explicit = explicit_run_config_keys(grid)
    cfg = load_app_config(context.run_config, explicit=explicit)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    cls = AsyncLoRDOStrategy if METHODS[cfg.variant].loop == "async" else LoRDOStrategy
    strategy = cls(cfg, explicit)
    recorder = strategy.recorder
    if recorder.finished():
        recorder.write_status("finished")
        print(recorder.nothing_to_do(), flush=True)
        return
    recorder.write_status("running")
    try:
        strategy.start(grid)
    except BaseException:
        recorder.write_status("failed")
        raise
    recorder.write_status("finished")
    print(f"lordo-fed: metrics {strategy.out_dir / 'server.jsonl'}, plots {strategy.out_dir / 'val_loss.png'} and "
          f"{strategy.out_dir / 'bytes.png'}, checkpoints {strategy.checkpoint_dir}", flush=True)
