"""benchmarks/wan_rounds.py --hetero's analysis, on hand-made runs: the virtual clock's prediction
for the speeds a deployment showed, each case against the synchronous run, the run configs."""

from __future__ import annotations

import pytest

from benchmarks.wan_rounds import HETERO_SCENARIOS, hetero_config, nominal_seconds, summarise_hetero, virtual_staleness


def test_the_virtual_clock_predicts_staleness_from_the_measured_speeds():
    """Node 0 pushed twice and node 1 four times in 12 s: 6 s and 3 s a round. By hand, six rounds:
    t=3 node 1 (s 0); t=6 node 0 (s 1), node 1 (s 1); t=9 node 1 (s 0); t=12 node 0 (s 2), node 1 (s 1)."""
    case = {"elapsed_seconds": 12.0, "pushes_by_worker": {"0": 2, "1": 4}}
    got = virtual_staleness(case, nodes=2)
    assert got["seconds_per_round"] == [6.0, 3.0]
    assert got["staleness"] == {"0": 2, "1": 3, "2": 1}
    assert got["pushes_by_worker"] == {"0": 2, "1": 4}


def test_the_nominal_speeds_come_from_the_scenario_not_from_the_slow_nodes_pushes():
    """Nodes 1-3 pushed 3 times each in 30 s (10 s a round); node 0 once, which `measured_seconds`
    would read as 30 s a round. `link`: a push moves 5 MB down and 7.5 MB up, 12.5 MB = 10 s at
    10 Mbit/s and 0.1 s at 1 Gbit/s, so node 0's round is 10 + 10 - 0.1 s. `compute`: 4 x 10 s.
    On [40, 10, 10, 10] with the budget of 10 rounds, by hand: at t = 10, 20 and 30 nodes 1, 2, 3
    push in turn (staleness 0, 1, 2 at t = 10, then 2 each: two versions since their pulls), the
    last three of them with no round left to start; node 0 at t = 40, 9 versions after its pull."""
    case = {"elapsed_seconds": 30.0, "pushes_by_worker": {"0": 1, "1": 3, "2": 3, "3": 3},
            "bytes_sent_per_client": 5_000_000, "bytes_received_per_client": 7_500_000}
    assert nominal_seconds(case, HETERO_SCENARIOS["link"]) == pytest.approx([19.9, 10.0, 10.0, 10.0])
    seconds = nominal_seconds(case, HETERO_SCENARIOS["compute"])
    assert seconds == pytest.approx([40.0, 10.0, 10.0, 10.0])
    got = virtual_staleness(case, 4, seconds)
    assert got["staleness"] == {"0": 1, "1": 1, "2": 7, "9": 1}
    assert got["pushes_by_worker"] == {"0": 1, "1": 3, "2": 3, "3": 3}
    assert virtual_staleness(case, 4)["seconds_per_round"] == [30.0, 10.0, 10.0, 10.0]  # the measured speeds


def test_each_case_against_the_synchronous_run():
    curve = lambda *pts: [{"elapsed_seconds": t, "tokens": 0, "val_loss": v} for t, v in pts]  # noqa: E731
    result = {"cases": {
        "synchronous": {"curve": curve((0, 5.0), (50, 3.0), (100, 2.0)), "elapsed_seconds": 100.0,
                        "final_val_loss": 2.0, "tokens": 10, "tokens_per_second": 0.1},
        "async": {"curve": curve((0, 5.0), (30, 2.5), (60, 1.98), (70, 1.97)), "elapsed_seconds": 70.0,
                  "final_val_loss": 1.97, "tokens": 10, "tokens_per_second": 0.14},
        "slow": {"curve": curve((0, 5.0), (80, 2.1)), "elapsed_seconds": 80.0, "final_val_loss": 2.1,
                 "tokens": 10, "tokens_per_second": 0.12},
    }}
    summarise_hetero(result)
    cases = result["cases"]
    assert result["reference"] == "synchronous" and result["equal_clock_seconds"] == 70.0
    assert cases["async"]["time_ratio_to_reference"] == pytest.approx(0.6)  # 2.0 reached at 60 s of 100
    assert cases["async"]["final_loss_vs_reference_pct"] == pytest.approx(-1.5)
    assert cases["slow"]["time_ratio_to_reference"] is None  # never reached 2.0
    assert cases["synchronous"]["val_loss_at_equal_clock"] == 3.0 and cases["async"]["val_loss_at_equal_clock"] == 1.97


