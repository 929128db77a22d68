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

from torch import Tensor

from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.outer import Average
from lordo_fed.wire.compress import decoded
from lordo_fed.wire.messages import GlobalState
from lordo_fed.wire.payload import PayloadCodecs


def replay(theta_c: dict[str, Tensor], state: GlobalState, rounds: RoundConfig,
           codecs: PayloadCodecs) -> dict[str, Tensor]:
    """θ after round `state.round` − 1, rebuilt from θ_c (θ at that round's start, host fp32) and the
    replies `state.relay` carries: the server's `Aggregator.aggregate_refs` and `Average` step, run
    here on a copy (θ_c is not changed). No replies: θ did not move (a skipped round)."""
    if not state.relay:
        return {n: t.clone() for n, t in theta_c.items()}
    if not state.outer_lr > 0:
        raise ValueError(f"round {state.round}: a relayed state with outer_lr={state.outer_lr!r}; expected the "
                         "server's outer lr, a number > 0")
    replica = Aggregator(theta_c, {}, rounds, Average(state.outer_lr), None,
                         payload=dataclasses.replace(codecs, relay=False, down=None))
    replica.round = state.round - 1
    replies = [dataclasses.replace(u, delta=decoded(u.delta)) for u in state.relay]
    replica.aggregate(replies, screened=True)
    return replica.params
