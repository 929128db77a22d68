"""Hostile replies at the server: each is dropped before it can touch the global state.

Strategy level, the way Flower drives it: `LoRDOStrategy.configure_train` builds the round's
instruction messages, every client reply is a real `flwr.app.Message(reply_to=...)` carrying a
`lordo_fed.v1.WorkerUpdate` made by our codec and then tampered with (on the protobuf message
when the case is about the wire: schema, dtype, declared size), and `aggregate_train` handles the
round. For every case we check that

- the reply is dropped: the round log and the log line `round <r>: dropped reply of node <id>...:
  <reason>` name the node and the reason;
- mixed round (two good replies, one hostile): θ, outer momentum, projections, moments, counters
  equal those of a twin strategy fed the two good replies only (bit for bit), and θ and the QHM
  buffer equal the hand-computed token-weighted update of the good replies;
- all replies bad: θ, outer state, projections, moments, opt_step and tokens are bit-identical
  to before; the round is skipped (the round counter moves on by exactly one, as for any round
  with fewer than min_clients usable replies).

A second reply for a partition that already answered (two nodes with the same partition-id) is
dropped the same way.

Plus one Flower simulation in which a node sends NaN-poisoned updates (harness/apps/hostile_clientapp.py):
the run completes with the other node and the server log names the rejected node every round.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from lordo_fed.app.config import load_app_config
from lordo_fed.wire.encode import encode_update
from lordo_fed.app.records import payload_record
from lordo_fed.wire.messages import WorkerUpdate, moment_key
from lordo_fed.v1 import wire_pb2 as pb
from server.strategy import LoRDOStrategy

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIG = {
    "preset": "quickstart", "num-server-rounds": 4, "local-steps": 2, "batch-size": 2, "seq-len": 16,
    "eval-batches": 1, "threads": 1, "device": "cpu", "min-clients": 2, "outer": "qhm", "outer-lr": 0.7,
    "outlier-factor": 3.0,
}
OUTER_LR, OUTER_BETA = 0.7, 0.9  # qhm with the default β = 0.9, ν = 0
GOOD = {101: 0, 102: 1}  # node id -> partition of the two well-behaved clients
HOSTILE_NODE, HOSTILE_PARTITION = 103, 2
ROUND = 2  # the round under test (round 1 is a clean round that fills outer state and moments)


# ----------------------------------------------------------------------------- building blocks
class NodeIds:
    """The one thing `configure_train` asks of its Grid: the connected node ids."""

    def __init__(self, ids):
        self.ids = list(ids)

    def get_node_ids(self):
        return self.ids


def make_update(s: LoRDOStrategy, partition: int, round_idx: int, scale: float = 1.0) -> WorkerUpdate:
    """A well-formed, seeded update: Δ for every parameter, the moments due this round."""
    agg = s.aggregator
    g = torch.Generator().manual_seed(1000 * round_idx + partition)
    delta = {n: torch.randn(p.shape, generator=g) * (1e-3 * scale) for n, p in agg.params.items()}
    moments = {}
    for kind in agg.rounds.due(round_idx):
        for n in agg.params:
            t = torch.randn(agg.expected_moment_shape(n), generator=g) * 1e-3
            moments[moment_key(kind, n)] = t.abs() if kind == "exp_avg_sq" else t
    return WorkerUpdate(worker_id=partition, round=round_idx, delta=delta, moments=moments,
                        tokens=64 * (partition + 1), opt_step=2 * round_idx, metrics={"train_loss": 5.0 + partition})


def encode(s: LoRDOStrategy, update: WorkerUpdate) -> bytes:
    return encode_update(update, s.model_id, "fp32")


def tamper(data: bytes, edit) -> bytes:
    """Parse a WorkerUpdate payload, let `edit` change the protobuf message, serialize it again."""
    msg = pb.WorkerUpdate()
    msg.ParseFromString(data)
    edit(msg)
    return msg.SerializeToString()


def replies(s: LoRDOStrategy, round_idx: int, payloads: dict[int, bytes]) -> list[Message]:
    """The round's instruction messages (configure_train) and one reply per node."""
    instructions = list(s.configure_train(round_idx, ArrayRecord(), ConfigRecord(), NodeIds(payloads)))
    assert [m.metadata.dst_node_id for m in instructions] == list(payloads)
    out = []
    for m in instructions:
        content = RecordDict({"update": payload_record(payloads[m.metadata.dst_node_id]),
                              "metrics": MetricRecord({"client-seconds": 1.0, "train-seconds": 0.5})})
        reply = Message(content=content, reply_to=m)
        assert reply.metadata.src_node_id == m.metadata.dst_node_id
        out.append(reply)
    return out


