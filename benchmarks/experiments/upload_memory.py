"""Diagnostic (not a product benchmark): the data-plane server's peak RSS while M nodes upload at
once, at library level (a DataPlaneServer in this process, M client processes), to see what grows
with the number of concurrent uploads beyond the replies the memory budget keeps in RAM.

    python benchmarks/experiments/upload_memory.py 8 200                      # M=8, 200 MB each
    MALLOC_ARENA_MAX=1 python benchmarks/experiments/upload_memory.py 8 200   # one malloc arena
    GRPC_OPTIONS=grpc.http2.bdp_probe=0 python benchmarks/experiments/upload_memory.py 8 200

Prints one JSON line: peak RSS before and after the uploads, and how many replies the budget
kept in RAM (the rest spilled to the spool). Results in docs/results.md, section 9.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def client(size: int, ticket_hex: str, node: int) -> None:
    from lordo_fed.transport.client import parse_ticket, upload

    upload(parse_ticket(bytes.fromhex(ticket_hex)), node, os.urandom(size), timeout=600)


def server(m: int, size: int, budget: int) -> dict:
    import lordo_fed.transport.server as dp
    from lordo_fed.metrics import peak_rss_bytes

    extra = [(k, int(v)) for k, v in (kv.split("=") for kv in os.environ.get("GRPC_OPTIONS", "").split(",") if kv)]
    if extra:
        base_options = dp.channel_options
        dp.channel_options = lambda: base_options() + extra
    with tempfile.TemporaryDirectory() as tmp, dp.DataPlaneServer(tmp, memory_budget=budget) as plane:
        tickets = plane.publish(1, b"state", range(1, m + 1), ttl=600, max_upload=size)
        before = peak_rss_bytes()
        procs = [subprocess.Popen([sys.executable, __file__, "--client", str(size), tickets[n].SerializeToString().hex(),
                                   str(n)]) for n in range(1, m + 1)]
        if any(p.wait() for p in procs):
            raise RuntimeError("an upload failed")
        uploads = [plane.upload(n, 1) for n in range(1, m + 1)]
        return {"M": m, "size_mb": size / 1e6, "budget_mb": budget / 1e6, "grpc_options": extra,
                "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"), "peak_before_mb": round(before / 1e6),
                "peak_after_mb": round(peak_rss_bytes() / 1e6), "in_ram": sum(u.data is not None for u in uploads),
                "spilled": sum(u.path is not None for u in uploads)}


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        client(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        print(json.dumps(server(int(sys.argv[1]), int(float(sys.argv[2]) * 1e6),
                                int(sys.argv[3]) << 20 if len(sys.argv) > 3 else 1 << 30)))
