"""The server's screening of data-plane replies (server/courier.py `Courier.screened`): a reply held
in the data plane's memory is decoded once, in place, and what the aggregator loads equals what the
node sent; a spilled reply is decoded once into a copy kept within `data-plane-memory-mb`, and past it
again on load, to the same values; a top-k reply is decoded once into its sparse values; nothing is
loaded after the block releases the upload buffers."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message, Metadata, RecordDict

from lordo_fed.app.config import load_app_config
from lordo_fed.app.records import UPLOAD_DIGEST
from lordo_fed.transport import client
from lordo_fed.transport.server import DataPlaneServer
from lordo_fed.wire.encode import encode_update
from lordo_fed.wire.messages import WorkerUpdate
from lordo_fed.wire.payload import resolve_payload
from server.courier import Courier
from server.records import RoundLog

MODEL = "test-model"
NODES = (11, 12, 13)


def update_of(worker: int) -> WorkerUpdate:
    g = torch.Generator().manual_seed(worker)
    return WorkerUpdate(worker_id=worker, round=1, tokens=100 + worker, opt_step=32,
                        delta={"w": torch.randn(64, 48, generator=g), "b": torch.randn(48, generator=g)},
                        moments={"exp_avg_sq/w": torch.rand(16, 48, generator=g)})


def reply(node: int, digest: str) -> Message:
    """A reply as the SuperLink hands it to the ServerApp: the node's id, the digest it vouches for."""
    meta = Metadata(run_id=1, message_id=f"r{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="m",
                    group_id="1", created_at=0.0, ttl=60.0, message_type="train")
    return Message(metadata=meta, content=RecordDict({"upload": ConfigRecord({UPLOAD_DIGEST: digest})}))


@pytest.mark.parametrize("budget,memory_mb", [(1 << 30, 1024), (0, 1024), (0, 0)],
                         ids=["in-memory", "spilled", "spilled-no-room-to-keep"])
def test_replies_load_as_sent_decoded_once_within_the_budget(tmp_path, budget, memory_mb):
    """fp32 replies: held in the data plane's memory, each decodes once, in place; spilled to disk, once
    into a copy the ref keeps while `data-plane-memory-mb` has room for it, else again at each load."""
    cfg = load_app_config({"data-plane-memory-mb": memory_mb}, tmp_path)
    courier = Courier(cfg, (), model_id=MODEL, payload=resolve_payload("fp32"), max_upload=1 << 20, spool=tmp_path)
    sent = {node: update_of(i) for i, node in enumerate(NODES)}
    decodes = []
    decode = courier.decode
    courier.decode = lambda payload, adopt=False, **kw: decodes.append(adopt) or decode(payload, adopt, **kw)
    once = budget > 0 or memory_mb > 0
    with DataPlaneServer(tmp_path / "spool", memory_budget=budget) as plane:
        courier.data_plane = plane
        tickets = plane.publish(1, b"state", NODES, ttl=60, max_upload=1 << 20)
        replies = [reply(node, client.upload(tickets[node], node, encode_update(sent[node], MODEL)).digest) for node in NODES]
        with courier.screened(replies, 1, "round 1", lambda u: (None, float(u.delta["w"].norm())),
                              lambda ids, norms, reasons: list(reasons), RoundLog()) as usable:
            assert len(usable) == len(NODES) and len(decodes) == len(NODES)
            refs = [ref for ref, _, _ in usable]
            for ref in refs:
                got = ref.load()
                want = sent[NODES[ref.worker_id]]
                assert got.tensors().keys() == want.tensors().keys()
                for name, t in want.tensors().items():
                    assert torch.equal(got.tensors()[name], t), name
                assert (ref.load() is got) == once  # the screening's own decode
            # one decode per reply, on arrival; with no room to keep it, again at each load
            assert len(decodes) == len(NODES) * (1 if once else 3)
        if once:
            with pytest.raises(RuntimeError, match="loaded after its screening block ended"):
                refs[0].load()
        courier.data_plane = None


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["in-memory", "spilled"])
def test_a_relaying_server_reads_each_reply_as_the_node_sent_it(tmp_path, budget):
    """`topk2bit-relay`: inside the screening block each usable ref also gives its reply with the
    compressed tensors as received (`ReplyRef.relayed`), which encodes back to the bytes the node
    uploaded, whether the upload is held in memory or spilled to disk."""
    from lordo_fed.wire.compress import Encoded, ErrorFeedback

    payload = resolve_payload("topk2bit-relay")
    cfg = load_app_config({}, tmp_path)
    courier = Courier(cfg, (), model_id=MODEL, payload=payload, max_upload=1 << 20, spool=tmp_path)
    ef = ErrorFeedback()
    raw = {}
    for i, node in enumerate(NODES):
        u = update_of(i)
        delta = {n: ef.compress(f"{i}/{n}", t, payload.codecs.delta_spec(n, tuple(t.shape)))[0] for n, t in u.delta.items()}
        raw[node] = bytes(encode_update(WorkerUpdate(i, 1, delta, {}, u.tokens, u.opt_step), MODEL))
    with DataPlaneServer(tmp_path / "spool", memory_budget=budget) as plane:
        courier.data_plane = plane
        tickets = plane.publish(1, b"state", NODES, ttl=60, max_upload=1 << 20)
        replies = [reply(node, client.upload(tickets[node], node, raw[node]).digest) for node in NODES]
        with courier.screened(replies, 1, "round 1", lambda u: (None, 1.0), lambda ids, norms, reasons: list(reasons),
                              RoundLog()) as usable:
            for ref, _, _ in usable:
                kept = ref.relayed()
                assert all(isinstance(t, Encoded) for t in kept.delta.values())
                assert bytes(encode_update(kept, MODEL)) == raw[NODES[ref.worker_id]]
        courier.data_plane = None