def good_payloads(s: LoRDOStrategy, round_idx: int) -> dict[int, bytes]:
    return {node: encode(s, make_update(s, p, round_idx)) for node, p in GOOD.items()}


def new_strategy(out: Path, **overrides) -> LoRDOStrategy:
    """A strategy after a clean round 1: projections fitted, QHM buffer and moments filled."""
    s = LoRDOStrategy(load_app_config({**RUN_CONFIG, "output-dir": str(out), **overrides}))
    agg = s.aggregator
    g = torch.Generator().manual_seed(7)
    gradients = [WorkerUpdate(worker_id=p, round=0, delta={n: torch.randn(agg.params[n].shape, generator=g)
                                                              for n in agg.ranks},
                              moments={}, tokens=64, opt_step=0) for p in GOOD.values()]
    agg.init_projections(gradients)
    _, metrics = s.aggregate_train(1, replies(s, 1, good_payloads(s, 1)))
    assert agg.round == ROUND and metrics["clients_ok"] == 2.0
    assert agg.moments and agg.projections and agg.outer.state_dict()
    return s


def snapshot(s: LoRDOStrategy) -> dict:
    return {**{k: v.clone() for k, v in s.aggregator.state_dict().items()}, "tokens": s.tokens}


def assert_same_state(actual: dict, expected: dict, ignore: tuple[str, ...] = ()) -> None:
    assert set(actual) == set(expected)
    for k in sorted(set(expected) - set(ignore)):
        a, e = actual[k], expected[k]
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), f"{k} differs"
        else:
            assert a == e, f"{k}: {a} != {e}"


def dropped_lines(caplog, node: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "lordo_fed.server" and re.search(rf"dropped reply of node {node}\b", r.getMessage())]


@pytest.fixture(scope="module", autouse=True)
def serverapp_identity():
    """What Flower sets in a ServerApp process before `main` runs (instruction messages read it),
    and one torch thread, as server/app.py does with threads=1 (SVDs of tiny matrices are ~10x
    slower with two threads on a busy 2-core machine)."""
    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    threads = torch.get_num_threads()
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 42, SUPERLINK_NODE_ID
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture(scope="module")
def good_only(serverapp_identity, tmp_path_factory) -> dict:
    """The state after round 2 with the two good replies only (the expectation of mixed rounds)."""
    s = new_strategy(tmp_path_factory.mktemp("twin"))
    before = snapshot(s)
    s.aggregate_train(ROUND, replies(s, ROUND, good_payloads(s, ROUND)))
    return {"before": before, "after": snapshot(s)}


def hand_computed(before: dict, updates: list[WorkerUpdate]) -> tuple[dict, dict]:
    """θ and the QHM buffer after one outer step with the token-weighted mean of `updates`."""
    total = sum(u.tokens for u in updates)
    theta, momentum = {}, {}
    for k, p in before.items():
        if not k.startswith("param/"):
            continue
        n = k.removeprefix("param/")
        mean = torch.zeros_like(p)
        for u in updates:
            mean.add_(u.delta[n], alpha=u.tokens / total)
        momentum[n] = before[f"outer/momentum.{n}"].clone().mul_(OUTER_BETA).add_(mean, alpha=1 - OUTER_BETA)
        theta[n] = p.clone().add_(mean, alpha=-OUTER_LR)
    return theta, momentum


