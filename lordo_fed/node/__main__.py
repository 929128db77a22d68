"""`python -m lordo_fed.node --listen unix:///path/node.sock`: run a node worker until SIGTERM/SIGINT.

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

from lordo_fed.node.runtime import wait_for_saves
from lordo_fed.node.service import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lordo_fed.node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True,
                        help="unix:///path/to/socket (or 127.0.0.1:PORT): where this node's ClientApp reaches it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.listen.startswith("unix:"):
        path = args.listen.removeprefix("unix://").removeprefix("unix:")
        if os.path.exists(path):
            os.unlink(path)  # a socket left by a worker that was killed
        os.umask(0o077)  # the socket: this user only (a job carries capability tokens)
    try:
        server = serve(args.listen)
    except (OSError, ValueError) as err:
        print(f"node worker: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"node worker: listening on {args.listen} (pid {os.getpid()})", flush=True)
    stop.wait()
    server.stop(grace=5).wait()
    wait_for_saves()
    return 0


if __name__ == "__main__":
    sys.exit(main())
