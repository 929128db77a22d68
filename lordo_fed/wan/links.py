"""Link rates and the link-bound ideal time of a round.

A round over bandwidth-limited links cannot take less than its slowest node needs to move its
bytes at its link's rate, train, and wait for the server to aggregate:

    ideal = max over nodes n of (down_n + up_n) / rate_n + train_n  +  aggregation

(down and up through one link of `rate_n` bytes/s in each direction, sent one after the other as a
synchronous round does). `round_seconds / ideal` is how much the framework adds to the link.

Overlapped rounds (`rounds.overlap_delay`: a node trains the next round's first steps while its
reply goes up and the next state comes down) can hide the link behind computation; their bound is

    bound = max over nodes n of max(compute_n, (down_n + up_n) / rate_n)

(compute_n all of the round's local steps), the wall-clock a round cannot beat however it is
scheduled, and `round_seconds / bound` is what the overlap leaves unhidden.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Node config key: the node's link rate (`1gbit`, `100mbit`), reported to the server for its ideal.
LINK_RATE_KEY = "link-rate"

#: tc's units (tc(8) "RATES"): bits per second with decimal prefixes, or bytes per second ("bps").
_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
          "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_rate(text: str | float | int) -> float:
    """A link rate as bytes per second. Text uses tc's units: `100mbit`, `1gbit`, `500kbit`
    (bits/s, decimal prefixes) or `25mbps` (bytes/s); a bare number is bits per second, as for tc.
    Raises ValueError naming the value and what was expected."""
    if isinstance(text, bool):
        raise ValueError(f"link rate {text!r}: expected e.g. '100mbit', '1gbit' or bits per second")
    if isinstance(text, (int, float)):
        value, unit = float(text), "bit"
    else:
        m = _RATE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS | {"": None}:
            raise ValueError(f"link rate {text!r}: expected a number with a tc unit ({', '.join(_UNITS)}), "
                             "e.g. '100mbit' or '1gbit'")
        value, unit = float(m.group(1)), (m.group(2).lower() or "bit")
    rate = value * _UNITS[unit]
    if not rate > 0 or rate != rate or rate == float("inf"):
        raise ValueError(f"link rate {text!r}: expected a rate > 0")
    return rate


def format_rate(bytes_per_second: float) -> str:
    """A rate as tc writes it (bits/s with the largest whole decimal prefix): 125e6 -> '1gbit'."""
    bits = bytes_per_second * 8
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale and abs(bits / scale - round(bits / scale)) < 1e-9 * bits / scale:
            return f"{round(bits / scale)}{unit}"
    return f"{bits:.0f}bit"


def parse_links(spec: str, num_nodes: int) -> list[float]:
    """Each node's link rate (bytes/s) from `--link`: one rate for all (`1gbit`), or per node
    (`node0=1gbit,node1=100mbit`, with an optional `default=` for the nodes not named)."""
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r}: expected at least 1")
    spec = spec.strip()
    if "=" not in spec:
        return [parse_rate(spec)] * num_nodes
    rates: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not (key == "default" or re.fullmatch(r"node[0-9]+", key)):
            raise ValueError(f"--link entry {part.strip()!r}: expected nodeI=RATE or default=RATE "
                             f"(e.g. node0=1gbit,node1=100mbit)")
        if key in rates:
            raise ValueError(f"--link names {key!r} twice")
        rates[key] = parse_rate(value)
    unknown = [k for k in rates if k != "default" and int(k[4:]) >= num_nodes]
    if unknown:
        raise ValueError(f"--link names {unknown} but there are {num_nodes} nodes (node0..node{num_nodes - 1})")
    missing = [f"node{i}" for i in range(num_nodes) if f"node{i}" not in rates]
    if missing and "default" not in rates:
        raise ValueError(f"--link gives no rate for {missing}: name them or add default=RATE")
    return [rates.get(f"node{i}", rates.get("default", 0.0)) for i in range(num_nodes)]


@dataclass(frozen=True)
class NodeLink:
    """What one node moved and did in a round, and its link's rate."""

    down_bytes: int
    """Bytes the node received (the round's global state)."""
    up_bytes: int
    """Bytes the node sent (its reply)."""
    rate: float
    """The node's link rate, bytes per second, each direction."""
    train_seconds: float
    """The node's own compute time for the round (its local steps)."""

    def link_seconds(self) -> float:
        return (self.down_bytes + self.up_bytes) / self.rate


def overlap_bound_seconds(nodes: dict[int, NodeLink]) -> tuple[float, int]:
    """(the bound of an overlapped round, the node that sets it): max over nodes of the larger
    of its compute and its link time (module docstring)."""
    if not nodes:
        raise ValueError("overlap_bound_seconds: no nodes")
    worst = max(nodes, key=lambda n: max(nodes[n].link_seconds(), nodes[n].train_seconds))
    return max(nodes[worst].link_seconds(), nodes[worst].train_seconds), worst


def ideal_round_seconds(nodes: dict[int, NodeLink], aggregation_seconds: float) -> tuple[float, int]:
    """(the link-bound ideal of a round, the node that bounds it): max over nodes of its link time
    plus its training time, plus the server's aggregation (module docstring)."""
    if not nodes:
        raise ValueError("ideal_round_seconds: no nodes")
    worst = max(nodes, key=lambda n: nodes[n].link_seconds() + nodes[n].train_seconds)
    return nodes[worst].link_seconds() + nodes[worst].train_seconds + aggregation_seconds, worst