def check_dropped(tmp_path, caplog, good_only, hostile, reason) -> None:
    """`hostile(strategy, round) -> bytes` is dropped in a mixed round and in an all-bad round;
    `reason` is the text the log line must carry (or a function of the strategy giving it)."""
    s = new_strategy(tmp_path / "out")
    if callable(reason):
        reason = reason(s)
    assert_same_state(snapshot(s), good_only["before"])  # same start as the twin

    # mixed: two good replies and the hostile one
    payloads = {**good_payloads(s, ROUND), HOSTILE_NODE: hostile(s, ROUND)}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lordo_fed.server"):
        _, metrics = s.aggregate_train(ROUND, replies(s, ROUND, payloads))
    lines = dropped_lines(caplog, HOSTILE_NODE)
    assert len(lines) == 1 and lines[0].startswith(f"round {ROUND}: dropped reply of node {HOSTILE_NODE}")
    assert reason in lines[0], lines[0]
    assert [k for k in s.round_log.dropped if k.startswith(f"node {HOSTILE_NODE}")]
    assert reason in "".join(s.round_log.dropped.values())
    assert sorted(s.round_log.received) == sorted(GOOD.values())
    assert metrics["clients_ok"] == 2.0 and metrics["clients_dropped"] == 1.0
    after = snapshot(s)
    assert_same_state(after, good_only["after"])
    theta, momentum = hand_computed(good_only["before"], [make_update(s, p, ROUND) for p in GOOD.values()])
    for n in theta:
        assert torch.equal(after[f"param/{n}"], theta[n]), n
        assert torch.equal(after[f"outer/momentum.{n}"], momentum[n]), n
    assert after["tokens"] == good_only["before"]["tokens"] + 64 * 1 + 64 * 2

    # all bad: two hostile replies (min_clients=2), nothing changes but the skipped round
    r = ROUND + 1
    before = snapshot(s)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lordo_fed.server"):
        _, metrics = s.aggregate_train(r, replies(s, r, {HOSTILE_NODE: hostile(s, r), 104: hostile(s, r)}))
    for node in (HOSTILE_NODE, 104):
        lines = dropped_lines(caplog, node)
        assert len(lines) == 1 and lines[0].startswith(f"round {r}: dropped reply of node {node}"), lines
        assert reason in lines[0], lines[0]
    assert any("round skipped, global state unchanged" in m for m in caplog.messages)
    assert metrics["clients-ok"] == 0
    after = snapshot(s)
    assert_same_state(after, before, ignore=("counter/round",))
    assert int(after["counter/round"]) == int(before["counter/round"]) + 1


# ----------------------------------------------------------------------------- one test per case
@pytest.mark.parametrize("where,value", [("delta", math.nan), ("moment", math.inf), ("delta", -math.inf)])
def test_nan_or_inf_values_are_dropped(tmp_path, caplog, good_only, where, value):
    def hostile(s, r):
        u = make_update(s, HOSTILE_PARTITION, r)
        if where == "delta":
            u.delta[sorted(u.delta)[0]].view(-1)[0] = value
        else:
            u.moments[sorted(u.moments)[-1]].view(-1)[3] = value
        return encode(s, u)

    check_dropped(tmp_path, caplog, good_only, hostile, "contains NaN or Inf")


@pytest.mark.parametrize("where", ["delta", "low-rank moment"])
def test_wrong_shape_is_dropped(tmp_path, caplog, good_only, where):
    def hostile(s, r):
        u = make_update(s, HOSTILE_PARTITION, r)
        name = sorted(s.aggregator.ranks)[0]  # a low-rank 2-D weight
        p, q = s.aggregator.params[name].shape
        if where == "delta":
            u.delta[name] = torch.zeros(p, q + 1)
        else:  # a full-size moment where the shared rank-r one is expected
            u.moments[moment_key("exp_avg", name)] = torch.zeros(p, q)
        return encode(s, u)

    def reason(s):
        name = sorted(s.aggregator.ranks)[0]
        p, q = s.aggregator.params[name].shape
        if where == "delta":
            return f"delta/{name}: shape {(p, q + 1)}, expected {(p, q)}"
        return f"exp_avg/{name}: shape {(p, q)}, expected {s.aggregator.expected_moment_shape(name)}"

    check_dropped(tmp_path, caplog, good_only, hostile, reason)


