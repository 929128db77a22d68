"""Issue 30's option B: the server relays the round's replies and every worker replays the round.

The oracle of a relayed run is the same run with the same uplink and θ sent whole in fp32: the
replay must give every worker the server's θ bit for bit, so the two runs are one run."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from lordo_fed.checkpoint import load_checkpoint, save_checkpoint
from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.downlink import Downlink, ResyncNeeded
from lordo_fed.rounds.outer import Average, Nesterov
from lordo_fed.trainer.run import as_received
from lordo_fed.wire.compress import ErrorFeedback, SparseValues
from lordo_fed.wire.decode import decode_global_state
from lordo_fed.wire.encode import encode_global_state, encode_update
from lordo_fed.metrics import tensor_bytes
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.payload import PRESETS, resolve_payload

RELAY = resolve_payload("topk2bit-relay").codecs
NAMES = {"layers.0.wq.weight": (64, 96), "embed.weight": (40, 16), "norm.weight": (16,)}


def rounds_config(**kw) -> RoundConfig:
    return RoundConfig(local_steps=1, sync_exp_avg_every=0, sync_exp_avg_sq_every=0, **kw)


def replies(round_idx: int, feedback: list[ErrorFeedback], tokens=(300, 100, 200), gen=None,
            codecs=RELAY) -> list[WorkerUpdate]:
    """One round of compressed replies as workers send them: heavy-tailed Δ, top-k as `codecs` sends it (2-bit by default)
    with each worker's error feedback (what `Uplink` does), one reply per worker."""
    out = []
    for m, n in enumerate(tokens):
        delta = {name: torch.distributions.StudentT(3.0).sample(shape) * 1e-2 for name, shape in NAMES.items()}
        sent = {name: feedback[m].compress(name, d, codecs.delta_spec(name, d.shape))[0] for name, d in delta.items()}
        out.append(WorkerUpdate(worker_id=m, round=round_idx, delta=sent, moments={}, tokens=n, opt_step=round_idx))
    return out


@pytest.mark.parametrize("mean,clip,late_lr,preset", [("all", False, 0.0, "topk2bit-relay"),
                                                      ("contributors", False, 0.0, "topk2bit-relay"),
                                                      ("contributors", True, 0.0, "topk2bit-relay"),
                                                      ("all", False, 2.0, "topk2bit-relay"),
                                                      ("all", False, 0.0, "topk1bit-relay")])
def test_every_worker_replays_the_servers_theta_bit_for_bit(mean, clip, late_lr, preset):
    """Four rounds of mocked compressed replies through the real aggregator (outer average, lr 1.3):
    from round 2 each state carries the last round's replies, not θ, and a worker's copy after the
    replay equals the server's θ exactly; a worker that missed a round is refused the relay and
    gets θ whole (`resync_state`); a skipped round relays nothing and θ stays. With a late outer lr
    from round 3 on (`outer.late_lr`), the state relaying round 3 carries it and the replay follows."""
    torch.manual_seed(0)
    codecs = resolve_payload(preset).codecs
    rc = rounds_config(sparse_mean=mean, clip_median=clip, late_from_step=2 if late_lr else 0)
    theta0 = {name: torch.randn(shape) for name, shape in NAMES.items()}
    agg = Aggregator(theta0, {}, rc, Average(lr=1.3), None, payload=codecs, late_lr=late_lr)
    workers = [Downlink(codecs, rc) for _ in range(3)]
    feedback = [ErrorFeedback(decay=0.9) for _ in range(3)]
    for r in range(1, 6):
        state = agg.global_state()
        assert state.params_delta == (r > 1) and bool(state.params) == (r == 1)
        if r == 5:  # round 4 was skipped: nothing to replay
            assert state.params_delta and state.relay == []
        elif r > 1:
            assert [u.worker_id for u in state.relay] == [0, 1, 2]
            assert state.outer_lr == (late_lr if late_lr and r - 1 >= 3 else 1.3)  # the relayed round's lr
            assert all(not u.moments for u in state.relay)
        for m, w in enumerate(workers):
            if r == 3 and m == 2:  # worker 2 missed round 2: it holds round 1's copy
                with pytest.raises(ResyncNeeded, match="round 3"):
                    w.theta(state, NAMES)
                theta = w.theta(agg.resync_state(), NAMES)
            else:
                theta = w.theta(state, NAMES)
            assert all(torch.equal(theta[n], agg.params[n]) for n in NAMES), (r, m)
            if r == 2 and m == 2:
                w.round = 0  # forget round 2 (its reply did not arrive)
        if r == 4:
            agg.skip_round()
            continue
        sent = replies(r, feedback, codecs=codecs)
        before = {n: p.clone() for n, p in agg.params.items()}
        agg.aggregate([as_received(u, sparse=True) for u in sent], relay={u.worker_id: u for u in sent})
        assert any(not torch.equal(before[n], agg.params[n]) for n in NAMES)  # θ moved
    assert agg.round == 6


