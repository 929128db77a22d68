"""The one place where lordo-fed payloads meet Flower records (imported by server/ and client/ only).

A round's payload is one serialized `lordo_fed.v1` protobuf message (lordo_fed.wire.codec), carried as
a single uint8 `Array` in an `ArrayRecord`: Flower chunks it (5 MB content-addressed chunks) and
our schema keeps names, shapes, dtypes (bf16 bit-viewed) and identity.
"""

from __future__ import annotations

import io
import json
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

if TYPE_CHECKING:  # a node-worker ClientApp never imports torch
    import torch

PAYLOAD = "payload"
TICKET = "ticket"
"""ConfigRecord key of a server message on the gRPC data plane: a serialized `lordo_fed.v1.Ticket`."""
UPLOAD_DIGEST = "digest"
"""Key, in a reply's "upload" ConfigRecord, of the digest (the ticket's checksum kind) of what the node
put on the data plane."""
EXPLICIT_KEYS = "explicit-keys"
"""ConfigRecord key of every server message: the run-config keys the user set, comma-separated."""
ROUND_TIMEOUT = "round-timeout"
"""ConfigRecord key of every server message: the run's round deadline in seconds, as the server
composed it (preset included). A ClientApp that hands its rounds to a node worker composes no
settings (it imports no torch) and bounds its wait with this."""
SESSION = "session"
"""ConfigRecord key of an asynchronous session's message (1): its ticket starts the node's rounds on the data
plane (lordo_fed/node/session.py), and the reply comes once the session ended."""
IDENTIFY = "identify"
"""ConfigRecord key of a query message that asks a node only for its partition id (asynchronous
rounds map partitions to nodes before the first round); the reply's metrics carry `partition-id`."""
_NUMPY_STYPE = Array(np.zeros(0, dtype=np.uint8)).stype  # how flwr tags np.save-serialized arrays


def payload_record(data: bytes) -> ArrayRecord:
    """Wrap serialized payload bytes for a Flower message.

    The `Array` holds exactly what `Array(np.frombuffer(data, np.uint8))` would (`np.save` bytes:
    a .npy header, then the data), built with one copy instead of np.save's two."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (len(data),)})
    npy = header.getvalue() + data  # bytes + (bytes | bytearray): one copy
    return ArrayRecord({PAYLOAD: Array(dtype="uint8", shape=(len(data),), stype=_NUMPY_STYPE, data=npy)})


def payload_bytes(record: ArrayRecord) -> bytes:
    """The serialized payload inside a record (ValueError if it is not one).

    Sliced out of the `Array`'s .npy bytes after its header (one copy; `arr.numpy().tobytes()`
    makes two, ~0.3 s more per 200 MB)."""
    if PAYLOAD not in record:
        raise ValueError(f"record has no {PAYLOAD!r} array (keys: {sorted(record)})")
    arr = record[PAYLOAD]
    if arr.dtype != "uint8" or len(arr.shape) != 1:
        raise ValueError(f"payload array has dtype {arr.dtype} and shape {arr.shape}: expected 1-D uint8")
    if arr.stype == _NUMPY_STYPE:
        buf = io.BytesIO(arr.data)
        try:
            major, _ = np.lib.format.read_magic(buf)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = read_header(buf)
        except ValueError:
            pass  # not a .npy we can read here: let numpy decide below
        else:
            start = buf.tell()
            if dtype == np.uint8 and shape == tuple(arr.shape) and len(arr.data) - start == shape[0]:
                return arr.data[start:]
    return arr.numpy().tobytes()


def tensors_to_records(tensors: dict[str, "torch.Tensor"], meta: dict) -> RecordDict:
    """Named tensors + JSON metadata as Flower records (bf16 carried bit-viewed as int16)."""
    import torch  # here, not at the top: a ClientApp that hands its rounds to a node worker never imports torch

    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    arrays = {
        k: Array((v.view(torch.int16) if v.dtype == torch.bfloat16 else v).detach().cpu().contiguous().numpy())
        for k, v in tensors.items()
    }
    return RecordDict({"tensors": ArrayRecord(arrays), "meta": ConfigRecord({"json": json.dumps({"meta": meta, "dtypes": dtypes})})})


def records_to_tensors(records: RecordDict) -> tuple[dict[str, "torch.Tensor"], dict]:
    import torch

    info = json.loads(records["meta"]["json"])
    tensors = {}
    for k, arr in records["tensors"].items():
        t = torch.from_numpy(arr.numpy().copy())
        tensors[k] = t.view(torch.bfloat16) if info["dtypes"][k] == "bfloat16" else t
    return tensors, info["meta"]


def explicit_keys(msg: Message) -> tuple[str, ...]:
    """The run-config keys the server says the user set (`EXPLICIT_KEYS` in the message's
    "config" record; none when absent): the client composes its settings with them as the server
    did (lordo_fed.app.config.load_app_config)."""
    config = msg.content.config_records.get("config")
    value = config.get(EXPLICIT_KEYS, "") if config is not None else ""
    return tuple(k for k in str(value).split(",") if k)


def shorten_pull_backoff(initial: float = 0.05) -> None:
    """Retry not-yet-uploaded message objects after 50 ms instead of Flower's 1 s (this process).

    The SuperLink lists a message (a reply, for the ServerApp) as soon as its sender has pushed
    the message itself, before its objects (the payload chunks) are uploaded. Polling fast, the
    server often pulls in that window; `grid.pull_messages` (flwr 1.41/1.42: `pull_objects`,
    initial backoff `PULL_INITIAL_BACKOFF` = 1 s) then waits a whole second before fetching the
    objects: +1.2 s in most rounds of a 127.0.0.1 deployment (benchmarks/round_overhead.py). The
    rest of the retry schedule (doubling, capped at 10 s, 500 tries, 2 h budget) is unchanged.
    Idempotent; a no-op when this flwr has no such function or keyword (another version).
    """
    try:
        from flwr.supercore.inflatable import inflatable_utils
    except ImportError:
        return
    defaults = getattr(getattr(inflatable_utils, "pull_objects", None), "__kwdefaults__", None)
    if isinstance(defaults, dict) and isinstance(defaults.get("initial_backoff"), (int, float)):
        defaults["initial_backoff"] = min(defaults["initial_backoff"], initial)


def is_simulation(grid) -> bool:
    """Whether the ServerApp runs under Flower's simulation engine (an in-process grid: clients
    are Ray actors beside it, and payloads in messages cost no network)."""
    return type(grid).__name__ == "InMemoryGrid"