@pytest.mark.parametrize("edit,reason", [
    # fp32 words relabelled as int32 (sizes still consistent): decodes, refused as non-floating
    ("int32", "dtype torch.int32, expected a floating-point tensor"),
    ("unknown", "unknown dtype enum value 99"),
    ("bf16-raw", "codec RAW does not fit dtype BFLOAT16"),
])
def test_wrong_dtype_is_dropped(tmp_path, caplog, good_only, edit, reason):
    def hostile(s, r):
        def change(msg):
            t = msg.delta[0]
            t.dtype = {"int32": pb.INT32, "unknown": 99, "bf16-raw": pb.BFLOAT16}[edit]

        return tamper(encode(s, make_update(s, HOSTILE_PARTITION, r)), change)

    check_dropped(tmp_path, caplog, good_only, hostile, reason)


def test_missing_tensors_are_dropped(tmp_path, caplog, good_only):
    def hostile(s, r):
        u = make_update(s, HOSTILE_PARTITION, r)
        del u.delta[sorted(u.delta)[-1]]
        return encode(s, u)

    check_dropped(tmp_path, caplog, good_only, hostile,
                  lambda s: f"pseudo-gradient names differ: missing [{sorted(s.aggregator.params)[-1]!r}], unexpected []")


@pytest.mark.parametrize("where,reason", [
    ("delta", "unexpected ['evil.weight']"),
    ("moment", "unexpected moment 'exp_avg/evil.weight'"),
    ("duplicate", "duplicate tensor name"),  # on the wire: a second tensor under an existing name
])
def test_extra_tensors_are_dropped(tmp_path, caplog, good_only, where, reason):
    def hostile(s, r):
        u = make_update(s, HOSTILE_PARTITION, r)
        if where == "delta":
            u.delta["evil.weight"] = torch.zeros(2, 2)
        elif where == "moment":
            u.moments["exp_avg/evil.weight"] = torch.zeros(2, 2)
        data = encode(s, u)
        if where == "duplicate":
            data = tamper(data, lambda msg: msg.delta.add().CopyFrom(msg.delta[0]))
        return data

    check_dropped(tmp_path, caplog, good_only, hostile, reason)


@pytest.mark.parametrize("schema,reason", [
    ("lordo_fed.v3.WorkerUpdate", "schema 'lordo_fed.v3.WorkerUpdate' received, expected 'lordo_fed.v1.WorkerUpdate'"),
    ("lordo_fed.v1.GlobalState", "(a GlobalState where a WorkerUpdate was expected)"),
    ("", "the payload carries no schema version"),
])
def test_wrong_schema_version_is_dropped(tmp_path, caplog, good_only, schema, reason):
    def hostile(s, r):
        return tamper(encode(s, make_update(s, HOSTILE_PARTITION, r)), lambda msg: setattr(msg, "schema", schema))

    check_dropped(tmp_path, caplog, good_only, hostile, reason)


def test_a_compressed_codec_the_server_did_not_configure_is_dropped(tmp_path, caplog, good_only):
    """A v2 payload whose Δ travels top-k compressed, to a server configured for plain tensors."""
    from lordo_fed.wire.compress import CodecSpec, encode as compress

    def hostile(s, r):
        u = make_update(s, HOSTILE_PARTITION, r)
        name = next(iter(u.delta))
        u.delta[name] = compress(u.delta[name], CodecSpec("topk", bits=2, chunk=64, density=0.25, levels="lut"))
        return encode(s, u)

    check_dropped(tmp_path, caplog, good_only, hostile, "is not one this receiver configured (configured: none)")


def test_a_node_that_missed_a_round_gets_the_clients_copy_whole(tmp_path):
    """A compressed downlink (payload int8): round 2 sends the nodes that replied to round 1 the
    int8 change of the clients' copy θ_c, and a node that did not (it may not hold round 1's
    copy) θ_c whole, inside its message; both end with the same copy, the server's."""
    from lordo_fed.wire.decode import decode_global_state
    from lordo_fed.app.records import payload_bytes
    from lordo_fed.wire.payload import resolve_payload

    s = new_strategy(tmp_path / "out", **{"payload-dtype": "int8"})
    before = {n: t.clone() for n, t in s.aggregator.client_params.items()}
    messages = s.configure_train(ROUND, ArrayRecord(), ConfigRecord(), NodeIds([*GOOD, HOSTILE_NODE]))
    states = {m.metadata.dst_node_id: decode_global_state(payload_bytes(m.content["state"]), s.model_id,
                                                          codecs=resolve_payload("int8").downlink_specs) for m in messages}
    assert set(states) == {*GOOD, HOSTILE_NODE}
    copy = s.aggregator.client_copy()
    for node in GOOD:
        assert states[node].params_delta
        assert all(torch.equal(before[n] + states[node].params[n], copy[n]) for n in copy)
    whole = states[HOSTILE_NODE]
    assert not whole.params_delta and all(torch.equal(whole.params[n], copy[n]) for n in copy)
    assert any(not torch.equal(copy[n], s.aggregator.params[n]) for n in copy)  # the copy lags θ (int8)