def test_asynchronous_cases_get_one_over_root_m_unless_they_say():
    link = HETERO_SCENARIOS["link"]
    assert hetero_config("heloco", link, 8, {})["async-weight"] == 0.5
    assert "async-weight" not in hetero_config("synchronous", link, 8, {})
    cfg = hetero_config("heloco-lordo-staleness", HETERO_SCENARIOS["link3"], 6, {"partition": "by_source"})
    assert cfg["async-weight"] == 0.577 and cfg["num-server-rounds"] == 6 and cfg["min-clients"] == 3
    assert cfg["partition"] == "by_source" and cfg["async-staleness-exponent"] == 0.5


def test_async_rounds_lengthen_only_the_asynchronous_cases():
    """--async-rounds: asynchronous cases train that many rounds' tokens, synchronous ones --rounds."""
    link = HETERO_SCENARIOS["link"]
    assert hetero_config("heloco-lordo-grace", link, 6, {}, async_rounds=9)["num-server-rounds"] == 9
    assert hetero_config("synchronous", link, 6, {}, async_rounds=9)["num-server-rounds"] == 6
    assert hetero_config("heloco-lordo-grace", link, 6, {})["num-server-rounds"] == 6


def test_a_longer_run_is_read_at_the_reference_tokens():
    """A run past the synchronous run's tokens: its loss at the last evaluation within them."""
    pts = lambda *p: [{"elapsed_seconds": t, "tokens": n, "val_loss": v} for t, n, v in p]  # noqa: E731
    result = {"cases": {
        "synchronous": {"curve": pts((50, 5, 3.0), (100, 10, 2.0)), "elapsed_seconds": 100.0,
                        "final_val_loss": 2.0, "tokens": 10, "tokens_per_second": 0.1},
        "long": {"curve": pts((20, 4, 3.5), (40, 9, 2.4), (45, 11, 2.1), (60, 15, 1.9)), "elapsed_seconds": 60.0,
                 "final_val_loss": 1.9, "tokens": 15, "tokens_per_second": 0.25},
    }}
    summarise_hetero(result)
    long = result["cases"]["long"]
    assert long["val_loss_at_reference_tokens"] == 2.4  # 9 tokens: the last evaluation within 10
    assert long["time_ratio_to_reference"] == pytest.approx(0.6)  # 1.9 <= 2.0 first at 60 s
    assert result["cases"]["synchronous"]["val_loss_at_reference_tokens"] == 2.0


def test_the_virtual_twin_runs_the_cases_own_settings_in_virtual_order():
    """`--virtual`: the app's settings reach the trainer (tokens = rounds x K x batch x seq x nodes), a
    synchronous case does not depend on the speeds (it waits for the slowest node: only its virtual
    seconds stretch), and with node 0 three times slower node 1 pushes three rounds to node 0's one. By
    hand, K = 2, a budget of four rounds: node 1 at t = 2 and 4 (staleness 0 each); at t = 6 node 0 (pulled
    version 0, now 2) before node 1 (same time, higher id; pulled version 2, now 3)."""
    from benchmarks.wan_rounds import run_virtual_twin

    base = {"preset": "quickstart", "local-steps": 2, "batch-size": 2, "seq-len": 16, "eval-batches": 1,
            "num-server-rounds": 2, "min-clients": 2, "warmup-steps": 1}
    sync_even = run_virtual_twin("s", {**base, "variant": "lordo_global"}, "1,1")
    sync_slow = run_virtual_twin("s", {**base, "variant": "lordo_global"}, "3,1")
    assert sync_even["tokens"] == sync_slow["tokens"] == 2 * 2 * 2 * 16 * 2
    assert sync_even["final_val_loss"] == sync_slow["final_val_loss"]
    assert sync_slow["elapsed_seconds"] == 3 * sync_even["elapsed_seconds"] == 3 * 4
    slow = run_virtual_twin("a", {**base, "variant": "async_lordo", "async-weight": 0.7}, "3,1")
    assert slow["tokens"] == sync_even["tokens"] and slow["pushes_by_worker"] == {"0": 1, "1": 3}
    assert slow["staleness"] == {"0": 2, "2": 1, "1": 1} and slow["elapsed_seconds"] == 6
