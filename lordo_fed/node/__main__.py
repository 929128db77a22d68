"""`python -m lordo_fed.node --listen unix:///path/node.sock`: run a node worker until SIGTERM/SIGINT.

Under `torchrun --nproc-per-node N` the node worker is N ranks training as one worker (their
gradients averaged every step, lordo_fed/node/ranks.py): rank 0 listens and speaks for the node.

Point the node's SuperNode at it with the node-config key `node-worker` (scripts/start_supernodes.sh
--node-workers does both); docs/deployment.md, "Node workers".
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback

from lordo_fed.node.lifeline import die_with_parent, started_by_torchrun

if __name__ == "__main__" and started_by_torchrun():
    # Before torch's import (seconds): a rank must not outlive the torchrun agent that started it
    # in a session of its own, even one SIGKILLed before the rank got this far.
    die_with_parent()

import torch.distributed as dist  # noqa: E402 (after the parent-death signal: these import torch)

from lordo_fed.node import runtime  # noqa: E402
from lordo_fed.node.ranks import WRAPPERS, LocalRanks, exit_rank  # noqa: E402
from lordo_fed.node.runtime import wait_for_early, wait_for_saves  # noqa: E402
from lordo_fed.node.service import follow, serve, stop_followers  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lordo_fed.node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True,
                        help="unix:///path/to/socket (or 127.0.0.1:PORT): where this node's ClientApp reaches it")
    parser.add_argument("--intra-node", default="ddp", choices=WRAPPERS,
                        help="how a node of several ranks (torchrun --nproc-per-node N) shares its gradients")
    parser.add_argument("--rank-timeout", type=float, default=1800.0,
                        help="seconds a rank waits in a collective for the others before the node's job fails")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ranks = LocalRanks.from_environment(args.intra_node, args.rank_timeout)
    if ranks is not None and not ranks.lead:
        runtime.LOCAL_RANKS = ranks
        print(f"node worker: rank {ranks.rank} of {ranks.world} follows the lead (pid {os.getpid()})", flush=True)
        follow(ranks)
        wait_for_early()
        wait_for_saves()
        return 0
    if args.listen.startswith("unix:"):
        path = args.listen.removeprefix("unix://").removeprefix("unix:")
        if os.path.exists(path):
            os.unlink(path)  # a socket left by a worker that was killed
        os.umask(0o077)  # the socket: this user only (a job carries capability tokens)
    try:
        server = serve(args.listen, ranks=ranks)
    except (OSError, ValueError) as err:
        print(f"node worker: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    width = "" if ranks is None else f", lead of {ranks.world} ranks, {ranks.wrapper}"
    print(f"node worker: listening on {args.listen} (pid {os.getpid()}{width})", flush=True)
    stop.wait()
    server.stop(grace=5).wait()
    wait_for_early()
    wait_for_saves()
    stop_followers(ranks)
    return 0


def run() -> int:
    """`main()`; a rank of a node of several ranks leaves by `exit_rank`, also when main() raised
    (a follower whose lead died): gloo's threads outlive the group, and the interpreter's
    finalization can abort the process under them (lordo_fed/node/ranks.py)."""
    try:
        code = main()
    except Exception:
        if not dist.is_initialized():
            raise
        traceback.print_exc()
        code = 1
    if dist.is_initialized():
        exit_rank(code)
    return code


if __name__ == "__main__":
    sys.exit(run())
