"""harness.flower.ray_log_tails: a failed simulation's error carries the tails of Ray's own logs
(they are removed with the short RAY_TMPDIR at exit), so a raylet that never registered names why."""

from __future__ import annotations

from harness.flower import ray_log_tails


def test_the_tails_of_each_sessions_logs_are_kept_in_order(tmp_path):
    for session, lines in (("session_2026-01-01_00-00-01_1", 3), ("session_2026-01-01_00-00-02_2", 40)):
        logs = tmp_path / "ray" / session / "logs"
        logs.mkdir(parents=True)
        (logs / "raylet.out").write_text("".join(f"{session} line {i}\n" for i in range(lines)))
    (tmp_path / "ray" / "session_latest").mkdir()  # Ray's link to the newest session: not read twice
    text = ray_log_tails(str(tmp_path), lines=5)
    assert text.count("--- session_") == 2 and text.index("_1/raylet.out") < text.index("_2/raylet.out")
    assert "session_2026-01-01_00-00-01_1 line 0" in text  # a short log whole
    assert "_2 line 35" in text and "_2 line 34" not in text  # a long one's last 5 lines


def test_nothing_when_ray_never_started(tmp_path):
    assert ray_log_tails(str(tmp_path)) == "" and ray_log_tails(None) == ""