class Pushes(NodeIds):
    """A Grid that also takes pushed messages (the strategy's own loop, `_begin_round`), keeping them."""

    def __init__(self, ids):
        super().__init__(ids)
        self.pushed: list[Message] = []

    def push_messages(self, messages):
        self.pushed += messages
        return [f"m{len(self.pushed) - len(messages) + i}" for i in range(len(messages))]


def relay_strategy(out: Path) -> tuple[LoRDOStrategy, Callable[[LoRDOStrategy, WorkerUpdate], bytes]]:
    """A DiLoCo strategy relaying top-k replies (`topk2bit-relay`, the `diloco-sparse` preset) after a
    round 1 the two good nodes answered, and how its nodes encode a reply (Δ top-k with error feedback)."""
    from lordo_fed.wire.compress import ErrorFeedback

    config = {k: v for k, v in RUN_CONFIG.items() if k not in ("preset", "outer", "outer-lr")}
    s = LoRDOStrategy(load_app_config({**config, "variant": "diloco", "preset": "diloco-sparse",
                                       "payload-dtype": "topk2bit-relay", "output-dir": str(out)}))
    codecs, ef = s.payload.codecs, ErrorFeedback()

    def relay_encode(s: LoRDOStrategy, u: WorkerUpdate) -> bytes:
        delta = {n: ef.compress(f"{u.worker_id}/{n}", t, codecs.delta_spec(n, tuple(t.shape)))[0]
                 for n, t in u.delta.items()}
        return bytes(encode_update(WorkerUpdate(u.worker_id, u.round, delta, {}, u.tokens, u.opt_step,
                                                metrics=u.metrics), s.model_id))
    payloads = {node: relay_encode(s, make_update(s, p, 1)) for node, p in GOOD.items()}
    _, metrics = s.aggregate_train(1, replies(s, 1, payloads))
    assert s.aggregator.round == ROUND and metrics["clients_ok"] == 2.0 and s._partitions == GOOD
    return s, relay_encode


def test_a_resumed_relay_leaves_each_nodes_own_reply_out_of_its_first_state(tmp_path):
    """The relay's node -> partition map is checkpointed: a server resumed after round 1 sends each node
    that replied its state without its own reply, byte for byte the state the uninterrupted server sends
    (a node it does not know, e.g. registered anew, gets the full state, as every node did before)."""
    from lordo_fed.app.records import payload_bytes

    s, _ = relay_strategy(tmp_path / "out")
    s._finish_round(1, None, 1.0, 0.1, 4, s.round_log)  # round 1's record and checkpoint
    resumed = LoRDOStrategy(load_app_config({**{k: v for k, v in RUN_CONFIG.items()
                                                 if k not in ("preset", "outer", "outer-lr")},
                                              "variant": "diloco", "preset": "diloco-sparse",
                                              "payload-dtype": "topk2bit-relay", "output-dir": str(tmp_path / "out"),
                                              "resume": str(tmp_path / "out" / "checkpoints")}))
    assert resumed.aggregator.round == ROUND and resumed._partitions == GOOD
    stranger = 105
    states = []
    for strategy, nodes in ((s, list(GOOD)), (resumed, [*GOOD, stranger])):
        messages = strategy.configure_train(ROUND, ArrayRecord(), ConfigRecord(), NodeIds(nodes))
        states.append({m.metadata.dst_node_id: bytes(payload_bytes(m.content["state"])) for m in messages})
    straight, after = states
    assert all(after[n] == straight[n] for n in GOOD)
    assert len({after[n] for n in GOOD}) == 2 and all(len(after[stranger]) > len(after[n]) for n in GOOD)


