"""A worker's replay of a relayed round (issue 30's option B, SparseLoCo's all-gather of the sparse
replies; docs/algorithm.md, "Compressed payloads", the downlink).

With a relaying payload (`PayloadCodecs.relay`) the server sends, instead of θ or a compressed change
of it, the replies it applied in the last round as it received them (top-k Δ, tokens), and its outer
lr. Every worker holds θ_c, the θ the server started that round from, and rebuilds the round exactly
as the server did: the same `Aggregator` code over the same decoded replies in the same order (the
token-weighted or contributor mean, median clipping), then the same plain-average outer step
θ ← θ − η Δ̄. The fp32 additions are the same in the same order, so θ_c comes out equal to the
server's θ bit for bit, with no error feedback on the server and nothing left behind in θ − θ_c:
the downlink delivers the exact aggregate at M times the uplink's bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch import Tensor

from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.outer import Average
from lordo_fed.wire.codec import PayloadError
from lordo_fed.wire.compress import decoded
from lordo_fed.wire.decode import decode_update, relayed_reply_problem
from lordo_fed.wire.encode import encode_update
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.payload import PayloadCodecs

CHECKPOINT_ID = "relay-checkpoint"
"""The model id a checkpoint's relayed replies are stored under (`relay_checkpoint`): the checkpoint's own
metadata names the run's model."""


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
    replies = [dataclasses.replace(u, delta=decoded(u.delta)) for u in state.relay]
    replica.aggregate(replies, screened=True)
    return replica.params


def relay_checkpoint(relayed: list[WorkerUpdate]) -> dict[str, Tensor]:
    """The replies the next state relays, as checkpoint tensors (`Aggregator.state_dict`): their count, and
    each serialized (`encode_update`) as bytes, so that a resumed run relays on (`relayed_from_checkpoint`)."""
    out = {"counter/relayed": torch.tensor(len(relayed))}
    out.update({f"relay/{i}": torch.frombuffer(bytearray(encode_update(u, CHECKPOINT_ID)), dtype=torch.uint8)
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
