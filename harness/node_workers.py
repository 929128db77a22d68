"""Node workers (`python -m lordo_fed.node`, lordo_fed/node/) for tests and benchmarks: a
long-lived process per node that a SuperNode's ClientApp hands its rounds to over a unix socket,
started and stopped here with every process it starts (torchrun's ranks included), because those
run in sessions of their own and would outlive a plain kill (harness/processes.py finds them by
their OWNER_VAR marker).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from harness.processes import OWNER_VAR, checkout_env, find_pids, stop_process, tail


def start_node_worker(sock: str | os.PathLike, log_path: str | os.PathLike, timeout: float = 60.0,
                      ranks: int = 1, intra_node: str = "ddp") -> subprocess.Popen:
    """A node worker (`python -m lordo_fed.node`) listening on the unix socket `sock`, in its own
    session (stop it with `stop_process`), started once its socket exists; its output goes to
    `log_path`. Give the node the node-config key `node-worker = "unix://<sock>"`. With `ranks` > 1,
    a node of that many ranks under torchrun (gloo on this CPU), sharing gradients by `intra_node`.

    Every process of the worker carries OWNER_VAR=<the returned Popen's `owner`> (torchrun starts
    each rank in a session of its own, so its process group does not reach them: `node_worker_ranks`
    finds them by it)."""
    sock = Path(sock)
    root = Path(__file__).resolve().parents[1]
    owner = f"node-worker-{uuid.uuid4().hex}"
    env = checkout_env(**{OWNER_VAR: owner})
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(ranks)]
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()  # a killed worker's socket: its existence would not say that the new one listens
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*launcher, "-m", "lordo_fed.node", "--listen", f"unix://{sock}",
                                 "--intra-node", intra_node], cwd=root,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.owner, proc.ranks = owner, ranks  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if proc.poll() is not None:
            stop_process(proc)  # ranks that outlived their torchrun
            raise RuntimeError(f"node worker exited ({proc.returncode}):\n{tail(log_path)}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise TimeoutError(f"node worker did not listen on {sock} within {timeout:.0f}s:\n{tail(log_path)}")
        time.sleep(0.1)
    return proc


def node_worker_ranks(proc: subprocess.Popen) -> set[int]:
    """The live rank processes of a node worker that `start_node_worker` started, wherever they
    were re-parented (found by its OWNER_VAR; torchrun itself is not one; a node of one rank is
    the worker process itself)."""
    found = find_pids({OWNER_VAR: proc.owner}, ("lordo_fed.node",))
    return found - {proc.pid} if proc.ranks > 1 else found
