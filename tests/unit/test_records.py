"""Flower's records of a payload (lordo_fed/app/records.py): one uint8 Array, byte-identical to
what Flower itself builds, read back with one copy; and the shortened first pull retry."""

from __future__ import annotations


import os

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from lordo_fed.app.records import PAYLOAD, payload_bytes, payload_record, shorten_pull_backoff


@pytest.mark.parametrize("n", [0, 1, 3, 1000, 5 * 1024 * 1024 + 7])
def test_payload_record_is_flowers_array_and_round_trips(n):
    data = os.urandom(n)
    record = payload_record(data)
    stock = Array(np.frombuffer(data, dtype=np.uint8))
    assert record[PAYLOAD].data == stock.data and record[PAYLOAD].object_id == stock.object_id
    back = payload_bytes(record)
    assert isinstance(back, bytes) and back == data
    assert payload_bytes(ArrayRecord({PAYLOAD: stock})) == data
    assert record[PAYLOAD].numpy().tobytes() == data


def test_payload_bytes_rejects_what_is_not_a_payload():
    with pytest.raises(ValueError, match="no 'payload' array"):
        payload_bytes(ArrayRecord({"other": Array(np.zeros(3, dtype=np.uint8))}))
    with pytest.raises(ValueError, match="expected 1-D uint8"):
        payload_bytes(ArrayRecord({PAYLOAD: Array(np.zeros(3, dtype=np.float32))}))


def test_shorten_pull_backoff_only_lowers_the_first_retry():
    from flwr.supercore.inflatable import inflatable_utils

    defaults = inflatable_utils.pull_objects.__kwdefaults__
    before = dict(defaults)
    try:
        shorten_pull_backoff()
        shorten_pull_backoff()
        assert defaults["initial_backoff"] == min(before["initial_backoff"], 0.05)
        assert {k: v for k, v in defaults.items() if k != "initial_backoff"} == \
            {k: v for k, v in before.items() if k != "initial_backoff"}
    finally:
        defaults.clear()
        defaults.update(before)