@pytest.mark.parametrize("mean,clip", [("all", False), ("contributors", False), ("contributors", True)])
def test_each_node_gets_the_state_without_its_own_reply_and_replays_the_servers_theta(mean, clip):
    """Five rounds of mocked replies (round 3 given up), each worker's state made for it (`for_worker`) and
    sent through the wire: it relays the other workers' replies only, is smaller than the full state by
    exactly its own reply's bytes (less the two fields that name it), and the worker, which kept the
    reply it sent (`keep_reply`), replays the server's θ bit for bit, the full state's replay too."""
    from lordo_fed.rounds.relay import for_worker
    from lordo_fed.wire.protowire import WT_LEN, key, varint

    torch.manual_seed(0)
    rc = rounds_config(sparse_mean=mean, clip_median=clip)
    agg = Aggregator({name: torch.randn(shape) for name, shape in NAMES.items()}, {}, rc, Average(lr=1.3), None,
                     payload=RELAY)
    workers = [Downlink(RELAY, rc) for _ in range(3)]
    feedback = [ErrorFeedback(decay=0.9) for _ in range(3)]
    for r in range(1, 6):
        state = agg.global_state()
        full = bytes(encode_global_state(state, "m"))
        for m, w in enumerate(workers):
            own = for_worker(state, m)
            data = bytes(encode_global_state(own, "m"))
            if r in (1, 4):  # θ whole; after the skipped round 3, nothing relayed: the state is the same
                assert own is state and data == full
            else:
                assert [u.worker_id for u in own.relay] == [i for i in range(3) if i != m] and own.relay_own == m
                reply = bytes(encode_update(state.relay[m], "m"))
                field = key(11, WT_LEN) + varint(len(reply)) + reply
                assert len(full) - len(data) == len(field) - len(key(13, 0) + varint(m + 1) + key(14, WT_LEN) + varint(32)) - 32
                assert tensor_bytes(state.tensors()) - tensor_bytes(own.tensors()) == tensor_bytes(state.relay[m].delta)
            got = decode_global_state(data, "m", codecs=RELAY.down_specs())
            assert (got.relay_own, got.relay_own_digest) == (own.relay_own, own.relay_own_digest)
            theta = w.theta(got, NAMES)
            assert all(torch.equal(theta[n], agg.params[n]) for n in NAMES), (r, m)
        if r == 3:
            agg.skip_round()
            continue
        sent = replies(r, feedback)
        for w, u in zip(workers, sent):
            w.keep_reply(u)
        agg.aggregate([as_received(u, sparse=True) for u in sent], relay={u.worker_id: u for u in sent})


def test_a_worker_without_the_reply_left_out_needs_theta_whole():
    """A state leaves out worker 0's reply: a worker that kept none, kept another round's, or one whose
    bytes differ from what the server relayed (the digest) is refused (`ResyncNeeded`, naming why) and
    gets θ whole (`resync_state`); a state for a worker whose reply was not applied is the full one."""
    from lordo_fed.rounds.relay import for_worker

    rc = rounds_config()
    agg = Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(), None, payload=RELAY)
    fb = [ErrorFeedback() for _ in range(3)]
    first = agg.global_state()
    first = dataclasses.replace(first, params={n: p.clone() for n, p in first.params.items()})  # θ0, not agg's θ
    sent1 = replies(1, fb)
    agg.aggregate([as_received(u) for u in sent1], relay={u.worker_id: u for u in sent1})
    sent2 = replies(2, fb)
    mine = agg.global_state()
    agg.aggregate([as_received(u) for u in sent2[1:]], relay={u.worker_id: u for u in sent2[1:]})
    state = for_worker(agg.global_state(), 1)  # round 3's, for worker 1 (worker 0's reply was not applied)
    assert for_worker(agg.global_state(), 0) is agg.global_state()
    tampered = dataclasses.replace(sent2[1], delta={**sent2[1].delta, "norm.weight": sent2[0].delta["norm.weight"]})
    for kept, why in ((None, "this node kept no reply"), (sent1[1], "this node kept worker 1's reply of round 1"),
                      (sent2[0], "this node kept worker 0's reply of round 2"), (tampered, "the reply this node kept has digest")):
        w = Downlink(RELAY, rc)
        w.theta(first, NAMES)
        w.keep_reply(sent1[1])
        w.theta(for_worker(mine, 1), NAMES)  # round 2's, which leaves out its round-1 reply
        w.own = None
        if kept is not None:
            w.keep_reply(kept)
        with pytest.raises(ResyncNeeded, match=rf"round 3: the state leaves out worker 1's reply of round 2; {why}"):
            w.theta(state, NAMES)
        theta = w.theta(agg.resync_state(), NAMES)
        assert all(torch.equal(theta[n], agg.params[n]) for n in NAMES)
    w = Downlink(RELAY, rc)  # the control: the reply it sent, kept
    w.theta(first, NAMES)
    w.keep_reply(sent1[1])
    w.theta(for_worker(mine, 1), NAMES)
    w.keep_reply(sent2[1])
    theta = w.theta(state, NAMES)
    assert all(torch.equal(theta[n], agg.params[n]) for n in NAMES)


