"""The ClientApp's side of the local channel to its node worker (proto/lordo_fed/v1/node.proto).

Imports grpc and the generated messages only: a ClientApp that hands its rounds to a node worker
never imports torch, so the process Flower starts for every message stays light.
"""

from __future__ import annotations

import ipaddress
import json
import time

import grpc

from lordo_fed.v1 import node_pb2 as pb
from lordo_fed.v1 import node_pb2_grpc as pb_grpc

OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
           # Each channel its own connection: gRPC shares connections between channels to one address by
           # default, so the retry after a worker died mid-job could be sent on the dead worker's connection
           # before it was marked broken ('Stream removed (sendmsg: Broken pipe)', UNAVAILABLE at once, and
           # the round lost) instead of waiting for the restarted worker (tests/integration/test_node_channel.py).
           ("grpc.use_local_subchannel_pool", 1)]


class NodeWorkerError(RuntimeError):
    """The node worker could not be reached or failed the job (the message says which)."""


def check_local(address: str) -> str:
    """`address` if it is a unix socket or a loopback TCP address, else ValueError: a job carries
    the data plane's capability tokens, so the channel must not leave the machine."""
    if address.startswith("unix:"):
        return address
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback or not port.isdigit():
        raise ValueError(f"node worker address {address!r}: expected unix:///path/to/socket or 127.0.0.1:PORT "
                         "(the local channel stays on this machine)")
    return address


def run_on_node_worker(address: str, kind: str, run_id: int, run_config: dict, explicit: tuple[str, ...],
                       node_config: dict, node_id: int, ticket: bytes = b"", payload: bytes = b"",
                       timeout: float | None = None) -> pb.NodeResult:
    """Hand one server message to the node worker and wait for its result."""
    job = pb.NodeJob(kind=kind, run_id=int(run_id), run_config_json=json.dumps(dict(run_config)),
                     explicit_keys=list(explicit), node_config_json=json.dumps(dict(node_config)),
                     node_id=int(node_id), ticket=bytes(ticket), payload=bytes(payload))
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in (1, 2):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with grpc.insecure_channel(check_local(address), options=OPTIONS) as channel:
            try:
                # wait_for_ready: a worker being restarted (it imports torch first) is waited for, up
                # to the round's deadline, instead of failing the round at once.
                return pb_grpc.NodeWorkerStub(channel).Run(job, timeout=left, wait_for_ready=True)
            except grpc.RpcError as err:
                # The worker died during the job (killed, restarted): the job runs again on the new
                # one, once, within the same deadline; a round's job is repeatable (the worker state
                # is stored per round, and the data plane's tickets stay valid until it ends).
                if attempt == 1 and err.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                raise NodeWorkerError(f"node worker at {address}: {err.code().name}: {err.details()}") from err
    raise AssertionError("unreachable")
