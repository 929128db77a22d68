"""A worker's replay of a relayed round (issue 30's option B, SparseLoCo's all-gather of the sparse
replies; docs/algorithm.md, "Compressed payloads", the downlink).

With a relaying payload (`PayloadCodecs.relay`) the server sends, instead of θ or a compressed change
of it, the replies it applied in the last round as it received them (top-k Δ, tokens), and its outer
lr. Every worker holds θ_c, the θ the server started that round from, and rebuilds the round exactly
as the server did: the same `Aggregator` code over the same decoded replies in the same order (the
token-weighted or contributor mean, median clipping), then the same plain-average outer step
θ ← θ − η Δ̄. The fp32 additions are the same in the same order, so θ_c comes out equal to the
server's θ bit for bit, with no error feedback on the server and nothing left behind in θ − θ_c:
the downlink delivers the exact aggregate.

A node knows its own reply (it sent it), so the state each node gets leaves that one out
(`for_worker`: M − 1 replies down, not M) and names it by a digest; the node puts back the reply it
kept (`Downlink`, `reply_digest`) when the digest matches, and otherwise asks for θ whole
(`ResyncNeeded`). The Aggregator's own state, and its checkpoint, keep all M.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch import Tensor

from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.outer import Average
from lordo_fed.wire.codec import PayloadError
from lordo_fed.wire.compress import SparseValues, decoded
from lordo_fed.wire.decode import decode_update
from lordo_fed.wire.encode import encode_update
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.payload import PayloadCodecs
from lordo_fed.wire.relayed import fingerprint, relayed_reply_problem

CHECKPOINT_ID = "relay-checkpoint"
"""The model id a relayed reply is serialized under where it is kept, not sent (`reply_bytes`: a checkpoint's
relayed replies, a node's own last reply and its digest): the run's model is named by what holds it."""


def relayed_form(update: WorkerUpdate) -> WorkerUpdate:
    """`update` as a relaying state carries it: its Δ as sent (compressed), tokens and counters; no
    moments, metrics or coordinates."""
    return WorkerUpdate(worker_id=update.worker_id, round=update.round, delta=dict(update.delta), moments={},
                        tokens=update.tokens, opt_step=update.opt_step)


def relayed_of(update: WorkerUpdate) -> WorkerUpdate | None:
    """`relayed_form` of a reply decoded with its top-k Δ kept sparse (`decode_update(sparse=True)`), from the
    bytes each `SparseValues` was decoded from, so that the server decodes a relayed reply once; None when a Δ
    tensor is not such a top-k one (it must then be decoded as received: `keep_compressed`)."""
    if not all(isinstance(d, SparseValues) and d.encoded is not None for d in update.delta.values()):
        return None
    return relayed_form(dataclasses.replace(update, delta={n: d.encoded for n, d in update.delta.items()}))


def reply_bytes(reply: WorkerUpdate) -> memoryview:
    """`reply` (in `relayed_form`) serialized for keeping: `encode_update` under `CHECKPOINT_ID`."""
    return encode_update(reply, CHECKPOINT_ID)


def reply_digest(reply: WorkerUpdate | bytes | memoryview) -> str:
    """The fingerprint of a relayed reply (or of its `reply_bytes`): lordo_fed.wire.relayed.fingerprint."""
    return fingerprint(reply if not isinstance(reply, WorkerUpdate) else reply_bytes(reply))


def for_worker(state: GlobalState, worker_id: int) -> GlobalState:
    """The relaying `state` as worker `worker_id`'s node gets it: its own reply left out of `relay` and
    named by `relay_own` and its digest (the node kept it); `state` itself when its reply is not among them
    (a node whose reply was not applied, or a state that relays nothing)."""
    own = next((u for u in state.relay if u.worker_id == worker_id), None)
    if own is None:
        return state
    return dataclasses.replace(state, relay=[u for u in state.relay if u is not own], relay_own=worker_id,
                               relay_own_digest=reply_digest(own))


def with_own(state: GlobalState, kept: bytes | memoryview | None, codecs: PayloadCodecs) -> GlobalState:
    """`state` as the server made it, all the replies in worker order: the reply its node kept (`kept`, its
    `reply_bytes`) put back where `for_worker` left it out (`state` itself when none was). ValueError naming
    why `kept` is not that reply: none kept, another worker's or round's, other bytes (the digest)."""
    if state.relay_own is None:
        return state
    where = f"round {state.round}: the state leaves out worker {state.relay_own}'s reply of round {state.round - 1}"
    if kept is None:
        raise ValueError(f"{where}; this node kept no reply")
    reply = decode_update(kept, CHECKPOINT_ID, codecs=codecs.specs(), keep_compressed=True)
    if (reply.worker_id, reply.round) != (state.relay_own, state.round - 1):
        raise ValueError(f"{where}; this node kept worker {reply.worker_id}'s reply of round {reply.round}")
    digest = reply_digest(kept)
    if digest != state.relay_own_digest:
        raise ValueError(f"{where}; the reply this node kept has digest {digest[:16]}..., the server relayed "
                         f"{state.relay_own_digest[:16]}...")
    return dataclasses.replace(state, relay=sorted([*state.relay, reply], key=lambda u: u.worker_id), relay_own=None,
                               relay_own_digest="")


def replay(theta_c: dict[str, Tensor], state: GlobalState, rounds: RoundConfig,
           codecs: PayloadCodecs) -> dict[str, Tensor]:
    """θ after round `state.round` − 1, rebuilt from θ_c (θ at that round's start, host fp32) and the
    replies `state.relay` carries: the server's `Aggregator.aggregate_refs` and `Average` step, run
    here on a copy (θ_c is not changed). No replies: θ did not move (a skipped round)."""
    if not state.relay:
        return {n: t.clone() for n, t in theta_c.items()}
    from lordo_fed.rounds.aggregator import Aggregator  # (it imports this module)

    if not state.outer_lr > 0:
        raise ValueError(f"round {state.round}: a relayed state with outer_lr={state.outer_lr!r}; expected the "
                         "server's outer lr, a number > 0")
    replica = Aggregator(theta_c, {}, rounds, Average(state.outer_lr), None,
                         payload=dataclasses.replace(codecs, relay=False, down=None))
    replica.round = state.round - 1
    # each top-k Δ kept sparse, as the server's sums read it (the same additions, bit for bit)
    replies = [dataclasses.replace(u, delta=decoded(u.delta, sparse=True)) for u in state.relay]
    replica.aggregate(replies, screened=True)
    return replica.params


def relay_checkpoint(relayed: list[WorkerUpdate]) -> dict[str, Tensor]:
    """The replies the next state relays, as checkpoint tensors (`Aggregator.state_dict`): their count, and
    each serialized (`encode_update`) as bytes, so that a resumed run relays on (`relayed_from_checkpoint`)."""
    out = {"counter/relayed": torch.tensor(len(relayed))}
    out.update({f"relay/{i}": torch.frombuffer(bytearray(reply_bytes(u)), dtype=torch.uint8)
                for i, u in enumerate(relayed)})
    return out


def relayed_from_checkpoint(sd: Mapping[str, Tensor], round_idx: int, codecs: PayloadCodecs) -> list[WorkerUpdate] | None:
    """The relayed replies a checkpoint at round `round_idx` holds (`relay_checkpoint`), decoded and screened as
    the workers will (the preset's codecs, Δ only, round `round_idx` − 1's, each worker once, in order); None
    without them (a checkpoint of an older version: every worker gets θ whole once). ValueError names a bad one."""
    if "counter/relayed" not in sd:
        return None
    count, replies = int(sd["counter/relayed"]), []
    for i in range(count):
        raw = sd.get(f"relay/{i}")
        if raw is None or raw.dtype != torch.uint8 or raw.dim() != 1:
            raise ValueError(f"checkpoint: relay/{i} is {'missing' if raw is None else f'a {raw.dtype} tensor'}; "
                             f"expected the bytes of relayed reply {i} of {count}")
        try:
            u = decode_update(raw.numpy().tobytes(), CHECKPOINT_ID, codecs=codecs.specs(), keep_compressed=True)
        except PayloadError as err:
            raise ValueError(f"checkpoint: relay/{i}: {err}") from None
        problem = relayed_reply_problem(u, round_idx, replies[-1] if replies else None)  # as the workers check it
        if problem:
            raise ValueError(f"checkpoint: relay/{i}: {problem}")
        replies.append(u)
    return replies
