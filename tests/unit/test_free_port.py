"""harness.processes.free_port: ports the deployment harness hands its child processes, outside the
kernel's ephemeral range (where an outgoing connection could take one before the child binds it)."""

from __future__ import annotations

import socket

from harness.processes import _ephemeral_range, free_port


def test_free_ports_are_bindable_distinct_and_outside_the_ephemeral_range():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(not low <= p <= high and not 10002 <= p <= 19999 for p in ports), (low, high, ports)  # nor Ray's
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", p))  # still free: nothing assigns it unasked


def test_a_span_of_ports_is_free_together_and_never_handed_out_again():
    port = free_port(span=3)
    with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for sock, p in zip((a, b, c), range(port, port + 3)):
            sock.bind(("127.0.0.1", p))
    assert all(not port <= free_port() < port + 3 for _ in range(200))

