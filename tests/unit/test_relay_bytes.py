"""The relay's bytes grow with M (benchmarks/compression.py `bytes_table`, `--relay-m`): each node's
state carries the other M − 1 workers' replies, so every worker more adds one reply's bytes down and
nothing up (docs/results.md, section 12, part nine)."""

from __future__ import annotations

from benchmarks.compression import bytes_table


def test_each_worker_more_adds_one_reply_down_and_nothing_up():
    rows = {m: bytes_table(["16m"], [32], [1], ["topk1bit-relay"], ("lean",), relay_m=m)[0] for m in (2, 4, 8)}
    assert [rows[m]["M"] for m in (2, 4, 8)] == [2, 4, 8]
    up = rows[2]["up_bytes_per_round"]
    assert rows[4]["up_bytes_per_round"] == up == rows[8]["up_bytes_per_round"]
    per_reply = (rows[4]["down_bytes_per_round"] - rows[2]["down_bytes_per_round"]) / 2
    assert rows[8]["down_bytes_per_round"] - rows[4]["down_bytes_per_round"] == 4 * per_reply
    # a forwarded reply is the uplink's Δ without its metrics: about the uplink's size, not more
    assert 0.9 * up < per_reply <= up
    assert rows[8]["reduction_vs_ddp_fp32"] < rows[4]["reduction_vs_ddp_fp32"] < rows[2]["reduction_vs_ddp_fp32"]
