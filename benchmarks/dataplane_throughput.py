"""Throughput of the gRPC data plane (lordo_fed.transport) in a real 2-node deployment on
127.0.0.1, end to end including encode/decode, side by side with a bare grpcio stream and with
the Flower path, all in one run (this machine is shared and noisy: compare the ratios).

Variants (each moves `size` MB down to each of 2 nodes and `size` MB up from each):

- `bare grpc` / `bare grpc TLS`: a minimal grpcio server process (sync server, generic handlers,
  raw bytes: no protobuf, no hashing, no codec; 4 MiB messages prepared before timing, the data
  plane's message limits) and 2 concurrent client processes, each downloading `size` MB (one
  unary-stream call) and then uploading `size` MB (one stream-unary call). Seconds: the go signal
  -> both clients done; MB/s = bytes moved / seconds. TLS: grpc.ssl_server_credentials with the
  SuperLink's server.pem/server.key, clients verify with ca.crt (scripts/generate_certs.py).
  Checked after the timed part: each side's sha256 of what it received against the sender's.
- `dp transport only` / `... TLS`: the same processes and bytes through lordo_fed.transport (a
  DataPlaneServer serving prepared bytes, clients calling transport.client.download / upload
  with their tickets): the data plane's own cost (protobuf chunks, the default xxh3 checksum both
  ends, tokens, the server's upload buffers), without Flower and without the codec.
- `dp transport, sha256` / `... sha256 TLS`: the same with `checksum="sha256"` (the
  `data-plane-checksum` option, and what every payload carried before xxh3 became the default):
  what a cryptographic digest of each byte, by its sender and its receiver, costs against xxh3.
- `whole path, announced` / `... TLS`: the whole payload path without Flower, as a round runs
  when its tickets were announced before its state existed (`DataPlaneServer.announce`: node
  workers, overlapped rounds), so that no Flower message sits between the server's encode and its
  decode: the nodes (processes started before the timed part, their Δ drawn) wait on their
  announced downloads; on 'go' the server encodes one random fp32 GlobalState and publishes it
  while it is encoded (`StreamingEncode` + `DataPlaneServer.publish_encoding`, as
  server/courier.py `publish_announced`: the downloads start on its first bytes, its digest follows
  the data; `--publish-whole` encodes it whole first and publishes it, as before);
  each node downloads and decodes it in place (as `run_job`) and uploads a WorkerUpdate of the same
  size while it is encoded (`StreamingEncode`, as lordo_fed.node.session `data_plane_round`); the
  server waits for both uploads and decodes them in place (as `Courier.screened`). Seconds: 'go' ->
  the server's last decode. Checked after the timed part: each side's decoded tensor against the
  sender's draw.
- `data plane` / `data plane TLS`: a minimal Flower app (harness/apps/dataplane_bench/, copied to a
  temporary directory) on a real SuperLink + 2 SuperNodes (harness/deployment.Deployment; with
  tls_dir for TLS). The ServerApp hosts a DataPlaneServer and, per exchange, encodes one random
  fp32 GlobalState (encode_global_state, once for all nodes), publishes it (digest + a ticket per
  node) and sends each node a train message carrying its ticket (as server/courier.py
  `Courier.outgoing`); the
  ClientApp downloads and decodes it, encodes a random fp32 WorkerUpdate of the same size,
  uploads it and replies with its digest (as client/app.py `receive_state` / `send_reply`); the
  server takes both uploads, checks the digest each reply vouches for (as `Courier._upload_of`) and
  decodes them in place (as `Courier.screened`; they are discarded once checked). The node's random Δ is drawn before its timed part; the draw's seconds are
  subtracted from the exchange.
- `flower`: the same app with the payloads inside the messages (lordo_fed.app.records.payload_record /
  payload_bytes), same plaintext deployment, same exchanges.

`server_decode`: the server's decoding of one reply of `size` MB held in the data plane's memory,
in this process: as `Courier.screened` does it now (decoded once, in place: the fp32 tensors are views
of the upload's buffer, kept for the aggregator) against before (decoded with a copy on arrival for
screening and again when the aggregator loads it), median of the repeats, both checked equal to
what was encoded.

Each big exchange is paired with a tiny one (~1 KB, same path): `effective` throughput = bytes
moved (2 nodes x 2 directions) / (big exchange - tiny exchange), i.e. with Flower's fixed control
latency (message polls, ClientApp process start) subtracted, encode/decode on both sides
included; `end_to_end` = bytes / big exchange (nothing subtracted). The exchange is timed by the
ServerApp from the start of its encode to the last reply decoded. `path`: the data plane's own
path from timestamps, no Flower control latency and no subtraction (server encode + publish +
the slower node's download, decode, encode, upload + server decode). `ratio` = MB/s / bare grpc
MB/s of the same security mode (median of all bare runs, taken before, between and after the
deployments). The data plane's breakdown comes from timestamps on both sides (time.time(), one
machine): server encode, publish (digest + tickets), push, control down (push -> ClientApp
handler), download, client decode, client encode, upload, control up (handler end -> reply
pulled), server decode (both replies, one after the other); with each step's CPU seconds
(time.process_time of the process doing it): wall >> CPU means it waited for a core. The
Flower-less streams report the CPU seconds of the server and client processes per exchange.

The SuperNodes run with their hard-coded 3 s idle wait capped at 0.1 s (benchmarks/flower_shims.py,
same data path; --stock-supernode to turn off): otherwise up to 3 s of random wait lands on every
exchange, tiny and big alike, and the subtraction is noise.

    python benchmarks/dataplane_throughput.py            # 200 MB, 3 repeats, plaintext + TLS
    python benchmarks/dataplane_throughput.py --quick    # 20 MB, 1 repeat, TLS only for bare grpc (< 90 s)
Writes benchmarks/results/dataplane_throughput.json (or --out). Peak memory: ~5 GB at 200 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
HERE = Path(__file__).resolve()
NODES = 2
BARE_SERVICE = "bench.Bare"

# ============================================================================ bare grpcio baseline


def _random_bytes(seed: int, nbytes: int) -> bytes:
    import numpy as np

    words = np.random.default_rng(seed).random((nbytes + 3) // 4, dtype=np.float32)
    return words.view(np.uint8)[:nbytes].tobytes()


def _cpu() -> float:
    """CPU seconds of this process so far (user + system, all threads: gRPC's included)."""
    t = os.times()
    return t.user + t.system


def _chunked(data: bytes, step: int) -> list[bytes]:
    view = memoryview(data)
    return [bytes(view[o:o + step]) for o in range(0, len(data), step)]


def _bare_server(args: argparse.Namespace) -> int:
    """A bare grpcio server: Download streams the prepared chunks, Upload keeps what arrives,
    Digest (after the timed part) tells a client the sha256 of what it uploaded."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from lordo_fed.transport.server import CHUNK_BYTES, channel_options

    blob = _random_bytes(7, args.bytes)
    chunks = _chunked(blob, CHUNK_BYTES)
    sha = hashlib.sha256(blob).hexdigest()
    del blob
    uploads: dict[str, list[bytes]] = {}

    def download(request, context):
        yield from chunks

    def upload(request_iterator, context):
        client = dict(context.invocation_metadata()).get("client", "")
        got = list(request_iterator)
        uploads[client] = got
        return str(sum(len(c) for c in got)).encode()

    def digest(request, context):
        got = uploads.pop(request.decode(), [])
        h = hashlib.sha256()
        for c in got:
            h.update(c)
        return json.dumps({"bytes": sum(len(c) for c in got), "sha256": h.hexdigest()}).encode()

    handler = grpc.method_handlers_generic_handler(BARE_SERVICE, {
        "Download": grpc.unary_stream_rpc_method_handler(download),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Digest": grpc.unary_unary_rpc_method_handler(digest),
    })
    server = grpc.server(ThreadPoolExecutor(max_workers=8), options=channel_options())
    server.add_generic_rpc_handlers((handler,))
    if args.tls:
        tls = Path(args.tls)
        creds = grpc.ssl_server_credentials([((tls / "server.key").read_bytes(), (tls / "server.pem").read_bytes())])
        port = server.add_secure_port("127.0.0.1:0", creds)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port, "sha256": sha}), flush=True)
    for line in sys.stdin:  # until the parent closes our stdin
        if line.strip() == "cpu":
            print(json.dumps({"cpu_s": _cpu()}), flush=True)
    server.stop(0)
    return 0


def _bare_client(args: argparse.Namespace) -> int:
    """Prepare the upload, connect, say 'ready', wait for 'go', download then upload; report
    timestamps, then check both transfers (outside the timed part)."""
    import grpc

    from lordo_fed.transport.server import CHUNK_BYTES, channel_options

    blob = _random_bytes(100 + args.index, args.bytes)
    chunks = _chunked(blob, CHUNK_BYTES)
    up_sha = hashlib.sha256(blob).hexdigest()
    del blob
    target = f"127.0.0.1:{args.port}"
    if args.tls:
        creds = grpc.ssl_channel_credentials(root_certificates=(Path(args.tls) / "ca.crt").read_bytes())
        channel = grpc.secure_channel(target, creds, options=channel_options())
    else:
        channel = grpc.insecure_channel(target, options=channel_options())
    grpc.channel_ready_future(channel).result(timeout=60)
    down_call = channel.unary_stream(f"/{BARE_SERVICE}/Download")
    up_call = channel.stream_unary(f"/{BARE_SERVICE}/Upload")
    digest_call = channel.unary_unary(f"/{BARE_SERVICE}/Digest")
    client = f"client-{args.index}"
    print("ready", flush=True)
    sys.stdin.readline()
    c0 = _cpu()
    t0 = time.time()
    got = list(down_call(b""))
    t1 = time.time()
    acked = int(up_call(iter(chunks), metadata=(("client", client),)))
    t2 = time.time()
    cpu = _cpu() - c0
    h = hashlib.sha256()
    for c in got:
        h.update(c)
    server_view = json.loads(digest_call(client.encode()))
    channel.close()
    print(json.dumps({
        "t_start": t0, "t_down_end": t1, "t_end": t2, "cpu_s": cpu,
        "down_bytes": sum(len(c) for c in got), "up_bytes": acked,
        "down_sha256_ok": h.hexdigest() == args.sha256,
        "up_sha256_ok": server_view["sha256"] == up_sha and server_view["bytes"] == args.bytes,
    }), flush=True)
    return 0


def _dp_server(args: argparse.Namespace) -> int:
    """The data plane alone (no Flower, no codec): a DataPlaneServer serving prepared random bytes
    to nodes 1..NODES; on 'collect' it reports the verified uploads (their real sha256)."""
    from lordo_fed.transport.server import DataPlaneServer

    tls = None
    if args.tls:
        tls = ((Path(args.tls) / "server.pem").read_bytes(), (Path(args.tls) / "server.key").read_bytes())
    plane = DataPlaneServer(args.spool, tls=tls, checksum=args.checksum).start()
    blob = _random_bytes(7, args.bytes)
    tickets = plane.publish(1, blob, range(1, NODES + 1), ttl=600, max_upload=args.bytes)
    print(json.dumps({"tickets": {str(n): t.SerializeToString().hex() for n, t in tickets.items()},
                      "sha256": hashlib.sha256(blob).hexdigest()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            print(json.dumps({"cpu_s": _cpu()}), flush=True)
        if line.strip() == "collect":
            got = {str(n): plane.upload(n, 1) for n in range(1, NODES + 1)}
            print(json.dumps({n: None if u is None else {"bytes": u.size, "seconds": u.seconds,
                                                         "sha256": hashlib.sha256(u.buffer()).hexdigest()}
                              for n, u in got.items()}), flush=True)
            for u in got.values():
                if u is not None:
                    u.discard()
    plane.stop()
    return 0


def _dp_client(args: argparse.Namespace) -> int:
    """lordo_fed.transport.client download then upload with a ticket; timestamps, then checks."""
    from lordo_fed.transport.checksum import digest_of
    from lordo_fed.transport.client import download, parse_ticket, upload

    ticket = parse_ticket(bytes.fromhex(args.ticket))
    blob = _random_bytes(100 + args.index, args.bytes)
    up_sha = hashlib.sha256(blob).hexdigest()
    root = str(Path(args.tls) / "ca.crt") if args.tls else None
    print("ready", flush=True)
    sys.stdin.readline()
    c0 = _cpu()
    t0 = time.time()
    got = download(ticket, args.index, root, timeout=600)  # checks size and digest against the ticket
    t1 = time.time()
    digest = upload(ticket, args.index, blob, root, timeout=600).digest  # the server's receipt must match
    t2 = time.time()
    cpu = _cpu() - c0
    # after the timed part: the transport's own digests, and an independent sha256 of the bytes
    print(json.dumps({
        "t_start": t0, "t_down_end": t1, "t_end": t2, "cpu_s": cpu, "down_bytes": len(got), "up_bytes": len(blob),
        "down_sha256_ok": hashlib.sha256(got).hexdigest() == args.sha256,
        "up_sha256_ok": digest == digest_of(ticket.checksum, blob), "up_sha256": up_sha,
    }), flush=True)
    return 0


def _codec_server(args: argparse.Namespace) -> int:
    """The whole payload path without Flower, as a round runs when its tickets were announced
    (`DataPlaneServer.announce`: node workers, overlapped rounds): tickets first; on 'go' the
    server encodes a random fp32 GlobalState, publishes it (the nodes' waiting downloads start),
    waits for both uploads and decodes them in place (as `Courier.screened`); then reports its
    timestamps and checks each reply against the node's draw."""
    import torch

    from harness.apps.dataplane_bench.dpbench.common import draw
    from lordo_fed.transport.server import DataPlaneServer
    from lordo_fed.wire.decode import decode_update
    from lordo_fed.wire.encode import StreamingEncode, encode_global_state
    from lordo_fed.wire.messages import GlobalState

    tls = None
    if args.tls:
        tls = ((Path(args.tls) / "server.pem").read_bytes(), (Path(args.tls) / "server.key").read_bytes())
    n = args.bytes // 4
    plane = DataPlaneServer(args.spool, tls=tls, checksum=args.checksum).start()
    nodes = range(1, NODES + 1)
    tickets = plane.announce(1, nodes, ttl=600, max_upload=args.bytes + (1 << 20))
    theta = draw(7, n)
    print(json.dumps({"tickets": {str(k): t.SerializeToString().hex() for k, t in tickets.items()}}), flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            print(json.dumps({"cpu_s": _cpu()}), flush=True)
        if line.strip() != "go":
            continue
        t0 = time.time()
        state = GlobalState(round=1, params={"w": theta})
        if args.publish_whole:
            data = encode_global_state(state, "dpbench", "fp32")
            encode_s = time.time() - t0
            t1 = time.time()
            plane.publish(1, data)
        else:  # as the product: served while it is encoded, the digest after the data
            encoding = StreamingEncode(state, "dpbench", "fp32")
            t1 = time.time()
            plane.publish_encoding(1, encoding)
            data, encode_s = encoding.buffer, encoding.seconds
        t2 = time.time()
        if not plane.wait_for_uploads(1, nodes, timeout=600):
            raise RuntimeError("the nodes' uploads did not all arrive")
        t3 = time.time()
        held = [plane.upload(k, 1) for k in nodes]
        updates = [decode_update(u.buffer(), expected_model_id="dpbench", adopt=True) for u in held]
        t4 = time.time()
        ok = [bool(torch.equal(upd.delta["w"], draw(100 + k, n))) for k, upd in zip(nodes, updates)]
        sizes = [u.size for u in held]
        del updates
        for u in held:
            u.discard()
        print(json.dumps({"t_encode": t0, "t_publish": t1, "t_published": t2, "t_uploads": t3, "t_decoded": t4,
                          "encode_s": encode_s,
                          "down_bytes": len(data), "up_ok": ok, "up_bytes": sizes}), flush=True)
    plane.stop()
    return 0


def _codec_client(args: argparse.Namespace) -> int:
    """A node of `_codec_server`, as a node worker runs a data-plane round (lordo_fed.node.session
    `data_plane_round`): its download waits on the announced ticket; it decodes the state in place
    (as `run_job`) and uploads a WorkerUpdate of its Δ (drawn before 'go') while it is encoded
    (`StreamingEncode`). `t_encoded`: when the upload started."""
    from harness.apps.dataplane_bench.dpbench.common import draw
    from lordo_fed.transport.client import download, parse_ticket, upload
    from lordo_fed.wire.decode import adoptable, decode_global_state
    from lordo_fed.wire.encode import StreamingEncode
    from lordo_fed.wire.messages import WorkerUpdate

    ticket = parse_ticket(bytes.fromhex(args.ticket))
    n = args.bytes // 4
    delta = draw(100 + args.index, n)
    root = str(Path(args.tls) / "ca.crt") if args.tls else None
    print("ready", flush=True)
    sys.stdin.readline()
    c0 = _cpu()
    t0, p0, stats = time.time(), time.perf_counter(), {}
    data = download(ticket, args.index, root, timeout=600, stats=stats)
    t1 = time.time()
    state = decode_global_state(data, expected_model_id="dpbench", adopt=adoptable(data))
    t2 = time.time()
    sent = StreamingEncode(WorkerUpdate(worker_id=args.index, round=1, delta={"w": delta}, moments={}, tokens=1,
                                        opt_step=0), "dpbench", "fp32")
    t3 = time.time()
    upload(ticket, args.index, sent.buffer, root, timeout=600, ready=sent.wait_for)
    sent.result()
    t4 = time.time()
    cpu = _cpu() - c0
    down_ok = bool(state.params["w"].equal(draw(7, n)))  # after the timed part
    print(json.dumps({"t_start": t0, "t_first_byte": t0 + stats["first_byte"] - p0, "t_down_end": t1, "t_decoded": t2,
                      "t_encoded": t3, "t_end": t4, "cpu_s": cpu,
                      "down_bytes": len(data), "up_bytes": len(sent.buffer), "encode_s": sent.seconds,
                      "down_sha256_ok": down_ok, "up_sha256_ok": True}), flush=True)
    return 0


def server_decode(mb: float, repeats: int) -> dict[str, float]:
    """Seconds the server spends decoding one reply of `mb` MB (module docstring): once in place
    (now) against twice with a copy (before); medians of `repeats`."""
    import statistics

    import numpy as np
    import torch

    from lordo_fed.wire.decode import decode_update
    from lordo_fed.wire.encode import encode_update
    from lordo_fed.wire.messages import WorkerUpdate

    delta = torch.from_numpy(np.random.default_rng(1).standard_normal(int(mb * 1e6 / 4), dtype=np.float32))
    buf = encode_update(WorkerUpdate(worker_id=0, round=1, delta={"w": delta}, moments={}, tokens=1, opt_step=1),
                        "dpbench")  # a bytearray, as an upload held in memory
    times: dict[str, list[float]] = {"in_place_once_s": [], "copy_twice_s": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        once = decode_update(memoryview(buf), expected_model_id="dpbench", adopt=True)
        t1 = time.perf_counter()
        for _ in range(2):
            twice = decode_update(memoryview(buf), expected_model_id="dpbench")
        t2 = time.perf_counter()
        assert torch.equal(once.delta["w"], delta) and torch.equal(twice.delta["w"], delta)
        times["in_place_once_s"].append(t1 - t0)
        times["copy_twice_s"].append(t2 - t1)
        del once, twice
    out = {k: round(statistics.median(v), 4) for k, v in times.items()}
    out["speedup"] = round(out["copy_twice_s"] / max(out["in_place_once_s"], 1e-6), 1)
    return out


def _spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _line(proc: subprocess.Popen, what: str) -> str:
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise RuntimeError(f"{what} exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    return line.strip()


def _ask_cpu(server: subprocess.Popen, kind: str) -> float:
    server.stdin.write("cpu\n")
    server.stdin.flush()
    return float(json.loads(_line(server, f"{kind} server"))["cpu_s"])


def stream_run(kind: str, nbytes: int, tls_dir: Path | None, spool: Path) -> dict[str, Any]:
    """One exchange without Flower: a server process (`kind` 'bare': bare grpcio; 'dataplane':
    lordo_fed.transport's DataPlaneServer) and NODES client processes, each downloading then
    uploading `nbytes`; wall seconds from 'go' to the last client done. 'dataplane-sha256': the
    data plane with checksum sha256 (the default is xxh3)."""
    tls = ["--tls", str(tls_dir)] if tls_dir else []
    checksum, whole = "xxh3", []
    if kind == "dataplane-sha256":
        kind, checksum = "dataplane", "sha256"
    if kind == "codec-whole":
        kind, whole = "codec", ["--publish-whole"]
    server = _spawn(f"{kind}-server", "--bytes", str(nbytes), "--spool", str(spool), "--checksum", checksum, *tls,
                    *whole)
    clients: list[subprocess.Popen] = []
    uploads = None
    try:
        info = json.loads(_line(server, f"{kind} server"))
        if kind == "bare":
            clients = [_spawn("bare-client", "--bytes", str(nbytes), "--port", str(info["port"]), "--index", str(i),
                              "--sha256", info["sha256"], *tls) for i in range(NODES)]
        else:
            clients = [_spawn(f"{kind}-client", "--bytes", str(nbytes), "--ticket", info["tickets"][str(i + 1)],
                              "--index", str(i + 1), "--sha256", info.get("sha256", ""), *tls) for i in range(NODES)]
        for i, c in enumerate(clients):
            if _line(c, f"{kind} client {i}") != "ready":
                raise RuntimeError(f"{kind} client {i}: unexpected first line")
        server_cpu = _ask_cpu(server, kind)
        t_go = time.time()
        for c in clients + ([server] if kind == "codec" else []):
            c.stdin.write("go\n")
            c.stdin.flush()
        reports = [json.loads(_line(c, f"{kind} client {i}")) for i, c in enumerate(clients)]
        if kind == "codec":  # the server's decode of both replies ends the exchange
            server_view = json.loads(_line(server, "codec server"))
        server_cpu = _ask_cpu(server, kind) - server_cpu
        for c in clients:
            c.wait(timeout=60)
        if kind == "dataplane":
            server.stdin.write("collect\n")
            server.stdin.flush()
            uploads = json.loads(_line(server, "dataplane server"))
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait()
        if server.poll() is None:
            server.stdin.close()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    if uploads is not None:  # the server holds each node's upload, verified, with the node's sha256
        for i, r in enumerate(reports):
            u = uploads[str(i + 1)]
            r["up_sha256_ok"] = bool(r["up_sha256_ok"] and u and u["sha256"] == r.pop("up_sha256")
                                     and u["bytes"] == nbytes)
    extra: dict[str, Any] = {}
    size = nbytes
    if kind == "codec":  # the encoded payloads: the tensor plus a small header
        size = server_view["down_bytes"]
        for i, r in enumerate(reports):
            r["up_sha256_ok"] = bool(server_view["up_ok"][i] and server_view["up_bytes"][i] == r["up_bytes"])
        t_end = server_view["t_decoded"]
        extra["server"] = {k: round(v - t_go, 4) for k, v in server_view.items() if k.startswith("t_")}
        extra["server"]["encode_s"] = round(server_view["encode_s"], 4)
        extra["payload_bytes"] = size
    else:
        t_end = max(r["t_end"] for r in reports)
    seconds = t_end - t_go
    moved = sum(r["down_bytes"] + r["up_bytes"] for r in reports)
    return {
        "seconds": round(seconds, 4), "bytes_moved": moved, "mb_per_s": round(moved / 1e6 / seconds, 1),
        "download_window_s": round(max(r["t_down_end"] for r in reports) - t_go, 4),
        "upload_window_s": round(max(r["t_end"] for r in reports) - min(r["t_down_end"] for r in reports), 4),
        "start_skew_s": round(max(r["t_start"] for r in reports) - t_go, 4),
        "cpu_s": {"server": round(server_cpu, 3), "clients": round(sum(r["cpu_s"] for r in reports), 3)},
        "verified": all(r["down_sha256_ok"] and r["up_sha256_ok"] and r["down_bytes"] == size
                        and (kind == "codec" or r["up_bytes"] == nbytes) for r in reports),
        "clients": [{k: (round(v - t_go, 4) if k.startswith("t_") else v) for k, v in r.items()} for r in reports],
        **extra,
    }


# ============================================================================ the Flower deployment


def deployment(work: Path, app_dir: Path, plan: list[tuple[str, float]], tls_dir: Path | None,
               stock_supernode: bool) -> tuple[list[dict], dict[str, Any]]:
    """Run `plan` (mode, MB) in one deployment of NODES SuperNodes; the ServerApp's rows."""
    from harness.deployment import Deployment
    from harness.flower import flower_env

    env = flower_env(work / "cli")
    kwargs: dict[str, Any] = {}
    if not stock_supernode:
        from benchmarks.flower_shims import supernode_command

        kwargs["supernode_command"] = supernode_command(0.1)
    result_path = work / "rows.jsonl"
    config = {"plan": ",".join(f"{m}:{mb:g}" for m, mb in plan), "nodes": NODES, "result-path": str(result_path),
              "spool-dir": str(work / "spool")}
    if tls_dir is not None:
        config.update(certfile=str(tls_dir / "server.pem"), keyfile=str(tls_dir / "server.key"))
    big = max(mb for _, mb in plan)
    started = time.perf_counter()
    with Deployment(work, num_nodes=NODES, env=env, tls_dir=tls_dir, **kwargs) as dep:
        t_up = time.perf_counter() - started
        dep.run(app_dir, config, timeout=180 + 90 * len(plan) * max(1.0, big / 100), check=True,
                log_path=work / "run.log")
    rows = [json.loads(line) for line in result_path.read_text().splitlines()]
    settings = {"supernode": "stock flower-supernode (3 s idle wait)" if stock_supernode else
                "flower-supernode with its waits capped at 0.1 s (benchmarks/flower_shims.py; same data path)",
                "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": env.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "1"),
                "tls": tls_dir is not None, "deployment_start_s": round(t_up, 2),
                "run_s": round(time.perf_counter() - started - t_up, 2)}
    return rows, settings


# ============================================================================ summary


def _med(values) -> float:
    return statistics.median(list(values))


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def critical_path_s(row: dict) -> float:
    """The data plane's own path through one exchange, from timestamps, without Flower's control
    latency: server encode + publish + the slower node's download, decode, encode, upload + the
    server's decode of both replies."""
    chain = max(n["download_s"] + n["client_decode_s"] + n["client_encode_s"] + n["upload_s"]
                for n in row["nodes"].values())
    return row["server_encode_s"] + row["publish_s"] + chain + row["server_decode_s"]


def summarize_deployment(rows: list[dict], mode: str, size_mb: float, tiny_mb: float) -> dict[str, Any]:
    big = [r for r in rows if r["mode"] == mode and r["size_mb"] == size_mb]
    tiny = [r for r in rows if r["mode"] == mode and r["size_mb"] == tiny_mb]
    moved = _med(r["bytes_moved"] for r in big)
    t_big, t_tiny = _med(r["exchange_s"] for r in big), _med(r["exchange_s"] for r in tiny)
    added = t_big - t_tiny
    out: dict[str, Any] = {
        "bytes_moved": int(moved), "repeats": len(big),
        "exchange_s": _r(t_big), "tiny_exchange_s": _r(t_tiny), "added_by_payload_s": _r(added),
        "effective_mb_per_s": round(moved / 1e6 / added, 1) if added > 0 else None,
        "end_to_end_mb_per_s": round(moved / 1e6 / t_big, 1),
        "exchange_s_all": [_r(r["exchange_s"]) for r in big], "tiny_exchange_s_all": [_r(r["exchange_s"]) for r in tiny],
        "verified": all(r["verified"] for r in big + tiny),
    }
    if mode == "grpc":
        path = _med(critical_path_s(r) for r in big)
        out["critical_path_s"] = _r(path)
        out["critical_path_mb_per_s"] = round(moved / 1e6 / path, 1)
        out["critical_path_s_all"] = [_r(critical_path_s(r)) for r in big]
    out["breakdown"] = breakdown(big, mode)
    out["breakdown_tiny"] = breakdown(tiny, mode)
    return out


def breakdown(rows: list[dict], mode: str) -> dict[str, Any]:
    """Median over exchanges; per-node steps run concurrently on the nodes: the slower node."""
    if not rows:
        return {}

    def node_max(key: str) -> float:
        return _med(max(n[key] for n in r["nodes"].values()) for r in rows)

    def window(key: str) -> float:  # first start -> last end over the nodes
        return _med(max(n[key][1] for n in r["nodes"].values()) - min(n[key][0] for n in r["nodes"].values())
                    for r in rows)

    b: dict[str, Any] = {
        "server_encode_s": _r(_med(r["server_encode_s"] for r in rows)),
        ("publish_digest_s" if mode == "grpc" else "server_record_wrap_s"): _r(_med(r["publish_s"] for r in rows)),
        "push_s": _r(_med(r["push_s"] for r in rows)),
        "control_down_s": _r(node_max("control_down_s")),
        "client_gen_excluded_s": _r(node_max("gen_s")),
        ("download_s" if mode == "grpc" else "client_unwrap_s"): _r(node_max("download_s")),
        "client_decode_s": _r(node_max("client_decode_s")),
        "client_encode_s": _r(node_max("client_encode_s")),
        ("upload_s" if mode == "grpc" else "client_record_wrap_s"): _r(node_max("upload_s")),
        "control_up_s": _r(node_max("control_up_s")),
        "server_decode_s": _r(_med(r["server_decode_s"] for r in rows)),
        "server_decode_per_node_s": _r(_med(_med(n["server_decode_s"] for n in r["nodes"].values()) for r in rows)),
        "replies_s": _r(_med(r["replies_s"] for r in rows)),
    }
    b["cpu_s"] = {  # CPU seconds of the process doing the step (all its threads), the slower node
        "server_encode": _r(_med(r["server_encode_cpu_s"] for r in rows)),
        "publish": _r(_med(r["publish_cpu_s"] for r in rows)),
        ("download" if mode == "grpc" else "client_unwrap"): _r(node_max("download_cpu_s")),
        "client_decode": _r(node_max("client_decode_cpu_s")),
        "client_encode": _r(node_max("client_encode_cpu_s")),
        ("upload" if mode == "grpc" else "client_record_wrap"): _r(node_max("upload_cpu_s")),
        "server_decode": _r(_med(sum(n["server_decode_cpu_s"] for n in r["nodes"].values()) for r in rows)),
    }
    if mode == "grpc":
        down = _med(r["payload_bytes_down"] for r in rows) * len(rows[0]["nodes"])
        up = _med(sum(n["up_bytes"] for n in r["nodes"].values()) for r in rows)
        b["download_window_s"] = _r(window("t_download"))
        b["upload_window_s"] = _r(window("t_upload"))
        b["download_mb_per_s_both_nodes"] = round(down / 1e6 / b["download_window_s"], 1) if b["download_window_s"] else None
        b["upload_mb_per_s_both_nodes"] = round(up / 1e6 / b["upload_window_s"], 1) if b["upload_window_s"] else None
        b["critical_path_s"] = _r(_med(critical_path_s(r) for r in rows))
    b["peak_rss_mb"] = {"server": round(max(r["server_peak_rss_mb"] for r in rows)),
                        "client": round(max(n["client_peak_rss_mb"] for r in rows for n in r["nodes"].values()))}
    return b


def summarize_stream(runs: list[dict]) -> dict[str, Any]:
    seconds = _med(r["seconds"] for r in runs)
    moved = runs[0]["bytes_moved"]
    return {"bytes_moved": moved, "repeats": len(runs), "seconds": _r(seconds, 4),
            "mb_per_s": round(moved / 1e6 / seconds, 1),
            "mb_per_s_all": [r["mb_per_s"] for r in runs],
            "download_window_s": _r(_med(r["download_window_s"] for r in runs), 4),
            "upload_window_s": _r(_med(r["upload_window_s"] for r in runs), 4),
            "cpu_s": {side: _r(_med(r["cpu_s"][side] for r in runs)) for side in ("server", "clients")},
            **({"breakdown": path_breakdown(runs)} if "server" in runs[0] else {}),
            "verified": all(r["verified"] for r in runs)}


def path_breakdown(runs: list[dict]) -> dict[str, float]:
    """The announced whole path's steps (seconds from 'go', medians; the nodes': the slower one)."""
    def node(a: str, b: str) -> float:
        return _r(_med(max(c[b] - c[a] for c in r["clients"]) for r in runs))

    def server(a: str, b: str) -> float:
        return _r(_med(r["server"][b] - r["server"][a] for r in runs))

    return {"server_encode_s": _r(_med(r["server"]["encode_s"] for r in runs)),
            "server_before_publish_s": server("t_encode", "t_publish"),
            "publish_s (encode and digest, with the downloads when streamed)": server("t_publish", "t_published"),
            "first_byte_wait_s": node("t_start", "t_first_byte"),
            "download_s": node("t_start", "t_down_end"), "client_decode_s": node("t_down_end", "t_decoded"),
            "client_encode_start_s": node("t_decoded", "t_encoded"),
            "client_encode_s (during the upload)": _r(_med(max(c["encode_s"] for c in r["clients"]) for r in runs)),
            "upload_s": node("t_encoded", "t_end"),
            "server_decode_s": server("t_uploads", "t_decoded")}


def table(variants: dict[str, dict]) -> str:
    """MB/s: bytes moved / seconds (the deployment variants: big - tiny exchange); e2e: the big
    exchange itself; path: the data plane's timestamped path without Flower's control latency."""
    head = (f"{'variant':<26} {'security':<9} {'MB':>5} {'seconds':>8} {'MB/s':>7} {'ratio':>6}"
            f" | {'e2e s':>6} {'MB/s':>6} {'ratio':>6} | {'path s':>6} {'MB/s':>6} {'ratio':>6} | verified")
    lines = [head, "-" * len(head)]

    def cols(v: dict, s: str, mbs: str, ratio: str) -> str:
        if v.get(s) is None:
            return f"{'':>6} {'':>6} {'':>6}"
        return f"{v[s]:>6.2f} {v[mbs]:>6.1f} {v[ratio]:>6.2f}"

    for name, v in variants.items():
        lines.append(
            f"{name:<26} {v['security']:<9} {v['bytes_moved'] / 1e6:>5.0f} {v['seconds']:>8.3f} {v['mb_per_s']:>7.1f} "
            f"{v['ratio_to_bare']:>6.2f} | {cols(v, 'end_to_end_s', 'end_to_end_mb_per_s', 'end_to_end_ratio_to_bare')}"
            f" | {cols(v, 'critical_path_s', 'critical_path_mb_per_s', 'critical_path_ratio_to_bare')} | {v['verified']}")
    return "\n".join(lines)


# ============================================================================ main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _WORKERS:
        p = argparse.ArgumentParser(prog=f"dataplane_throughput.py {argv[0]}")
        p.add_argument("--bytes", type=int, required=True)
        p.add_argument("--tls", default="")
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--index", type=int, default=0)
        p.add_argument("--sha256", default="")
        p.add_argument("--ticket", default="")
        p.add_argument("--spool", default="")
        p.add_argument("--checksum", default="xxh3")
        p.add_argument("--publish-whole", action="store_true")
        return _WORKERS[argv[0]](p.parse_args(argv[1:]))

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 MB, 1 repeat, no TLS deployment (bare TLS kept), "
                        "the Flower-less streams once (not also after the deployments)")
    parser.add_argument("--size-mb", type=float, default=None, help="MB each way per node (default 200; quick 20)")
    parser.add_argument("--repeats", type=int, default=None, help="big exchanges per variant (default 3; quick 1)")
    parser.add_argument("--no-tls", action="store_true", help="skip the TLS deployment (bare TLS still runs)")
    parser.add_argument("--no-flower", action="store_true", help="skip the Flower path")
    parser.add_argument("--stock-supernode", action="store_true", help="SuperNodes with their 3 s idle wait")
    parser.add_argument("--out", type=Path, default=RESULTS / "dataplane_throughput.json")
    args = parser.parse_args(argv)
    size_mb = args.size_mb or (20.0 if args.quick else 200.0)
    repeats = args.repeats or (1 if args.quick else 3)
    tls_deployment = not (args.no_tls or args.quick)
    # Flower's processes (ServerApp, ClientApps) and the workers import lordo_fed from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and p != str(ROOT)])

    from benchmarks.payload_throughput import TINY_MB, local_codec
    from benchmarks.common import machine_info
    from harness.apps import copy_app

    started = time.perf_counter()
    nbytes = int(size_mb * 1e6)
    result: dict[str, Any] = {
        "benchmark": "dataplane_throughput", "quick": args.quick, "machine": machine_info(),
        "config": {"size_mb": size_mb, "repeats": repeats, "tiny_mb": TINY_MB, "nodes": NODES,
                   "tls_deployment": tls_deployment, "flower_path": not args.no_flower,
                   "stock_supernode": args.stock_supernode,
                   "payload": "one random fp32 tensor, lordo_fed.wire.codec fp32 (GlobalState down, WorkerUpdate up)"},
    }
    print(f"[dataplane_throughput] {size_mb:g} MB each way x {NODES} nodes, {repeats} repeat(s)", flush=True)
    streams: dict[tuple[str, str], list[dict]] = {(k, sec): [] for k in ("bare", "dataplane")
                                                  for sec in ("plaintext", "tls")}
    streams.update({(k, sec): [] for k in ("dataplane-sha256", "codec", "codec-whole") for sec in ("plaintext", "tls")})

    with tempfile.TemporaryDirectory(prefix="dpbench-") as tmp:
        tmp_path = Path(tmp)
        certs = tmp_path / "certs"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "generate_certs.py"), str(certs)], check=True,
                       capture_output=True, cwd=ROOT)

        def stream_round(label: str) -> None:
            """Bare grpc and the data plane without Flower, both security modes, interleaved."""
            for _ in range(repeats):
                for kind, sec in streams:
                    run = stream_run(kind, nbytes, certs if sec == "tls" else None, tmp_path / "spool")
                    run["when"] = label
                    streams[kind, sec].append(run)
                    print(f"[dataplane_throughput] {kind} {sec} ({label}): {run['mb_per_s']} MB/s "
                          f"({run['seconds']} s, verified {run['verified']})", flush=True)

        app_dir = copy_app("dataplane_bench", tmp_path / "app")
        stream_round("before")
        plan_plain = []
        for _ in range(repeats):
            plan_plain += [("grpc", TINY_MB), ("grpc", size_mb)]
            if not args.no_flower:
                plan_plain += [("flower", TINY_MB), ("flower", size_mb)]
        print(f"[dataplane_throughput] plaintext deployment: {plan_plain}", flush=True)
        rows_plain, set_plain = deployment(tmp_path / "plain", app_dir, plan_plain, None, args.stock_supernode)
        deployments = {"plaintext": {"settings": set_plain, "rows": rows_plain}}
        rows_tls: list[dict] = []
        if tls_deployment:
            stream_round("between")
            plan_tls = [("grpc", TINY_MB), ("grpc", size_mb)] * repeats
            print(f"[dataplane_throughput] TLS deployment: {plan_tls}", flush=True)
            rows_tls, set_tls = deployment(tmp_path / "tls", app_dir, plan_tls, certs, args.stock_supernode)
            deployments["tls"] = {"settings": set_tls, "rows": rows_tls}
        if not args.quick:
            stream_round("after")

    result["local_codec"] = local_codec(size_mb, 1 if args.quick else 3)
    result["server_decode"] = server_decode(size_mb, 1 if args.quick else 3)
    summaries = {key: summarize_stream(runs) for key, runs in streams.items()}
    bare_mbs = {sec: summaries["bare", sec]["mb_per_s"] for sec in ("plaintext", "tls")}
    variants: dict[str, dict] = {}
    for name, key in (("bare grpc", ("bare", "plaintext")), ("bare grpc TLS", ("bare", "tls")),
                      ("dp transport only", ("dataplane", "plaintext")),
                      ("dp transport only TLS", ("dataplane", "tls")),
                      ("dp transport, sha256", ("dataplane-sha256", "plaintext")),
                      ("dp transport, sha256 TLS", ("dataplane-sha256", "tls")),
                      ("whole path, announced", ("codec", "plaintext")),
                      ("whole path, announced TLS", ("codec", "tls")),
                      ("whole path, announced, encoded whole before publishing", ("codec-whole", "plaintext")),
                      ("whole path, announced, encoded whole before publishing TLS", ("codec-whole", "tls"))):
        s = summaries[key]
        variants[name] = {"security": key[1], "bytes_moved": s["bytes_moved"], "seconds": s["seconds"],
                          "mb_per_s": s["mb_per_s"], "ratio_to_bare": round(s["mb_per_s"] / bare_mbs[key[1]], 3),
                          "verified": s["verified"],
                          **{k: v for k, v in s.items() if k not in ("bytes_moved", "seconds", "mb_per_s", "verified")}}
    dep_variants = [("data plane", "plaintext", "grpc", rows_plain)]
    if tls_deployment:
        dep_variants.append(("data plane TLS", "tls", "grpc", rows_tls))
    if not args.no_flower:
        dep_variants.append(("flower", "plaintext", "flower", rows_plain))
    for name, sec, mode, rows in dep_variants:
        s = summarize_deployment(rows, mode, size_mb, TINY_MB)
        ref = bare_mbs[sec]
        variants[name] = {
            "security": sec, "bytes_moved": s["bytes_moved"], "seconds": s["added_by_payload_s"],
            "mb_per_s": s["effective_mb_per_s"] or 0.0,
            "ratio_to_bare": round((s["effective_mb_per_s"] or 0.0) / ref, 3),
            "end_to_end_s": s["exchange_s"], "end_to_end_mb_per_s": s["end_to_end_mb_per_s"],
            "end_to_end_ratio_to_bare": round(s["end_to_end_mb_per_s"] / ref, 3), "verified": s["verified"],
            **({"critical_path_ratio_to_bare": round(s["critical_path_mb_per_s"] / ref, 3)} if mode == "grpc" else {}),
            **{k: v for k, v in s.items() if k not in ("bytes_moved", "verified", "end_to_end_mb_per_s")},
        }
    result["variants"] = variants
    result["stream_runs"] = {f"{k} {sec}": runs for (k, sec), runs in streams.items()}
    result["deployments"] = {k: {"settings": v["settings"],
                                 "rows": [_round_floats(r) for r in v["rows"]]} for k, v in deployments.items()}
    result["verified"] = all(v["verified"] for v in variants.values())
    result["table"] = table(variants).splitlines()
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print("\n".join(result["table"]))
    for name in ("data plane", "data plane TLS"):
        if name in variants:
            print(f"[dataplane_throughput] {name} breakdown (big exchange, s): {json.dumps(variants[name]['breakdown'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[dataplane_throughput] wrote {args.out} ({result['total_seconds']} s)")
    return 0 if result["verified"] else 1


_WORKERS = {"bare-server": _bare_server, "bare-client": _bare_client,
            "dataplane-server": _dp_server, "dataplane-client": _dp_client,
            "codec-server": _codec_server, "codec-client": _codec_client}


def _round_floats(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: _round_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round_floats(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
