"""`lordo-train`: the reference trainer's command line (Hydra).

    lordo-train                                   # LoRDO-Global and DDP on the sample corpus
    lordo-train methods=[ddp,lowrank_ddp,lordo_global,lordo_local,diloco,local_adam] \
        model.preset=small workers=4 rounds.local_steps=32 total_steps=256
    lordo-train --config-dir examples/reference --config-name small_cpu
    lordo-train --help                            # every option with its meaning

Writes, under out_dir: <method>.jsonl (one record per round), val_loss.png (validation loss
against tokens, all methods), summary.json and summary.md, and TensorBoard logs if asked.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch

from lordo_fed.config import describe, register_resolvers
from lordo_fed.data import load_dataset
from lordo_fed.device import pick_device
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.metrics import MetricsWriter, plot_curves
from lordo_fed.trainer.config import TrainConfig
from lordo_fed.trainer.run import RunContext, run_method

log = logging.getLogger("lordo_fed.train")


def train(cfg: TrainConfig) -> dict[str, dict]:
    """Run every method of `cfg` on the same data, model and seed; return the per-method summary."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = pick_device(cfg.device)
    dataset = load_dataset(cfg.data, cfg.workers)
    val_batches = dataset.val_batches(cfg.eval_batches)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    histories: dict[str, list[dict]] = {}
    summary: dict[str, dict] = {}
    for method in cfg.methods:
        settings = resolve_method(method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps)
        history: list[dict] = []
        # A fresh log of this method: a run continued from its checkpoint emits its earlier records again.
        (out / f"{method}.jsonl").unlink(missing_ok=True)
        if cfg.tensorboard:
            shutil.rmtree(out / "tb" / method, ignore_errors=True)
        started = time.perf_counter()
        with MetricsWriter(out, method, tensorboard=cfg.tensorboard) as writer:
            def emit(record: dict) -> None:
                history.append(record)
                writer.write(record)
            ctx = RunContext(cfg, dataset, device, val_batches, emit)
            run_method(ctx, settings)
        histories[method] = history
        # a continued run's seconds: those before its kill (its checkpoint's) and this process's
        summary[method] = _summarise(history, time.perf_counter() - started + ctx.seconds_before)
        log.info("%s: %s", method, summary[method])
    plot_curves(histories, "tokens", "val_loss", out / "val_loss.png", title="Validation loss against tokens")
    (out / "summary.json").write_text(json.dumps({"config": _plain(cfg), "methods": summary}, indent=2))
    (out / "summary.md").write_text(summary_table(summary))
    return summary


def _summarise(history: list[dict], seconds: float) -> dict:
    """Final quality, and wire bytes averaged over the whole run (rounds differ under DES-LOC)."""
    rounds = [r for r in history if "cum_bytes_sent_per_worker" in r]
    last, final_eval = rounds[-1], [r for r in history if "val_loss" in r][-1]
    return {
        "val_loss": final_eval["val_loss"], "val_ppl": final_eval["val_ppl"], "tokens": last["tokens"],
        "bytes_sent_per_worker_per_step": last["cum_bytes_sent_per_worker"] / last["step"],
        "bytes_received_per_worker_per_step": last["cum_bytes_received_per_worker"] / last["step"],
        "opt_state_bytes": last["opt_state_bytes"], "seconds": seconds,
    }


def summary_table(summary: dict[str, dict]) -> str:
    """Markdown table: perplexity, wire bytes per worker per step and optimizer-state bytes."""
    ddp = summary.get("ddp", {}).get("bytes_sent_per_worker_per_step")
    lines = [
        "| method | val loss | val ppl | bytes sent / worker / step | vs DDP | optimizer-state bytes | time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        ratio = "1x (baseline)" if name == "ddp" else vs_ddp(s["bytes_sent_per_worker_per_step"], ddp)
        lines.append(
            f"| {name} | {s['val_loss']:.4f} | {s['val_ppl']:.3f} | {s['bytes_sent_per_worker_per_step']:,.0f} | "
            f"{ratio} | {s['opt_state_bytes']:,} | {s['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def vs_ddp(sent: float, ddp: float | None) -> str:
    """How a method's bytes per step compare with DDP's: 'Nx less', 'Nx more', '1x' (the same to
    one decimal), or '-' without a DDP run to compare with."""
    if not ddp:
        return "-"
    if not sent:
        return "nothing sent"
    ratio = ddp / sent
    if f"{ratio:.1f}" == "1.0" or f"{1 / ratio:.1f}" == "1.0":
        return "1x"
    return f"{ratio:.1f}x less" if ratio > 1 else f"{1 / ratio:.1f}x more"


def _plain(cfg: TrainConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)


HELP_TEMPLATE = """lordo-train: run LoRDO and its baselines on one process (reference trainer).

Override any option as key=value (Hydra syntax), e.g.
  lordo-train methods=[lordo_global,lordo_local,ddp] workers=4 rounds.local_steps=32 inner.rank=16
Presets: --config-dir examples/reference --config-name <name> (see examples/reference/).

Options (key=default  # meaning):
{options}
"""


def _hydra_main() -> None:
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    register_resolvers()  # ${repeat:2*256} in a list override
    cs = ConfigStore.instance()
    cs.store(name="reference", node=TrainConfig)
    options = "\n".join("  " + line for line in describe(TrainConfig()))
    text = HELP_TEMPLATE.format(options=options).replace("$", "$$")
    cs.store(group="hydra/help", name="lordo", node={"app_name": "lordo-train", "header": "", "footer": "",
                                                      "template": text})

    @hydra.main(version_base=None, config_name="reference")
    def _run(raw) -> None:
        cfg: TrainConfig = OmegaConf.to_object(raw)
        summary = train(cfg)
        print(summary_table(summary))
        print(f"metrics: {Path(cfg.out_dir).resolve()}/<method>.jsonl; plot: {Path(cfg.out_dir).resolve()}/val_loss.png")

    _run()


def main() -> None:
    """Console entry point. Hydra writes no run directory of its own; outputs go to out_dir."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    defaults = ["hydra/help=lordo", "hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none",
                "hydra/hydra_logging=none"]
    sys.argv += [d for d in defaults if d.split("=")[0] not in " ".join(sys.argv[1:])]
    _hydra_main()


if __name__ == "__main__":
    main()