def test_the_kept_reply_is_saved_with_the_workers_state():
    """`Downlink.state_dict` and the flat state of a node store (`worker_state`) keep the reply kept, byte for
    byte; a state dict without it holds none; one of another dtype is refused, naming it."""
    from lordo_fed.rounds import worker_state
    from lordo_fed.rounds.downlink import OWN_REPLY
    from lordo_fed.rounds.relay import relayed_form, reply_bytes

    w = Downlink(RELAY, rounds_config())
    sent = replies(1, [ErrorFeedback() for _ in range(3)])[2]
    sent.moments["exp_avg/norm.weight"] = torch.ones(16)  # sent, not relayed: not kept
    w.keep_reply(sent)
    assert bytes(w.own.numpy()) == bytes(reply_bytes(relayed_form(sent)))
    sd = {"optimizer": {"state": {}, "param_groups": []}, "cursor": torch.tensor(3), "wire_ef": {}, **w.state_dict()}
    back = Downlink(RELAY, rounds_config())
    back.load_state_dict(worker_state.unflatten(*worker_state.flatten(sd)))
    assert torch.equal(back.own, w.own) and back.own.data_ptr() != w.own.data_ptr()
    back.load_state_dict({"client": {}, "client_round": torch.tensor(0)})
    assert back.own is None and OWN_REPLY not in back.state_dict()
    with pytest.raises(ValueError, match=r"worker state: own_reply is a torch.float32 tensor of shape \(4,\)"):
        back.load_state_dict({OWN_REPLY: torch.zeros(4)})
    plain = Downlink(resolve_payload("topk2bit").codecs, rounds_config())
    plain.keep_reply(sent)
    assert plain.own is None  # only a relaying payload keeps it


@pytest.mark.parametrize("store", ["disk", "context"])
def test_a_worker_restarted_from_its_store_replays_the_state_without_its_reply(tmp_path, store):
    """A real relaying worker saves its state after round 1 in a node store (`DiskStore`, or Flower's
    `Context.state`: `ContextStore`); a new worker loaded from it holds the reply it sent, byte for byte, and
    replays round 2's state made for it (its reply left out) to the server's θ bit for bit."""
    from flwr.app import Context, RecordDict

    from client.state import ContextStore
    from lordo_fed.node.store import DiskStore
    from lordo_fed.rounds.relay import for_worker
    from tests.unit.test_sparse_wire import downlink_bases_run

    run, workers, agg = downlink_bases_run(tmp_path, payload="topk2bit-relay", bases_from="server")
    state = agg.global_state()
    updates = [w.train_round(state) for w in workers]
    agg.aggregate([as_received(u) for u in updates], relay={u.worker_id: u for u in updates})
    saved = DiskStore(tmp_path / "store", 0) if store == "disk" else ContextStore(
        Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={}))
    saved.save(1, *workers[0].flat_state())
    restarted = downlink_bases_run(tmp_path / "again", payload="topk2bit-relay", bases_from="server")[1][0]
    restarted.load_flat_state(*saved.load(1))
    assert torch.equal(restarted.downlink.own, workers[0].downlink.own)
    theta = restarted.downlink.theta(for_worker(agg.global_state(), 0), restarted.params)
    assert all(torch.equal(theta[n], agg.params[n]) for n in agg.params)


