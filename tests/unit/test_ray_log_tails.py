"""A failed simulation's diagnosis: the tails of Ray's own logs (harness.flower.ray_log_tails; they are
removed with the short RAY_TMPDIR at exit), how far each Ray session started (ray_sessions), and what the
machine did during the run (harness.machine), so a Ray node that never started names why."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_each_session_says_how_far_ray_started(tmp_path):
    """A GCS that never wrote a line nor its port file (CI: 'Timed out waiting for file .../gcs_server_port_...')
    reads as 0 lines and no gcs_server port file; a raylet that never started as absent."""
    from harness.flower import ray_sessions

    first = tmp_path / "ray" / "session_2026-01-01_00-00-01_1"
    (first / "logs").mkdir(parents=True)
    (first / "logs" / "gcs_server.out").write_text("")
    (first / "logs" / "gcs_server.err").write_text("")
    second = tmp_path / "ray" / "session_2026-01-01_00-00-02_2"
    (second / "logs").mkdir(parents=True)
    (second / "logs" / "gcs_server.out").write_text("a\nb\n")
    (second / "logs" / "raylet.out").write_text("c\n")
    for name in ("gcs_server", "metrics_agent"):
        (second / f"{name}_port_{'ab12' * 14}").write_text("4242")
    first_line, second_line = ray_sessions(str(tmp_path)).splitlines()
    assert "session_2026-01-01_00-00-01_1" in first_line and "session_2026-01-01_00-00-02_2" in second_line
    assert "gcs_server.out 0, gcs_server.err 0" in first_line and "raylet.out absent" in first_line
    assert first_line.endswith("port files: none")
    assert "gcs_server.out 2" in second_line and "raylet.out 1" in second_line
    assert second_line.endswith("port files: gcs_server, metrics_agent")
    assert ray_sessions(None) == "" and ray_sessions(str(tmp_path / "nothing")) == ""


def test_a_failures_message_keeps_the_end_of_the_output_and_of_the_diagnosis():
    from harness.flower import DIAGNOSIS_MARK, FlowerRunError

    output = "x" * 9000 + "RuntimeError: Timed out waiting for file gcs_server_port\n"
    diagnosis = "tails\n" * 2000 + "machine over the run's 40.0 s: wall clock stepped +31.0 s\n"
    text = str(FlowerRunError(1, ["flwr", "run"], output=output + DIAGNOSIS_MARK + diagnosis))
    assert "Timed out waiting for file gcs_server_port" in text and "wall clock stepped +31.0 s" in text
    assert len(text) < 8500
    assert "=== diagnosis" not in str(FlowerRunError(1, ["flwr"], output="only the run's output"))


def test_the_machine_report_reads_what_changed_since_the_reading_before(monkeypatch):
    """A clock step (the wall clock ran 30 s ahead of the monotonic one), stalls and OOM kills since the
    reading before, and the kernel's lines stamped since it, against counters given by hand."""
    import dataclasses
    import subprocess

    from harness import machine

    now = machine.Machine.now()
    before = dataclasses.replace(now, wall=now.wall - 30.0, uptime=100.0,
                                 psi={k: v - 2.5 for k, v in now.psi.items()},
                                 vmstat={k: v - 1 for k, v in now.vmstat.items()})
    dmesg = "[   99.500000] before the run\n[  100.250000] random: crng reseeded due to virtual machine fork\n"
    monkeypatch.setattr(machine.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=dmesg, stderr=""))
    report = machine.machine_report(before)
    step = float(report.split("wall clock stepped ")[1].split(" s")[0])
    assert 29.5 < step < 30.5, report
    if "cpu some" in now.psi:  # a kernel with pressure-stall information (the machine may stall more meanwhile)
        stalled = float(re.search(r"cpu some (\d+\.\d) s", report).group(1))
        assert 2.5 <= stalled < 3.5, report
    if "oom_kill" in now.vmstat:
        assert int(re.search(r"processes killed for memory (\d+)", report).group(1)) >= 1, report
    assert "virtual machine fork" in report and "before the run" not in report
    assert "free disk" in report and "machine now:" in report

    monkeypatch.setattr(machine.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout="", stderr="denied"))
    assert "kernel log during the run: not readable here" in machine.machine_report(now)


def test_the_watchdog_sees_a_process_that_was_not_run(tmp_path):
    """A process stopped for 2.5 s (SIGSTOP, SIGCONT: what a paused VM is to everything in it) finds one gap
    of about that length in its watchdog's schedule, and none before the stop."""
    import json
    import signal
    import subprocess
    import sys
    import time

    code = ("import json, sys, time\n"
            "from harness.machine import Watchdog\n"
            "w = Watchdog(period=0.05, threshold=1.0)\n"
            "time.sleep(0.3); print(json.dumps(w.gaps_since(0.0)), flush=True)\n"
            "sys.stdin.readline()\n"
            "time.sleep(0.2); print(json.dumps(w.gaps_since(0.0)), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        assert json.loads(proc.stdout.readline()) == []
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("\n")
        proc.stdin.flush()
        gaps = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)
    assert len(gaps) == 1 and 2.3 < gaps[0][1] < 6.0, gaps
