"""A worker's end of the downlink: θ as the server sends it, whole or as the change of the
clients' copy θ_c.

With a compressed payload preset (docs/algorithm.md, "Compressed payloads", the downlink) the
server keeps the clients' copy θ_c of θ and, from round 2 on, sends the quantised change θ − θ_c
instead of θ (`GlobalState.params_delta`). Server and workers add the same decoded change to the
same tensors, so they agree on θ_c bit for bit; a worker trains from θ_c and measures its Δ from
it. A worker that gets a change to a copy it does not hold (it missed a round) refuses it
(`ResyncNeeded`) and the server sends θ_c whole next time. θ_c is part of the worker's saved state.
With a relaying payload the state carries the last round's replies instead of a change, and the
worker replays that round on θ_c (lordo_fed.rounds.relay). Its own reply is left out of the state
(the node sent it): the worker keeps its last reply as the server relays it (`keep_reply`, saved
with θ_c) and puts it back; a state that leaves out a reply this worker did not keep is refused
(`ResyncNeeded`), as is a change to a copy it does not hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.relay import relayed_form, replay, reply_bytes, with_own
from lordo_fed.wire.compress import decoded
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.payload import PayloadCodecs


OWN_REPLY = "own_reply"
"""The key of the reply kept (`Downlink.own`) in the worker's state dict and its flat state."""


class ResyncNeeded(ValueError):
    """The server sent θ as a change to a copy this worker does not hold (it missed a round), or relayed
    a round leaving out a reply this worker did not keep."""


class Downlink:
    """θ of each round as a worker receives it, and θ_c when the downlink is compressed."""

    def __init__(self, codecs: PayloadCodecs | None = None, rounds: RoundConfig | None = None) -> None:
        self.tracks = codecs is not None and codecs.tracks_copy
        """Whether the downlink is compressed (`PayloadCodecs.down` or `relay`): the worker keeps θ_c."""
        self.codecs = codecs
        """The run's payload codecs (a relay is replayed with them)."""
        self.rounds = rounds
        """The run's round settings (how the server averages: a relay is replayed with them)."""
        self.params: dict[str, Tensor] | None = None
        """θ_c, the copy of θ the server's changes are added to (host fp32); None: none held."""
        self.round = 0
        """The round whose state `params` is."""
        self.keep: frozenset[str] = frozenset()
        """Parameters whose decoded change `theta` keeps in `change` (the low-rank matrices, when the
        worker fits LoRDO-Global's bases to it: `RoundConfig.bases_from='downlink'`)."""
        self.change: dict[str, Tensor] = {}
        """The decoded change of θ_c the last state carried, of the parameters in `keep` (empty after
        a state with θ whole)."""
        self.own: Tensor | None = None
        """A relaying payload: this worker's last reply as the server relays it (`relay.reply_bytes`, as a
        uint8 tensor), which the next state leaves out (`relay.for_worker`); None: none kept."""

    def theta(self, state: GlobalState, names: Iterable[str]) -> dict[str, Tensor]:
        """θ to start round `state.round` from, by name: `state.params`, θ_c plus the change it
        carries, or (a relaying payload) θ_c after the replay of the replies it relays (a state that
        lacks one of `names`, the worker's parameters, is refused)."""
        relayed = state.params_delta and self.codecs is not None and self.codecs.relay
        missing = set(names) - set(state.params) if not relayed else set()
        if missing:
            raise ValueError(f"global state lacks parameters {sorted(missing)}")
        if state.params_delta:
            if self.params is None or self.round != state.round - 1:
                held = "no copy" if self.params is None else f"the copy of round {self.round}"
                raise ResyncNeeded(f"round {state.round}: the server sent θ as a change to round {state.round - 1}'s "
                                   f"copy, this worker holds {held}: it needs θ whole (sent to a worker whose last "
                                   "reply did not reach the server)")
            self.change = {}
            if relayed:
                try:
                    state = with_own(state, None if self.own is None else memoryview(self.own.numpy()), self.codecs)
                except ValueError as err:
                    raise ResyncNeeded(f"{err}: it needs θ whole") from None
                theta = replay(self.params, state, self.rounds, self.codecs)
                self.change = {n: theta[n] - self.params[n] for n in self.keep}
                self.params, self.round = theta, state.round
                return self.params
            for name, change in decoded(state.params).items():
                self.params[name].add_(change.float())
                if name in self.keep:
                    self.change[name] = change
            self.round = state.round
            return self.params
        self.change = {}
        theta = decoded(state.params)
        if self.tracks:
            self.params = {n: t.detach().to("cpu", torch.float32).clone() for n, t in theta.items()}
            self.round = state.round
            return self.params
        return theta

    def keep_reply(self, update: WorkerUpdate) -> None:
        """With a relaying payload: keep `update`, the reply this worker sends, as the server would relay
        it (its Δ as sent, tokens, counters: `relay.relayed_form`), for the next state, which leaves it out."""
        if self.codecs is not None and self.codecs.relay:
            self.own = torch.frombuffer(bytearray(reply_bytes(relayed_form(update))), dtype=torch.uint8)

    def take_change(self) -> dict[str, Tensor]:
        """The kept change of the last state (`change`, empty unless `keep` names parameters and the state
        carried a change), handed over once: the next call returns {} until another state comes."""
        change, self.change = self.change, {}
        return change

    def state_dict(self) -> dict:
        """θ_c ('client', by name; empty when none is held), its round ('client_round') and, with a
        relaying payload, the reply kept (`OWN_REPLY`, its bytes; absent when none), as the worker's state
        dict holds them."""
        own = {} if self.own is None else {OWN_REPLY: self.own}
        return {"client": {} if self.params is None else dict(self.params), "client_round": torch.tensor(self.round),
                **own}

    def load_state_dict(self, sd: Mapping) -> None:
        """θ_c, its round and the reply kept from a worker's state dict (`state_dict`; absent: none held)."""
        client = sd.get("client") or {}
        self.params = {n: t.float().clone() for n, t in client.items()} or None
        self.round = int(sd.get("client_round", 0))
        own = sd.get(OWN_REPLY)
        if own is not None and (own.dtype != torch.uint8 or own.dim() != 1):
            raise ValueError(f"worker state: {OWN_REPLY} is a {own.dtype} tensor of shape {tuple(own.shape)}; "
                             "expected the bytes of the reply kept (uint8, one dimension)")
        self.own = None if own is None else own.clone()