def after_one_round() -> tuple[Aggregator, Downlink]:
    """A relaying aggregator after round 1's three replies, and a worker that applied round 1's state."""
    rc = rounds_config()
    agg = Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(), None, payload=RELAY)
    w = Downlink(RELAY, rc)
    w.theta(agg.global_state(), NAMES)
    sent = replies(1, [ErrorFeedback() for _ in range(3)])
    agg.aggregate([as_received(u, sparse=True) for u in sent], relay={u.worker_id: u for u in sent})
    return agg, w


def test_a_relayed_state_after_a_skipped_round_carries_nothing_and_theta_stays():
    agg, w = after_one_round()
    w.theta(agg.global_state(), NAMES)
    agg.skip_round()
    state = agg.global_state()
    assert state.params_delta and state.relay == [] and state.round == 3
    theta = w.theta(state, NAMES)
    assert all(torch.equal(theta[n], agg.params[n]) for n in NAMES)


def run_relayed(agg: Aggregator, rounds: dict[int, list[WorkerUpdate]], which, skip: int = 4):
    """Rounds `which` of a relayed run on `agg` (round `skip` given up): {round: (its state as sent, θ after it)}."""
    out = {}
    for r in which:
        data = bytes(encode_global_state(agg.global_state(), "m", "fp32"))
        if r == skip:
            agg.skip_round()
        else:
            agg.aggregate([as_received(u) for u in rounds[r]], relay={u.worker_id: u for u in rounds[r]})
        out[r] = (data, {n: p.clone() for n, p in agg.params.items()})
    return out


@pytest.mark.parametrize("late_lr", [0.0, 2.0])
def test_a_resumed_run_relays_on_as_the_uninterrupted_one(tmp_path, late_lr):
    """The checkpoint keeps the replies the next state relays: a run resumed after round 2, or after the
    skipped round 4 (through the checkpoint's files), sends the uninterrupted run's states byte for byte,
    relayed, not θ whole, and ends at its θ bit for bit; a worker that held θ_c replays them to it. With a
    late outer lr from round 3 on, the run resumed after round 2 takes it from there as the uninterrupted one.
    The server keeps no θ_c of its own (every replay gives θ), so the checkpoint holds θ once; a checkpoint
    written before that (θ_c under client/ beside θ) resumes to the same states and θ."""
    rc = rounds_config(late_from_step=2 if late_lr else 0)
    fresh = lambda: Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(lr=1.3), None,
                               payload=RELAY, late_lr=late_lr)
    torch.manual_seed(0)
    fb = [ErrorFeedback(decay=0.9) for _ in range(3)]
    rounds = {r: replies(r, fb) for r in range(1, 7)}  # mocked replies: the same for every run
    agg = fresh()
    golden = {}
    for at in (2, 4):
        golden.update(run_relayed(agg, rounds, range(len(golden) + 1, at + 1)))
        save_checkpoint(tmp_path / f"r{at}", at, agg.state_dict(), {"round": at})
    golden.update(run_relayed(agg, rounds, range(5, 7)))
    for (at, relayed), older in itertools.product(((2, 3), (4, 0)), (False, True)):
        tensors, _ = load_checkpoint(tmp_path / f"r{at}")
        assert int(tensors["counter/relayed"]) == relayed
        assert not any(k.startswith("client/") for k in tensors)  # θ is θ_c once replayed: no second copy kept
        if older:  # as an earlier version wrote it, with the server's θ_c (zeros here: used, they would show)
            tensors.update({f"client/{n}": torch.zeros_like(tensors[f"param/{n}"]) for n in NAMES})
        resumed = fresh()
        resumed.load_state_dict(tensors)
        worker = Downlink(RELAY, rc)
        for r in range(1, at + 1):  # the worker applied every state before the server stopped
            worker.theta(decode_global_state(golden[r][0], "m", codecs=RELAY.down_specs()), NAMES)
        for r, (data, theta) in run_relayed(resumed, rounds, range(at + 1, 7)).items():
            assert data == golden[r][0], r
            state = decode_global_state(data, "m", codecs=RELAY.down_specs())
            assert state.params_delta and not state.params and len(state.relay) == (0 if r == 5 else 3), r
            assert all(torch.equal(theta[n], golden[r][1][n]) for n in NAMES), r
            replayed = worker.theta(state, NAMES)
            before = golden[r - 1][1]  # the state of round r carries θ after round r - 1
            assert all(torch.equal(replayed[n], before[n]) for n in NAMES), r


