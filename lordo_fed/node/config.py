"""A node's own settings: Flower's node config (`flower-supernode --node-config "partition-id=0 ..."`),
typed and checked once.

The run's settings are the same on every node (`lordo_fed.app.config.AppConfig`); these differ
from node to node: which partition it trains, its own corpus, its link, its node worker. A key
that is not one of `NodeConfig`'s is refused with the keys it may have meant, since a misspelt
`partition_id` would otherwise train partition 0 on every node. Neither torch nor Flower is
imported here: a ClientApp that hands its rounds to a node worker reads its node config too.
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from lordo_fed.config import FLAT_KEY, setting
from lordo_fed.wan.links import LINK_RATE_KEY, parse_rate

NODE_WORKER_KEY = "node-worker"
"""Node config key: the node worker this node's ClientApp hands its rounds to (`unix:///path`)."""


@dataclass(frozen=True)
class NodeConfig:
    """One node's settings (docs/deployment.md, "Node config")."""

    partition_id: int = setting("partition-id", 0)
    """Which partition of the corpus this node trains (0-based; Flower's simulation sets it)."""
    num_partitions: int = setting("num-partitions", 1)
    """Into how many partitions the corpus is cut (the number of nodes)."""
    data_path: str = setting("data-path", "")
    """This node's own corpus: all of it is its partition ('' = its partition of the run's corpus)."""
    slowdown: float = setting("slowdown", 1.0)
    """>= 1: the node sleeps after its local steps until its round took this many times as long (tests, demos)."""
    local_steps: Optional[int] = setting("local-steps", None)
    """This node's local steps per round (asynchronous variants only; unset = the run's)."""
    node_worker: str = setting(NODE_WORKER_KEY, "")
    """The long-lived node worker that trains this node's rounds (`unix:///path/node.sock`; '' = in the ClientApp)."""
    link_rate: str = setting(LINK_RATE_KEY, "")
    """This node's link rate (`1gbit`, `100mbit`), reported to the server for its link-bound ideal round time."""
    root_certificates: str = setting("root-certificates", "")
    """The CA certificate (PEM) this node verifies the gRPC data plane's TLS with ('' = plaintext data plane)."""

    @classmethod
    def from_flower(cls, node_config: Mapping[str, Any]) -> "NodeConfig":
        """Parse Flower's node config; ValueError naming the key, the value and what is expected."""
        by_key = {f.metadata[FLAT_KEY]: f for f in fields(cls)}
        unknown = sorted(set(node_config) - set(by_key))
        if unknown:
            hints = {k: difflib.get_close_matches(k, by_key, n=1) for k in unknown}
            meant = "; ".join(f"{k!r}: did you mean {h[0]!r}?" for k, h in hints.items() if h)
            raise ValueError(f"node config key(s) {unknown}: unknown{' (' + meant + ')' if meant else ''}; "
                             f"expected any of {sorted(by_key)}")
        types = typing.get_type_hints(cls)
        values = {}
        for key, value in node_config.items():
            f = by_key[key]
            values[f.name] = _parse(key, value, types[f.name])
        node = cls(**values)
        node.check()
        return node

    def check(self) -> None:
        for key, value, ok in (("partition-id", self.partition_id, self.partition_id >= 0),
                               ("num-partitions", self.num_partitions, self.num_partitions >= 1),
                               ("slowdown", self.slowdown, math.isfinite(self.slowdown) and self.slowdown >= 1.0),
                               ("local-steps", self.local_steps, self.local_steps is None or self.local_steps > 0)):
            if not ok:
                raise ValueError(f"node config {key}={value!r}: expected {EXPECTED[key]}")
        if self.link_rate:
            parse_rate(self.link_rate)

    @property
    def link_bytes_per_second(self) -> float | None:
        """The declared link rate in bytes/s (None: not declared)."""
        return parse_rate(self.link_rate) if self.link_rate else None


EXPECTED = {"partition-id": "an integer >= 0", "num-partitions": "an integer >= 1",
            "slowdown": "a number >= 1 (how many times slower this node's rounds are than its local steps)",
            "local-steps": "an integer > 0"}
"""What a numeric key's value must be (the error message's end)."""


def _parse(key: str, value: Any, kind: Any) -> Any:
    """`value` as `kind` (str, int, float, or Optional[int]): Flower's node config gives bool, int,
    float or str; a string of digits is taken as the integer it spells."""
    if kind is str:
        return str(value)
    if kind in (int, Optional[int]):
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())):
            raise ValueError(f"node config {key}={value!r}: expected {EXPECTED.get(key, 'an integer')}")
        return int(value)
    if kind is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or math.isnan(number):
            raise ValueError(f"node config {key}={value!r}: expected {EXPECTED.get(key, 'a number')}")
        return number
    raise TypeError(f"node config {key}: unsupported type {kind}")
