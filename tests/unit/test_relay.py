"""Issue 30's option B: the server relays the round's replies and every worker replays the round.

The oracle of a relayed run is the same run with the same uplink and θ sent whole in fp32: the
replay must give every worker the server's θ bit for bit, so the two runs are one run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lordo_fed.checkpoint import load_checkpoint, save_checkpoint
from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.downlink import Downlink, ResyncNeeded
from lordo_fed.rounds.outer import Average, Nesterov
from lordo_fed.trainer.run import as_received
from lordo_fed.wire.compress import ErrorFeedback
from lordo_fed.wire.decode import decode_global_state
from lordo_fed.wire.encode import encode_global_state
from lordo_fed.wire.messages import WorkerUpdate
from lordo_fed.wire.payload import PRESETS, resolve_payload

RELAY = resolve_payload("topk2bit-relay").codecs
NAMES = {"layers.0.wq.weight": (64, 96), "embed.weight": (40, 16), "norm.weight": (16,)}


def rounds_config(**kw) -> RoundConfig:
    return RoundConfig(local_steps=1, sync_exp_avg_every=0, sync_exp_avg_sq_every=0, **kw)


def replies(round_idx: int, feedback: list[ErrorFeedback], tokens=(300, 100, 200), gen=None) -> list[WorkerUpdate]:
    """One round of compressed replies as workers send them: heavy-tailed Δ, top-k 2-bit with each
    worker's error feedback (what `Uplink` does), one reply per worker."""
    out = []
    for m, n in enumerate(tokens):
        delta = {name: torch.distributions.StudentT(3.0).sample(shape) * 1e-2 for name, shape in NAMES.items()}
        sent = {name: feedback[m].compress(name, d, RELAY.delta_spec(name, d.shape))[0] for name, d in delta.items()}
        out.append(WorkerUpdate(worker_id=m, round=round_idx, delta=sent, moments={}, tokens=n, opt_step=round_idx))
    return out


@pytest.mark.parametrize("mean,clip", [("all", False), ("contributors", False), ("contributors", True)])
def test_every_worker_replays_the_servers_theta_bit_for_bit(mean, clip):
    """Four rounds of mocked compressed replies through the real aggregator (outer average, lr 1.3):
    from round 2 each state carries the last round's replies, not θ, and a worker's copy after the
    replay equals the server's θ exactly; a worker that missed a round is refused the relay and
    gets θ whole (`resync_state`); a skipped round relays nothing and θ stays."""
    torch.manual_seed(0)
    rc = rounds_config(sparse_mean=mean, clip_median=clip)
    theta0 = {name: torch.randn(shape) for name, shape in NAMES.items()}
    agg = Aggregator(theta0, {}, rc, Average(lr=1.3), None, payload=RELAY)
    workers = [Downlink(RELAY, rc) for _ in range(3)]
    feedback = [ErrorFeedback(decay=0.9) for _ in range(3)]
    for r in range(1, 6):
        state = agg.global_state()
        assert state.params_delta == (r > 1) and bool(state.params) == (r == 1)
        if r == 5:  # round 4 was skipped: nothing to replay
            assert state.params_delta and state.relay == []
        elif r > 1:
            assert [u.worker_id for u in state.relay] == [0, 1, 2] and state.outer_lr == 1.3
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
        sent = replies(r, feedback)
        before = {n: p.clone() for n, p in agg.params.items()}
        agg.aggregate([as_received(u) for u in sent], relay={u.worker_id: u for u in sent})
        assert any(not torch.equal(before[n], agg.params[n]) for n in NAMES)  # θ moved
    assert agg.round == 6


def after_one_round() -> tuple[Aggregator, Downlink]:
    """A relaying aggregator after round 1's three replies, and a worker that applied round 1's state."""
    rc = rounds_config()
    agg = Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(), None, payload=RELAY)
    w = Downlink(RELAY, rc)
    w.theta(agg.global_state(), NAMES)
    sent = replies(1, [ErrorFeedback() for _ in range(3)])
    agg.aggregate([as_received(u) for u in sent], relay={u.worker_id: u for u in sent})
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