@pytest.mark.parametrize("payload", ["int8", "topk2bit-relay"])
def test_an_announced_compressed_round_gives_each_node_its_state_through_its_ticket(tmp_path, caplog, payload):
    """A compressed downlink on the gRPC data plane (int8: the change of θ_c; the relay: the replies the
    server applied, each node's own left out): round 3's tickets go out with round 2's messages, before
    any reply of round 2 is in; at round 3's publish each node downloads, through the ticket it holds,
    exactly what `configure_train` would have sent it in its message: its state (the change of θ_c, or
    the relayed replies without its own) for a node that replied to round 2, θ_c whole for one whose
    reply is an error (it could not apply round 2's state, `ResyncNeeded`) and for one that connected
    after the announcement; the round's log counts the largest state a replying node gets, as in an
    unannounced round, and marks when its messages went out."""
    from flwr.app import Error

    from lordo_fed.app.records import TICKET, UPLOAD_DIGEST, payload_bytes
    from lordo_fed.transport import client
    from lordo_fed.transport.server import DataPlaneServer
    from lordo_fed.v1 import dataplane_pb2 as dp
    from lordo_fed.wire.decode import decode_global_state
    from lordo_fed.wire.payload import resolve_payload

    if payload == "int8":
        s, encode_reply = new_strategy(tmp_path / "out", **{"payload-dtype": payload}), encode
    else:
        s, encode_reply = relay_strategy(tmp_path / "out")
    specs = resolve_payload(payload).downlink_specs
    late = 104
    grid = Pushes([*GOOD, HOSTILE_NODE])
    with DataPlaneServer(tmp_path / "spool") as plane:
        s.courier.data_plane = plane
        round2 = s._begin_round(ROUND, grid, timeout=5.0, num_rounds=4)
        assert s.courier.is_announced(ROUND + 1) and s.courier.announced_nodes(ROUND + 1) == {*GOOD, HOSTILE_NODE}
        ticket = (lambda m: dp.Ticket.FromString(m.content.config_records["config"][TICKET]))
        assert len(grid.pushed) == 6
        sent = {m.metadata.dst_node_id: ticket(m) for m in grid.pushed[:3]}
        announced = {m.metadata.dst_node_id: ticket(m) for m in grid.pushed[3:]}
        assert set(round2.values()) == set(sent) == set(announced) == {*GOOD, HOSTILE_NODE}
        assert all(t.round == ROUND and t.size > 0 for t in sent.values())
        assert all(t.round == ROUND + 1 and t.size == 0 and not t.digest for t in announced.values())
        # round 2: node 101 replies, node 102 could not apply the state (an error reply), the third replies
        answered = {101: 0, HOSTILE_NODE: HOSTILE_PARTITION}
        round2_replies = []
        for m in grid.pushed[:3]:
            node = m.metadata.dst_node_id
            if node not in answered:
                round2_replies.append(Message(Error(code=0, reason="ResyncNeeded: round 1's copy of θ is not held"),
                                              reply_to=m))
                continue
            digest = client.upload(sent[node], node, encode_reply(s, make_update(s, answered[node], ROUND))).digest
            round2_replies.append(Message(RecordDict({"upload": ConfigRecord({UPLOAD_DIGEST: digest}),
                                                      "metrics": MetricRecord({"client-seconds": 1.0,
                                                                               "train-seconds": 0.5})}),
                                          reply_to=m))
        _, metrics = s.aggregate_train(ROUND, round2_replies)
        assert metrics["clients_ok"] == 2.0 and s._acked == set(answered)
        # what each node would get in its message (Flower's own data plane), and what it downloads
        s.courier.data_plane = None
        nodes = [*GOOD, HOSTILE_NODE, late]
        messages = s.configure_train(ROUND + 1, ArrayRecord(), ConfigRecord(), NodeIds(nodes))
        want = {m.metadata.dst_node_id: payload_bytes(m.content["state"]) for m in messages}
        want_bytes = s.round_log.sent_bytes
        s.courier.data_plane = plane
        grid.ids.append(late)
        pushed = len(grid.pushed)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lordo_fed.server"):
            round3 = s._begin_round(ROUND + 1, grid, timeout=5.0, num_rounds=4)
        assert "round 3: nodes [102, 104] get θ whole (no reply from them last round)" in caplog.text
        assert s.round_log.sent_bytes == want_bytes == max(len(want[n]) for n in answered)
        assert s.round_log.marks["announced"] < s.round_log.marks["published"]  # its messages went out first
        rounds = [(m.metadata.dst_node_id, ticket(m).round) for m in grid.pushed[pushed:]]
        assert rounds == [(late, ROUND + 1)] + [(n, ROUND + 2) for n in nodes]  # round 4 is announced to all four
        assert sorted(round3.values()) == sorted(nodes)
        tickets = {**announced, late: ticket(grid.pushed[pushed])}
        assert tickets[late].size == len(want[late]) and s.courier.is_announced(ROUND + 2)
        copy = s.aggregator.client_copy()
        # θ_c as the server keeps it; a relaying server keeps none (each replay gives θ itself)
        before = {n: t.clone() for n, t in s.aggregator.client_params.items()} if payload == "int8" else None
        assert (s.aggregator.client_params is None) == (payload != "int8")
        for node in nodes:
            data = client.download(tickets[node], node, timeout=30)
            assert bytes(data) == want[node], node
            got = decode_global_state(data, s.model_id, codecs=specs)
            assert got.round == ROUND + 1
            if node not in answered:  # θ_c whole
                assert not got.params_delta and all(torch.equal(got.params[n], copy[n]) for n in copy)
            elif payload == "int8":  # the change of θ_c, which takes the node's copy to the server's
                assert got.params_delta and all(torch.equal(before[n] + got.params[n], copy[n]) for n in copy)
            else:  # the replies of round 2 but its own
                assert got.relay_own == answered[node] and not got.params
                assert [u.worker_id for u in got.relay] == sorted(set(answered.values()) - {answered[node]})
        s.courier.data_plane = None

