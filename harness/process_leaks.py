"""Every test ends every process it started: a check at the end of the pytest session.

A pytest plugin (tests/conftest.py imports its hooks). At the start of the session it puts a
fresh `LORDO_FED_TEST_SESSION` id in `os.environ`, and around every test `LORDO_FED_TEST=<node
id>`, so every process the tests start, and everything those start in turn (Flower's SuperExecs
and ClientApps, torchrun's ranks, re-parented or in sessions of their own), carries both in its
initial environment (/proc/<pid>/environ). At the end of the session (after the
session fixtures' teardown) any live process with this session's id, other than pytest itself
and its ancestors (a zombie is dead), gets `LORDO_FED_LEAK_GRACE` seconds (10) to exit; what is
still alive then fails the session: each one is printed with its pid, its command line and the
test that started it, and then SIGKILLed, so that a failed run leaves nothing behind either.
multiprocessing's resource tracker, pytest's own helper, is stopped before the check.

Every spawn in tests/ and benchmarks/ passes `os.environ` on (`env=dict(os.environ, ...)`,
`flower_env`; benchmarks/codec_memory.py's `env={...}` goes through `common.run_child`, which
adds os.environ; `git grep -n "env=" tests/ benchmarks/`), as do the product's
(lordo_fed.wan.emulate, torchrun, Flower's SuperExec): a process started without it would escape
this check.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from harness.processes import find_pids, proc_cmdline, proc_environ

SESSION_VAR = "LORDO_FED_TEST_SESSION"
"""This pytest session's id, in the environment of every process it starts."""
TEST_VAR = "LORDO_FED_TEST"
"""The node id of the test that was running when a process was started."""
GRACE_VAR = "LORDO_FED_LEAK_GRACE"
"""Seconds the processes still alive at the end of the session get to exit (default 10)."""


def leaked(session_id: str) -> dict[int, str]:
    """Live processes started by session `session_id` (pid -> the test that started it); not this
    process or its ancestors, and zombies count as gone (harness.processes.find_pids)."""
    return {pid: proc_environ(pid).get(TEST_VAR, "?") for pid in find_pids({SESSION_VAR: session_id})}


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SESSION_KEY] = os.environ[SESSION_VAR] = uuid.uuid4().hex


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    os.environ[TEST_VAR] = item.nodeid  # setup, call and teardown: what they start names this test
    try:
        return (yield)
    finally:
        os.environ.pop(TEST_VAR, None)


def _stop_resource_tracker() -> None:
    """multiprocessing's resource tracker: the first spawn (mp.spawn, torch.multiprocessing)
    starts it for pytest's own process, to outlive every test and end with pytest. No test owns
    it: the session stops it before the check."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # CPython 3.8+
    if stop is not None:
        try:
            stop()
        except Exception:  # noqa: BLE001 (then the check reports it)
            pass


@pytest.hookimpl(trylast=True)  # after the runner's own, which tears the session fixtures down
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session_id = session.config.stash.get(_SESSION_KEY, None)
    if session_id is None:
        return
    _stop_resource_tracker()
    deadline = time.monotonic() + float(os.environ.get(GRACE_VAR, "10"))
    while (alive := leaked(session_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not alive:
        return
    cmdlines = {pid: " ".join(proc_cmdline(pid)) for pid in alive}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(alive)} process(es) started by the tests are still running (killed now):"]
    lines += [f"  pid {pid} started by {test}: {cmdlines[pid][:300]}" for pid, test in sorted(alive.items())]
    if reporter is not None:
        reporter.write_line("")  # after the progress line
        reporter.write_sep("=", "processes left running", red=True)
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join(lines))
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SESSION_KEY = pytest.StashKey[str]()
