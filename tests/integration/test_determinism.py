"""Same seed, same config: the same run, bit for bit, in Flower's simulation engine.

Two simulation runs (LoRDO-Global with the round-0 gradient exchange, 2 clients, 3 rounds, tiny
model, one torch thread per process), side by side into separate output directories and Flower
environments, must give identical server.jsonl records apart from the wall-clock fields named in
WALL_CLOCK, identical final checkpoint tensors (θ, outer state, projections, moments, counters,
torch RNG; not the unseeded numpy/Python global RNG states, see UNSEEDED_RNG) and metadata, and
identical client state files (error-feedback buffers, local moments, data cursor).

The runs also set `local-steps=32`, pyproject's default, over `preset='quickstart'`'s 16: the
server reads the keys the user set from Flower's Run and names them in every message, so the
server (step counter) and both clients (tokens trained) run K = 32.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lordo_fed.checkpoint import load_checkpoint
from harness.flower import flower_env, run_simulation

APP = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

#: The server.jsonl fields that measure time (server/records.py `Recorder.round_record`, server/strategy.py `start`):
#: excluded from the comparison; every other field must match exactly.
WALL_CLOCK = ("round_seconds", "aggregation_seconds", "client_seconds", "client_train_seconds",
              "client_codec_seconds", "client_transfer_seconds", "upload_seconds", "server_encode_seconds",
              "server_decode_seconds", "overhead_seconds", "elapsed_seconds", "server_peak_rss_bytes", "phase_seconds",
              # with link-rate in the node config (lordo_fed.wan): the link-bound ideal and its parts
              "ideal_seconds", "round_over_ideal", "link_seconds", "link_bound_client", "links",
              "overlap_bound_seconds", "round_over_bound", "client_early_seconds")


def run_config(out: Path) -> dict:
    return {"preset": "quickstart", "num-server-rounds": 3, "local-steps": 32, "batch-size": 2, "seq-len": 16,
            "eval-batches": 2, "threads": 1, "min-clients": 2, "seed": 3, "output-dir": str(out)}


def run_both(tmp_path: Path) -> tuple[Path, Path]:
    """The two runs at once (each in its own FLWR_HOME, SuperLink port and Ray), so that one's waits
    (SuperLink and Ray start, polls) overlap the other's work."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_simulation, APP, flower_env(tmp_path / f"{name}-env"), num_supernodes=2,
                               run_config=run_config(tmp_path / name), timeout=300, check=True,
                               log_path=tmp_path / f"{name}.log") for name in ("first", "second")]
        for future in futures:
            future.result()
    return tmp_path / "first", tmp_path / "second"


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]


def without_wall_clock(recs: list[dict]) -> list[dict]:
    for rec in recs:
        timing = {k for k in rec if k.endswith("_seconds")}
        assert timing <= set(WALL_CLOCK), f"unlisted timing fields {sorted(timing - set(WALL_CLOCK))}"
    return [{k: v for k, v in rec.items() if k not in WALL_CLOCK} for rec in recs]


#: Checkpoint entries that legitimately differ between the two runs: the server process's global
#: numpy and Python RNG states, which nothing in a round draws from and which no code seeds (they
#: start from OS entropy in every process). The torch generator (`rng/torch`) must match.
UNSEEDED_RNG = ("rng/numpy", "rng/python")


def assert_tensors_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str,
                             skip: tuple[str, ...] = ()) -> None:
    assert sorted(a) == sorted(b), what
    for k in sorted(set(a) - set(skip)):
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max |Δ| {(a[k].double() - b[k].double()).abs().max()})"


@pytest.mark.extended
def test_same_seed_and_config_give_bit_identical_runs(tmp_path):
    first, second = run_both(tmp_path)

    a, b = records(first), records(second)
    assert [r["round"] for r in a] == [0, 1, 2, 3]
    assert [r.get("step", 0) for r in a] == [0, 32, 64, 96]  # local-steps=32 won over the preset's 16
    assert a[1]["tokens"] == 2 * 32 * 2 * 16
    assert all(r["clients_ok"] == 2 and r["clients_dropped"] == 0 for r in a[1:])
    assert all(isinstance(r[k], float) for r in a for k in ("round_seconds", "elapsed_seconds") if k in r)
    assert without_wall_clock(a) == without_wall_clock(b)  # val_loss, train_loss, tokens, bytes, ...
    assert {"val_loss", "train_loss", "tokens", "cum_bytes_per_client"} <= set(a[-1])

    (ta, ma), (tb, mb) = load_checkpoint(first / "checkpoints"), load_checkpoint(second / "checkpoints")
    assert ma["round"] == mb["round"] == 3
    assert any(k.startswith("proj/") for k in ta) and any(k.startswith("moment/") for k in ta)
    assert "rng/torch" in ta
    assert_tensors_identical(ta, tb, "server checkpoint", skip=UNSEEDED_RNG)
    for key in ("model_id", "variant", "tokens", "cum_bytes"):
        assert ma[key] == mb[key], key
    assert without_wall_clock(ma["history"]) == without_wall_clock(mb["history"])

    for partition in (0, 1):
        (ca, cma), (cb, cmb) = (load_checkpoint(out / "client_state" / f"partition_{partition}") for out in (first, second))
        assert cma["round"] == cmb["round"] == 3
        assert_tensors_identical(ca, cb, f"client state of partition {partition}")