def test_payload_larger_than_its_declared_size_is_dropped(tmp_path, caplog, good_only):
    def hostile(s, r):
        def grow(msg):
            msg.delta[0].data += b"\0" * 4096  # nbytes and shape unchanged

        return tamper(encode(s, make_update(s, HOSTILE_PARTITION, r)), grow)

    check_dropped(tmp_path, caplog, good_only, hostile, "payload larger than its declared size")


def test_a_second_reply_for_a_partition_is_dropped(tmp_path, caplog, good_only):
    """A node started with another node's partition-id sends a well-formed update for partition 0
    after node 101 did: the shard would count twice, so the second reply is dropped and the round
    is the twin's (good replies only); when it is the only reply for partition 0, it counts."""
    s = new_strategy(tmp_path / "out")
    payloads = {**good_payloads(s, ROUND), HOSTILE_NODE: encode(s, make_update(s, 0, ROUND, scale=2.0))}
    with caplog.at_level(logging.WARNING, logger="lordo_fed.server"):
        _, metrics = s.aggregate_train(ROUND, replies(s, ROUND, payloads))
    lines = dropped_lines(caplog, HOSTILE_NODE)
    assert len(lines) == 1 and lines[0].startswith(f"round {ROUND}: dropped reply of node {HOSTILE_NODE} (partition 0)")
    assert "partition) 0 already answered this round" in lines[0], lines[0]
    assert not dropped_lines(caplog, 101) and metrics["clients_ok"] == 2.0 and metrics["clients_dropped"] == 1.0
    assert_same_state(snapshot(s), good_only["after"])

    alone = new_strategy(tmp_path / "alone")  # the same reply without node 101's: nothing repeats
    payloads = {102: good_payloads(alone, ROUND)[102], HOSTILE_NODE: encode(alone, make_update(alone, 0, ROUND, 2.0))}
    _, metrics = alone.aggregate_train(ROUND, replies(alone, ROUND, payloads))
    assert metrics["clients_ok"] == 2.0 and metrics["clients_dropped"] == 0.0