def test_each_node_downloads_the_relaying_state_without_its_own_reply(tmp_path):
    """`topk2bit-relay` on the data plane: the screening maps each node to its reply's partition
    (`RoundLog.partitions`); the next state, made for each node (`relay.for_worker`) and published as its own
    (`Courier.outgoing(own=...)`), is what that node downloads, leaving out exactly its reply; a node with no
    state of its own downloads the round's, all three replies."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    from lordo_fed.app.records import TICKET
    from lordo_fed.rounds.relay import for_worker, relayed_form
    from lordo_fed.v1 import dataplane_pb2 as dp
    from lordo_fed.wire.compress import ErrorFeedback
    from lordo_fed.wire.decode import decode_global_state
    from lordo_fed.wire.encode import encode_global_state
    from lordo_fed.wire.messages import GlobalState

    payload = resolve_payload("topk2bit-relay")
    courier = Courier(load_app_config({}, tmp_path), (), model_id=MODEL, payload=payload, max_upload=1 << 20,
                      spool=tmp_path)
    ef, raw = ErrorFeedback(), {}
    for i, node in zip((2, 0, 1), NODES):  # partitions in another order than the nodes
        u = update_of(i)
        delta = {n: ef.compress(f"{i}/{n}", t, payload.codecs.delta_spec(n, tuple(t.shape)))[0] for n, t in u.delta.items()}
        raw[node] = bytes(encode_update(WorkerUpdate(i, 1, delta, {}, u.tokens, u.opt_step), MODEL))
    rl = RoundLog()
    with DataPlaneServer(tmp_path / "spool") as plane:
        courier.data_plane = plane
        tickets = plane.publish(1, b"state", NODES, ttl=60, max_upload=1 << 20)
        replies = [reply(node, client.upload(tickets[node], node, raw[node]).digest) for node in NODES]
        with courier.screened(replies, 1, "round 1", lambda u: (None, 1.0), lambda ids, norms, reasons: list(reasons),
                              rl) as usable:
            relayed = [relayed_form(ref.relayed()) for ref, _, _ in usable]
        assert rl.partitions == {11: 2, 12: 0, 13: 1}
        state = GlobalState(round=2, params={}, params_delta=True, relay=relayed, outer_lr=1.0)
        full = encode_global_state(state, MODEL)
        own = {n: encode_global_state(for_worker(state, rl.partitions[n]), MODEL) for n in NODES[:2]}
        saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 42, SUPERLINK_NODE_ID  # as in a ServerApp
        try:
            messages = courier.outgoing(2, full, NODES, "train", own)
        finally:
            TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
        specs = payload.downlink_specs
        for msg in messages:
            node = msg.metadata.dst_node_id
            data = client.download(dp.Ticket.FromString(msg.content.config_records["config"][TICKET]), node)
            got = decode_global_state(data, MODEL, codecs=specs)
            if node in own:
                assert data == bytes(own[node]) and got.relay_own == rl.partitions[node]
                assert [u.worker_id for u in got.relay] == sorted({0, 1, 2} - {rl.partitions[node]})
            else:
                assert data == bytes(full) and got.relay_own is None and [u.worker_id for u in got.relay] == [0, 1, 2]
        courier.data_plane = None


@pytest.mark.parametrize("memory_mb", [1024, 0], ids=["kept", "past-the-budget"])
def test_top_k_replies_are_decoded_once_and_load_as_their_dense_decode(tmp_path, memory_mb):
    """`diloco-sparse`'s wire (every tensor top-k): each reply is decoded once, on arrival, into
    `SparseValues` the ref keeps; with no room for them (`data-plane-memory-mb=0`) each load decodes
    again. Either way, what a load gives, densified, is the dense decode of the bytes the node sent."""
    from lordo_fed.wire.compress import ErrorFeedback, SparseValues
    from lordo_fed.wire.decode import decode_update

    payload = resolve_payload("topk2bit-both-wide")
    cfg = load_app_config({"data-plane-memory-mb": memory_mb}, tmp_path)
    courier = Courier(cfg, (), model_id=MODEL, payload=payload, max_upload=1 << 20, spool=tmp_path)
    raw = {}
    for i, node in enumerate(NODES):
        u = update_of(i)
        delta = {n: ErrorFeedback().compress(n, t, payload.codecs.delta_spec(n, tuple(t.shape)))[0]
                 for n, t in u.delta.items()}
        raw[node] = bytes(encode_update(WorkerUpdate(i, 1, delta, {}, u.tokens, u.opt_step), MODEL))
    decodes = []
    decode = courier.decode
    courier.decode = lambda payload, adopt=False, **kw: decodes.append(kw) or decode(payload, adopt, **kw)
    with DataPlaneServer(tmp_path / "spool") as plane:
        courier.data_plane = plane
        tickets = plane.publish(1, b"state", NODES, ttl=60, max_upload=1 << 20)
        replies = [reply(node, client.upload(tickets[node], node, raw[node]).digest) for node in NODES]
        with courier.screened(replies, 1, "round 1", lambda u: (None, 1.0), lambda ids, norms, reasons: list(reasons),
                              RoundLog()) as usable:
            assert len(usable) == len(NODES)
            for ref, _, _ in usable:
                dense = decode_update(raw[NODES[ref.worker_id]], MODEL, codecs=payload.receiver_specs)
                got = ref.load()
                assert all(isinstance(t, SparseValues) for t in got.delta.values())
                assert got.delta.keys() == dense.delta.keys()
                for name, t in dense.delta.items():
                    assert torch.equal(got.delta[name].dense(), t), name
                assert (ref.load() is got) == (memory_mb > 0)
        assert all(kw == {"sparse": True} for kw in decodes)
        assert len(decodes) == len(NODES) * (1 if memory_mb else 3)
        courier.data_plane = None
