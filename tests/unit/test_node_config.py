"""A node's settings (lordo_fed/node/config.py) are typed and checked once, naming a bad key; the
round deadline a ClientApp bounds its waits with is the server's, preset included."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict

from lordo_fed.node.config import NodeConfig


def test_node_config_is_typed_with_its_defaults():
    node = NodeConfig.from_flower({"partition-id": 1, "num-partitions": "3", "slowdown": 2, "link-rate": "100mbit",
                                   "node-worker": "unix:///tmp/n.sock"})
    assert (node.partition_id, node.num_partitions, node.slowdown) == (1, 3, 2.0)
    assert node.link_bytes_per_second == 100e6 / 8 and node.node_worker == "unix:///tmp/n.sock"
    assert NodeConfig.from_flower({}) == NodeConfig()
    assert NodeConfig().local_steps is None and NodeConfig().link_bytes_per_second is None


@pytest.mark.parametrize("config, message", [
    ({"partition_id": 0}, "node config key(s) ['partition_id']: unknown ('partition_id': did you mean 'partition-id'?)"),
    ({"partition-id": -1}, "node config partition-id=-1: expected an integer >= 0"),
    ({"partition-id": "one"}, "node config partition-id='one': expected an integer >= 0"),
    ({"num-partitions": 0}, "node config num-partitions=0: expected an integer >= 1"),
    ({"slowdown": 0.5}, "node config slowdown=0.5: expected a number >= 1"),
    ({"local-steps": 0}, "node config local-steps=0: expected an integer > 0"),
    ({"link-rate": "fast"}, "link rate 'fast'"),
])
def test_a_bad_node_config_is_named(config, message):
    with pytest.raises(ValueError) as err:
        NodeConfig.from_flower(config)
    assert message in str(err.value)


def received(config: ConfigRecord) -> Message:
    """A train message as a ClientApp receives it (its metadata set by the SuperLink)."""
    meta = Metadata(run_id=1, message_id="m", src_node_id=1, dst_node_id=2, reply_to_message_id="", group_id="",
                    created_at=0.0, ttl=60.0, message_type="train")
    return Message(metadata=meta, content=RecordDict({"config": config}))


def test_the_client_waits_as_long_as_the_servers_round_deadline(tmp_path):
    """A preset's `round_timeout` reaches a ClientApp through the server's message (a node-worker
    ClientApp composes no settings); a message that does not say falls back to the run config."""
    from client.app import _round_timeout
    from lordo_fed.app.config import load_app_config
    from lordo_fed.app.records import ROUND_TIMEOUT
    from lordo_fed.wire.payload import resolve_payload
    from server.courier import Courier

    (tmp_path / "slow.yaml").write_text("defaults:\n  - app\n  - _self_\n\nround_timeout: 45.0\n")
    cfg = load_app_config({"preset": "slow", "round-timeout": 600.0}, tmp_path)
    # the server's messages' config only: no model, no data
    courier = Courier(cfg, (), model_id="", payload=resolve_payload("fp32"), max_upload=0, spool=tmp_path)
    config = courier.message_config(3)
    assert config["round"] == 3 and config[ROUND_TIMEOUT] == 45.0
    context = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={"round-timeout": 600.0})
    told, silent = (received(ConfigRecord(c)) for c in (config, {"round": 3}))
    assert _round_timeout(told, context) == 45.0
    assert _round_timeout(silent, context) == 600.0
