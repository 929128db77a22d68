"""The one place where lordo-fed payloads meet Flower records (imported by server/ and client/ only).

A round's payload is one serialized `lordo_fed.v1` protobuf message (lordo_fed.codec), carried as
a single uint8 `Array` in an `ArrayRecord`: Flower chunks it (5 MB content-addressed chunks) and
our schema keeps names, shapes, dtypes (bf16 bit-viewed) and identity.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

PAYLOAD = "payload"


def payload_record(data: bytes) -> ArrayRecord:
    """Wrap serialized payload bytes for a Flower message."""
    return ArrayRecord({PAYLOAD: Array(np.frombuffer(data, dtype=np.uint8))})


def payload_bytes(record: ArrayRecord) -> bytes:
    """The serialized payload inside a record (ValueError if it is not one)."""
    if PAYLOAD not in record:
        raise ValueError(f"record has no {PAYLOAD!r} array (keys: {sorted(record)})")
    arr = record[PAYLOAD]
    if arr.dtype != "uint8" or len(arr.shape) != 1:
        raise ValueError(f"payload array has dtype {arr.dtype} and shape {arr.shape}: expected 1-D uint8")
    return arr.numpy().tobytes()


def tensors_to_records(tensors: dict[str, torch.Tensor], meta: dict) -> RecordDict:
    """Named tensors + JSON metadata as Flower records (bf16 carried bit-viewed as int16)."""
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    arrays = {
        k: Array((v.view(torch.int16) if v.dtype == torch.bfloat16 else v).detach().cpu().contiguous().numpy())
        for k, v in tensors.items()
    }
    return RecordDict({"tensors": ArrayRecord(arrays), "meta": ConfigRecord({"json": json.dumps({"meta": meta, "dtypes": dtypes})})})


def records_to_tensors(records: RecordDict) -> tuple[dict[str, torch.Tensor], dict]:
    info = json.loads(records["meta"]["json"])
    tensors = {}
    for k, arr in records["tensors"].items():
        t = torch.from_numpy(arr.numpy().copy())
        tensors[k] = t.view(torch.bfloat16) if info["dtypes"][k] == "bfloat16" else t
    return tensors, info["meta"]