def test_a_checkpoint_without_relayed_replies_sends_theta_whole_once_and_a_bad_one_is_refused():
    """A checkpoint of an older version (no relayed replies in it): the first state after the resume carries
    θ whole, the next relays again. A checkpoint whose relayed bytes are damaged is refused, naming them."""
    rc = rounds_config()
    agg = Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(), None, payload=RELAY)
    fb = [ErrorFeedback() for _ in range(3)]
    for r in (1, 2):
        agg.global_state()
        sent = replies(r, fb)
        agg.aggregate([as_received(u, sparse=True) for u in sent], relay={u.worker_id: u for u in sent})
    sd = agg.state_dict()
    old = {k: v for k, v in sd.items() if not k.startswith("relay/") and k != "counter/relayed"}
    resumed = Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(), None, payload=RELAY)
    resumed.load_state_dict(old)
    state = resumed.global_state()
    assert not state.params_delta and not state.relay
    assert all(torch.equal(state.params[n], agg.params[n]) for n in NAMES)
    w = Downlink(RELAY, rc)
    w.theta(state, NAMES)
    sent = replies(3, fb)
    resumed.aggregate([as_received(u, sparse=True) for u in sent], relay={u.worker_id: u for u in sent})
    state = resumed.global_state()
    assert state.params_delta and len(state.relay) == 3
    theta = w.theta(state, NAMES)
    assert all(torch.equal(theta[n], resumed.params[n]) for n in NAMES)
    damaged = dict(sd)
    damaged["relay/1"] = sd["relay/1"][:-7].clone()
    with pytest.raises(ValueError, match=r"checkpoint: relay/1: "):
        resumed.load_state_dict(damaged)
    with pytest.raises(ValueError, match=r"relay/2 is missing; expected the bytes of relayed reply 2 of 3"):
        resumed.load_state_dict({k: v for k, v in sd.items() if k != "relay/2"})
    swapped = {**sd, "relay/0": sd["relay/1"], "relay/1": sd["relay/0"]}
    with pytest.raises(ValueError, match=r"relay/1: worker 0 after worker 1 \(expected each worker once"):
        resumed.load_state_dict(swapped)


def test_a_relay_needs_every_applied_reply_and_the_plain_average():
    rc = rounds_config()
    with pytest.raises(ValueError, match=r"outer='nesterov' with a relaying payload.*outer.name='average'"):
        Aggregator({"w": torch.zeros(4)}, {}, rc, Nesterov(lr=0.7, momentum=0.9), None, payload=RELAY)
    agg = Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(), None, payload=RELAY)
    sent = replies(1, [ErrorFeedback() for _ in range(3)])
    with pytest.raises(ValueError, match=r"round 1: a relaying payload needs every applied reply as received; "
                                         r"none given for worker\(s\) \[2\]"):
        agg.aggregate([as_received(u, sparse=True) for u in sent], relay={u.worker_id: u for u in sent[:2]})
    assert agg.round == 1 and all(not p.any() for p in agg.params.values())  # nothing applied
    with pytest.raises(ValueError, match="relaying a round's replies needs synchronous rounds"):
        resolve_payload("topk2bit-relay").check_method(False, asynchronous=True)


def test_a_relayed_state_with_a_bad_outer_lr_is_refused():
    agg, w = after_one_round()
    bad = dataclasses.replace(agg.global_state(), outer_lr=float("nan"))
    with pytest.raises(ValueError, match=r"round 2: a relayed state with outer_lr=nan"):
        w.theta(bad, NAMES)