def test_round0_gradient_replies_are_screened_and_named(tmp_path, caplog):
    """LoRDO-Global's round-0 exchange goes through the same gate: a NaN gradient and a second
    gradient for partition 0 are dropped with a line naming node, partition and reason, and the
    round-1 projections equal those fitted to the two good gradients alone."""
    s = LoRDOStrategy(load_app_config({**RUN_CONFIG, "output-dir": str(tmp_path / "out")}))
    agg = s.aggregator
    assert agg.needs_gradient_init
    g = torch.Generator().manual_seed(7)

    def gradient(partition: int) -> WorkerUpdate:
        delta = {n: torch.randn(agg.params[n].shape, generator=g) for n in sorted(agg.ranks)}
        return WorkerUpdate(worker_id=partition, round=0, delta=delta, moments={}, tokens=64, opt_step=0)

    good = {101: gradient(0), 102: gradient(1)}
    poisoned = gradient(2)
    first = sorted(poisoned.delta)[0]
    poisoned.delta[first][0, 0] = math.nan
    gradients = {**good, HOSTILE_NODE: poisoned, 104: gradient(0)}
    state = payload_record(b"round-0 request")
    replies = []
    for node, update in gradients.items():
        request = Message(RecordDict({"state": state}), dst_node_id=node, message_type=MessageType.QUERY)
        replies.append(Message(RecordDict({"update": payload_record(encode(s, update))}), reply_to=request))
    with caplog.at_level(logging.WARNING, logger="lordo_fed.server"):
        s.fit_initial_projections(replies, sent_bytes=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "lordo_fed.server"]
    assert lines == [
        "initial projections: dropped reply of node 104 (partition 0): worker (partition) 0 already answered this "
        "round; a second reply for it is refused (two nodes with the same partition-id?)",
        f"initial projections: dropped reply of node {HOSTILE_NODE} (partition 2): grad/{first}: contains NaN or Inf",
    ], lines
    twin = LoRDOStrategy(load_app_config({**RUN_CONFIG, "output-dir": str(tmp_path / "twin")})).aggregator
    twin.init_projections(list(good.values()))
    assert not agg.needs_gradient_init and set(agg.projections) == set(twin.projections)
    for name, p in twin.projections.items():
        assert torch.equal(agg.projections[name], p), name


def test_outlier_norm_is_dropped_by_the_configured_multiple_of_the_median(tmp_path, caplog):
    """outlier-factor=3: a reply 10x the round's median ||Δ|| is dropped and the round is the
    token-weighted aggregate of the other three; with outlier-factor=20 the same reply counts."""
    nodes = {101: 0, 102: 1, 105: 3}  # three good clients (the median needs at least three replies)

    def payloads(s):
        good = {node: encode(s, make_update(s, p, ROUND)) for node, p in nodes.items()}
        return {**good, HOSTILE_NODE: encode(s, make_update(s, HOSTILE_PARTITION, ROUND, scale=10.0))}

    s = new_strategy(tmp_path / "a")
    assert s.aggregator.outlier_factor == 3.0  # from the run-config key
    before = snapshot(s)
    with caplog.at_level(logging.WARNING, logger="lordo_fed.server"):
        _, metrics = s.aggregate_train(ROUND, replies(s, ROUND, payloads(s)))
    lines = dropped_lines(caplog, HOSTILE_NODE)
    assert len(lines) == 1 and f"node {HOSTILE_NODE} (partition {HOSTILE_PARTITION})" in lines[0]
    assert re.search(r"pseudo-gradient norm [\d.]+ > outlier_factor 3 x round median [\d.]+", lines[0]), lines[0]
    assert metrics["clients_ok"] == 3.0 and metrics["clients_dropped"] == 1.0

    twin = new_strategy(tmp_path / "twin")
    twin.aggregate_train(ROUND, replies(twin, ROUND, {n: d for n, d in payloads(twin).items() if n != HOSTILE_NODE}))
    after = snapshot(s)
    assert_same_state(after, snapshot(twin))
    theta, momentum = hand_computed(before, [make_update(s, p, ROUND) for p in nodes.values()])
    for n in theta:
        assert torch.equal(after[f"param/{n}"], theta[n]) and torch.equal(after[f"outer/momentum.{n}"], momentum[n]), n

    lenient = new_strategy(tmp_path / "b", **{"outlier-factor": 20.0})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lordo_fed.server"):
        _, metrics = lenient.aggregate_train(ROUND, replies(lenient, ROUND, payloads(lenient)))
    assert metrics["clients_ok"] == 4.0 and not dropped_lines(caplog, HOSTILE_NODE)


