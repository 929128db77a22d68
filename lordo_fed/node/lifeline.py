"""A rank of a node worker dies with the torchrun agent that started it.

torchrun starts every rank in a session of its own (`start_new_session=True` in
torch.distributed.elastic's subprocess handler), so a signal to the agent's process group, or
the agent's own death (SIGKILL, OOM killer, a crash), does not reach the ranks: they would go on
holding the node's device, its socket and the rank timeout's worth of collectives, re-parented to
init. Each rank therefore watches its parent (docs/deployment.md, "Nodes of several GPUs"):

- on Linux the kernel SIGKILLs it when the parent dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): no
  thread to schedule, so it holds however loaded the machine is (torchrun starts the ranks from
  its main thread, whose exit is the one that counts);
- the parent may have died before that call, in the interpreter's first milliseconds: the parent
  the rank sees after the call is compared with the one it saw before it (a re-parented process
  has another one);
- where prctl is not available (another OS), a daemon thread polls the parent instead.

A follower whose lead rank dies (the agent still alive) leaves through the collective it waits
in: gloo raises as soon as the lead's connection closes, long before the rank timeout (tests/
test_ranks.py), and torchrun stops the other ranks when one fails.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
"""prctl option: the signal this process gets when the thread that started it exits (linux/prctl.h)."""

TORCHRUN_VAR = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in the environment of every rank it starts (torch.distributed.elastic)."""


def started_by_torchrun() -> bool:
    """Whether this process is a rank that torchrun's agent started (its parent is the agent)."""
    return TORCHRUN_VAR in os.environ


def _set_parent_death_signal(sig: int) -> bool:
    """`prctl(PR_SET_PDEATHSIG, sig)`; False where there is no prctl (not Linux) or it failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned(parent: int) -> None:
    print(f"node worker rank (pid {os.getpid()}): its torchrun agent (pid {parent}) is gone; exiting",
          file=sys.stderr, flush=True)
    os._exit(1)  # no cleanup: the agent is gone, and a rank that waits in a collective would not return


def die_with_parent(poll_seconds: float = 0.5) -> int:
    """Make this process die when its parent dies (SIGKILL, as the parent's own death may have
    been); exit at once if the parent is already gone. Returns the parent's pid.

    Call it first thing in the process: the parent is read before the death signal is set, and a
    parent that died before that read goes unnoticed (the process would see init, or a subreaper,
    as the parent it watches; pid 1 itself is no sign of that: in a container torchrun may be
    init)."""
    parent = os.getppid()
    armed = _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # re-parented: the parent died before the signal was armed
        _orphaned(parent)
    if not armed:
        def watch() -> None:
            while True:
                time.sleep(poll_seconds)
                if os.getppid() != parent:
                    _orphaned(parent)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return parent