@pytest.mark.parametrize("method,overrides", [
    ("diloco", dict(diloco_outer=("average", 1.3), sparse_mean="contributors")),
    ("lordo_global", dict()),
    ("lordo_global", dict(overlap_delay=1)),
])
def test_a_relayed_run_is_the_run_with_theta_sent_whole(tmp_path, monkeypatch, method, overrides):
    """The reference trainer, three workers, four rounds: `topk2bit-relay` against the same uplink with
    θ down fp32 whole (a preset made here: the oracle), and against itself with every worker sent all three
    replies (no `for_worker`). Same θ at every evaluation and at the end, bit for bit; the relay's bytes
    down are fewer than θ's, and each worker's own state is the full one less the worker's own reply."""
    import lordo_fed.trainer.run as trainer

    from lordo_fed.rounds.outer import OuterConfig
    from tests.unit.test_trainer import context, tiny_config
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.trainer.run import run_rounds

    monkeypatch.setitem(PRESETS, "topk2bit-exact-down", dataclasses.replace(RELAY, relay=False))
    outer = overrides.pop("diloco_outer", None)
    rc = RoundConfig(local_steps=2, sync_exp_avg_every=0, sync_exp_avg_sq_every=0, wire_ef_decay=0.9, **overrides)
    runs = {}
    for payload in ("topk2bit-relay", "topk2bit-exact-down", "all-replies"):
        if payload == "all-replies":
            monkeypatch.setattr(trainer, "for_worker", lambda state, worker_id: state)
        cfg = tiny_config(tmp_path / payload, workers=3, total_steps=8, eval_every=1, rounds=rc,
                          payload_dtype="topk2bit-relay" if payload == "all-replies" else payload)
        cfg.inner.init_projection = "random"
        if outer:
            cfg.diloco_outer = OuterConfig(name=outer[0], lr=outer[1])
        records: list = []
        settings = resolve_method(method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
        torch.manual_seed(0)
        model = run_rounds(context(cfg, records), settings)
        runs[payload] = ({n: p.detach().clone() for n, p in model.named_parameters()},
                         [r for r in records if "val_loss" in r])
    (relayed, curve), (exact, oracle), (every, full) = runs["topk2bit-relay"], runs["topk2bit-exact-down"], runs["all-replies"]
    assert all(torch.equal(relayed[n], exact[n]) and torch.equal(every[n], exact[n]) for n in exact)
    # each worker's state is the full one less its own reply (its Δ: no moments are due), the largest one's
    # less the smallest reply: the round before's bytes up, the largest reply's, within the replies' spread
    own = [r["bytes_received_per_worker"] for r in curve[2:]]
    whole = [r["bytes_received_per_worker"] for r in full[2:]]
    up = [r["bytes_sent_per_worker"] for r in curve[1:-1]]
    assert all(0.95 * u < w - d <= u for d, w, u in zip(own, whole, up)), (own, whole, up)
    assert [r["val_loss"] for r in curve] == [r["val_loss"] for r in oracle] and len(curve) == 5
    assert curve[-1]["val_loss"] < curve[0]["val_loss"]  # it trained
    down = [r["bytes_received_per_worker"] for r in curve[1:]]
    dense = [r["bytes_received_per_worker"] for r in oracle[1:]]
    assert down[0] == dense[0]  # round 1: θ whole either way
    assert all(0 < d < e for d, e in zip(down[1:], dense[1:]))


def test_workers_fit_the_bases_to_the_replayed_change_and_agree(tmp_path):
    """`bases_from='downlink'` with a relay: every worker fits each low-rank matrix's basis to the change
    of θ it replayed, which is the server's θ_r − θ_(r−1) exactly (the oracle: that change, taken from
    the server, fitted here alone); all three workers agree."""
    from lordo_fed.optim.projection import get_projection_method, projection_side
    from lordo_fed.rounds.bases import fit_projections
    from tests.unit.test_sparse_wire import downlink_bases_run

    run, workers, agg = downlink_bases_run(tmp_path, bases_from="downlink", payload="topk2bit-relay")
    method = get_projection_method("svd")
    before = None
    for r in range(1, 4):
        state = agg.global_state()
        updates = [w.train_round(state) for w in workers]
        if r > 1:
            change = {n: agg.params[n] - before[n] for n in run.ranks}
            expected = fit_projections(change, run.ranks, method, seed=7919 * (r - 1))
            for w in workers:
                for n, stored in expected.items():
                    basis = method.basis(stored, tuple(w.params[n].shape), projection_side(w.params[n].shape))
                    assert torch.equal(w.optimizer.basis(w.params[n]), basis), (r, w.worker_id, n)
        before = {n: p.clone() for n, p in agg.params.items()}
        agg.aggregate([as_received(u) for u in updates], relay={u.worker_id: u for u in updates})


# ----------------------------------------------------------------------------- on the wire
def relayed_state():
    """Round 2's state of a relaying run after three compressed replies, and the aggregator."""
    torch.manual_seed(1)
    rc = rounds_config(sparse_mean="contributors")
    agg = Aggregator({n: torch.randn(s) for n, s in NAMES.items()}, {}, rc, Average(lr=1.3), None, payload=RELAY)
    w = Downlink(RELAY, rc)
    w.theta(agg.global_state(), NAMES)
    sent = replies(1, [ErrorFeedback(decay=0.9) for _ in range(3)])
    for u in sent:
        u.moments["exp_avg/embed.weight"] = torch.ones(2)  # what the server received; the relay leaves it out
        u.metrics["train_loss"] = 3.0
    agg.aggregate([as_received(u, sparse=True) for u in sent], screened=True, relay={u.worker_id: u for u in sent})
    return agg, w, rc


def dense(t: torch.Tensor | SparseValues) -> torch.Tensor:
    """A decoded Δ as a tensor (a top-k one kept sparse by the server and the product's decoder: its dense form)."""
    return t.dense() if isinstance(t, SparseValues) else t


def test_a_relayed_state_crosses_the_wire_and_the_worker_replays_it_exactly():
    """Encoded directly and by protobuf, the same bytes; decoded in place and by protobuf, the same
    replies, Δ only, whose values are what the server decoded; the worker's replay of the decoded state
    is the server's θ bit for bit. A server that reads a reply with `keep_compressed` sends on the
    bytes it received."""
    from lordo_fed.wire.decode import decode_global_state, decode_global_state_reference, decode_update
    from lordo_fed.wire.encode import encode_global_state, encode_global_state_reference, encode_update

    agg, w, _ = relayed_state()
    state = agg.global_state()
    data = encode_global_state(state, "m")
    assert bytes(data) == encode_global_state_reference(state, "m")
    specs = resolve_payload("topk2bit-relay").downlink_specs
    for got in (decode_global_state(data, "m", codecs=specs), decode_global_state_reference(bytes(data), "m", specs)):
        assert got.params == {} and got.params_delta and got.outer_lr == 1.3
        assert [(u.worker_id, u.round, u.tokens, u.moments, u.metrics) for u in got.relay] == [
            (m, 1, n, {}, {}) for m, n in enumerate((300, 100, 200))]
        for u, sent in zip(got.relay, state.relay):
            assert all(torch.equal(dense(u.delta[n]), dense(as_received(sent, sparse=True).delta[n])) for n in NAMES)
        theta = Downlink(RELAY, w.rounds)
        theta.params, theta.round = {n: t.clone() for n, t in w.params.items()}, 1
        replayed = theta.theta(got, NAMES)
        assert all(torch.equal(replayed[n], agg.params[n]) for n in NAMES)
    reply = state.relay[0]
    raw = encode_update(reply, "m")
    kept = decode_update(raw, "m", codecs=RELAY.specs(), keep_compressed=True)
    assert bytes(encode_update(kept, "m")) == bytes(raw)


def hostile(state, **change):
    return dataclasses.replace(state, **change)


@pytest.mark.parametrize("case,message", [
    ("stale", r"GlobalState.relay\[0\]: a reply of round 0 relayed in round 2's state \(expected round 1\)"),
    ("moments", r"GlobalState.relay\[1\]: a relayed reply carries moments or coordinates"),
    ("twice", r"GlobalState.relay\[1\]: worker 0 after worker 0"),
    ("lr", r"GlobalState: outer_lr=nan: expected a finite number > 0 with relayed replies"),
    ("no-lr", r"GlobalState: outer_lr=0.0: expected a finite number > 0 with relayed replies"),
    ("with-theta", r"GlobalState: 3 relayed replies with θ's tensors too"),
    ("codec", r"GlobalState.relay\[0\]: WorkerUpdate.delta\['layers.0.wq.weight'\]: codec top-k 123/4096 2-bit sign rice is not "
              r"one this receiver configured"),
    ("model", r"GlobalState.relay\[0\]: WorkerUpdate: model_id 'other'"),
    ("own-relayed", r"GlobalState: relay_own=2: worker 1's reply is left out and relayed too"),
    ("own-digest", r"GlobalState: relay_own_digest 'ABC': expected the XXH3-128 digest of worker 1's reply, 32 "
                   r"lowercase hex digits"),
    ("own-theta", r"GlobalState: relay_own=2 \(worker 1's reply left out\) in a state that does not relay "
                  r"\(params_delta=False, θ, outer_lr=0.0\)"),
    ("own-no-lr", r"GlobalState: relay_own=2 \(worker 1's reply left out\) in a state that does not relay "
                  r"\(params_delta=True, no θ, outer_lr=0.0\)"),
    ("digest-alone", r"GlobalState: relay_own_digest '0{32}' without relay_own"),
    ("own-negative", r"GlobalState.relay_own=-4: expected an integer >= 0"),
])
def test_a_hostile_relay_is_refused_with_a_reason(case, message):
    from lordo_fed.wire.decode import decode_global_state
    from lordo_fed.rounds.relay import for_worker
    from lordo_fed.wire.encode import encode_global_state, encode_global_state_reference, encode_update
    from lordo_fed.v1 import wire_pb2 as pb
    from lordo_fed.wire.codec import PayloadError

    agg, _, _ = relayed_state()
    state = agg.global_state()
    relay = list(state.relay)
    specs = resolve_payload("topk2bit-relay").downlink_specs
    if case == "stale":
        relay[0] = dataclasses.replace(relay[0], round=0)
    elif case == "moments":
        relay[1] = dataclasses.replace(relay[1], moments={"exp_avg/norm.weight": torch.ones(16)})
    elif case == "twice":
        relay[1] = dataclasses.replace(relay[1], worker_id=0)
    elif case == "with-theta":
        state = hostile(state, params={n: torch.zeros(s) for n, s in NAMES.items()})
    elif case == "codec":
        specs = resolve_payload("topk2bit-both-wide").downlink_specs
    elif case.startswith("own-") or case == "digest-alone":
        own = for_worker(state, 1)
        relay = own.relay if case != "own-relayed" else relay
        state = hostile(own, relay_own=None if case == "digest-alone" else own.relay_own,
                        relay_own_digest={"own-digest": "ABC", "digest-alone": "0" * 32}.get(case, own.relay_own_digest))
        if case == "own-theta":
            state, relay = hostile(state, params={n: torch.zeros(s) for n, s in NAMES.items()}, params_delta=False), []
    lr = {"lr": float("nan"), "no-lr": 0.0, "own-theta": 0.0, "own-no-lr": 0.0}.get(case, state.outer_lr)
    state = hostile(state, relay=[] if case == "own-no-lr" else relay, outer_lr=lr)
    data = encode_global_state(state, "m")
    assert bytes(data) == encode_global_state_reference(state, "m")  # both encoders write the fields alike
    if case == "model":  # one relayed reply for another model, put in by protobuf
        msg = pb.GlobalState.FromString(bytes(data))
        msg.relay[0] = bytes(encode_update(relay[0], "other"))
        data = msg.SerializeToString()
    if case == "own-negative":  # the encoders refuse it: put in by protobuf
        msg = pb.GlobalState.FromString(bytes(data))
        msg.relay_own = -4
        data = msg.SerializeToString()
    with pytest.raises(PayloadError, match=message):
        decode_global_state(data, "m", codecs=specs)


def test_the_relayed_form_of_a_sparse_decode_is_the_reply_as_received():
    """The server keeps a top-k reply sparse after screening it and relays it from the bytes that decode
    checked (`relayed_of`, no second decode): the same `Encoded` per tensor, byte for byte, as decoding the
    payload again as received (`keep_compressed`, what it did before), and the same state on the wire. A
    reply whose Δ has a tensor that is not top-k (int8 here) has no such form: it is decoded as received."""
    from lordo_fed.rounds.relay import relayed_form, relayed_of
    from lordo_fed.wire.decode import decode_update

    torch.manual_seed(1)
    specs = RELAY.specs()
    for reply in replies(2, [ErrorFeedback(decay=0.9) for _ in range(3)]):
        data = bytes(encode_update(reply, "m"))
        fast = relayed_of(decode_update(data, "m", codecs=specs, sparse=True))
        slow = relayed_form(decode_update(data, "m", codecs=specs, keep_compressed=True))
        assert fast == slow and list(fast.delta) == list(slow.delta)  # every Encoded field, bytes included
        state = GlobalState(round=3, params={}, projections={}, moments={}, opt_step=2, params_delta=True,
                            relay=[fast], outer_lr=1.0)
        assert bytes(encode_global_state(state, "m")) == bytes(encode_global_state(
            dataclasses.replace(state, relay=[slow]), "m"))
    int8 = resolve_payload("int8").codecs
    dense = WorkerUpdate(worker_id=0, round=1, delta={"w": int8_encoded(torch.randn(8, 8))}, moments={}, tokens=1,
                         opt_step=1)
    assert relayed_of(decode_update(bytes(encode_update(dense, "m")), "m", codecs=int8.specs(), sparse=True)) is None


def int8_encoded(x: torch.Tensor):
    from lordo_fed.wire.compress import encode

    return encode(x, resolve_payload("int8").codecs.delta_spec("w", tuple(x.shape)))