def test_a_resumed_run_relays_on_as_the_uninterrupted_one(tmp_path):
    """The checkpoint keeps the replies the next state relays: a run resumed after round 2, or after the
    skipped round 4 (through the checkpoint's files), sends the uninterrupted run's states byte for byte,
    relayed, not θ whole, and ends at its θ bit for bit; a worker that held θ_c replays them to it."""
    rc = rounds_config()
    fresh = lambda: Aggregator({n: torch.zeros(s) for n, s in NAMES.items()}, {}, rc, Average(lr=1.3), None,
                               payload=RELAY)
    torch.manual_seed(0)
    fb = [ErrorFeedback(decay=0.9) for _ in range(3)]
    rounds = {r: replies(r, fb) for r in range(1, 7)}  # mocked replies: the same for every run
    agg = fresh()
    golden = {}
    for at in (2, 4):
        golden.update(run_relayed(agg, rounds, range(len(golden) + 1, at + 1)))
        save_checkpoint(tmp_path / f"r{at}", at, agg.state_dict(), {"round": at})
    golden.update(run_relayed(agg, rounds, range(5, 7)))
    for at, relayed in ((2, 3), (4, 0)):
        tensors, _ = load_checkpoint(tmp_path / f"r{at}")
        assert int(tensors["counter/relayed"]) == relayed
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
        agg.aggregate([as_received(u) for u in sent], relay={u.worker_id: u for u in sent})
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
    resumed.aggregate([as_received(u) for u in sent], relay={u.worker_id: u for u in sent})
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
        agg.aggregate([as_received(u) for u in sent], relay={u.worker_id: u for u in sent[:2]})
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
    θ down fp32 whole (a preset made here: the oracle). Same θ at every evaluation and at the end, bit
    for bit; the relay's bytes down are the three replies' encoded bytes."""
    from lordo_fed.rounds.outer import OuterConfig
    from tests.unit.test_trainer import context, tiny_config
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.trainer.run import run_rounds

    monkeypatch.setitem(PRESETS, "topk2bit-exact-down", dataclasses.replace(RELAY, relay=False))
    outer = overrides.pop("diloco_outer", None)
    rc = RoundConfig(local_steps=2, sync_exp_avg_every=0, sync_exp_avg_sq_every=0, wire_ef_decay=0.9, **overrides)
    runs = {}
    for payload in ("topk2bit-relay", "topk2bit-exact-down"):
        cfg = tiny_config(tmp_path / payload, workers=3, total_steps=8, eval_every=1, payload_dtype=payload, rounds=rc)
        cfg.inner.init_projection = "random"
        if outer:
            cfg.diloco_outer = OuterConfig(name=outer[0], lr=outer[1])
        records: list = []
        settings = resolve_method(method, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer)
        torch.manual_seed(0)
        model = run_rounds(context(cfg, records), settings)
        runs[payload] = ({n: p.detach().clone() for n, p in model.named_parameters()},
                         [r for r in records if "val_loss" in r])
    (relayed, curve), (exact, oracle) = runs["topk2bit-relay"], runs["topk2bit-exact-down"]
    assert all(torch.equal(relayed[n], exact[n]) for n in exact)
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
    agg.aggregate([as_received(u) for u in sent], screened=True, relay={u.worker_id: u for u in sent})
    return agg, w, rc


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
            assert all(torch.equal(u.delta[n], as_received(sent).delta[n]) for n in NAMES)
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
])
def test_a_hostile_relay_is_refused_with_a_reason(case, message):
    from lordo_fed.wire.decode import decode_global_state
    from lordo_fed.wire.encode import encode_global_state, encode_update
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
    state = hostile(state, relay=relay, outer_lr={"lr": float("nan"), "no-lr": 0.0}.get(case, state.outer_lr))
    data = encode_global_state(state, "m")
    if case == "model":  # one relayed reply for another model, put in by protobuf
        msg = pb.GlobalState.FromString(bytes(data))
        msg.relay[0] = bytes(encode_update(relay[0], "other"))
        data = msg.SerializeToString()
    with pytest.raises(PayloadError, match=message):
        decode_global_state(data, "m", codecs=specs)
