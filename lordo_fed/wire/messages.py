"""What one round exchanges, as plain tensors (no Flower types), and when states are due.

A round (docs/algorithm.md, "One round"): the aggregator hands every worker a
`GlobalState` (θ, the shared projections under LoRDO-Global, the averaged optimizer states that
are due); each worker runs K local steps and answers with a `WorkerUpdate` (Δ = θ_ref − θ_local,
its states that are due, tokens trained, metrics). The Flower app serializes exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
SYNCED_KINDS = (*MOMENT_KEYS, "ef")
"""Optimizer-state tensors that may cross the wire: the two moments and LoRDO's error-feedback
buffer E (`RoundConfig.sync_ef`)."""

DIAGNOSTIC_METRICS = ("update_out_in_ratio", "update_out_in_ratio_last", "ef_norm", "wire_ef_ratio",
                      "sparse_reselected")
"""Per-round metrics of a worker that the aggregator averages by tokens: with a LoRDO optimizer
tracking `track_update_split`, the round's mean and last-step ‖U_out‖/‖U_in‖, the out-of-subspace
share of the update over all low-rank matrices, and ‖E‖ at the round's end (docs/algorithm.md,
"Error feedback inside a round"); with a compressed payload, ‖e‖/‖Δ‖: the wire's residual after
the round's send against the round's Δ, over every tensor sent with error feedback; with top-k
tensors, the share of the indices a worker sent that it also sent the round before."""


def moment_key(kind: str, param_name: str) -> str:
    """Flat name of a state tensor on the wire: 'exp_avg/<param>', 'exp_avg_sq/<param>' or 'ef/<param>'."""
    return f"{kind}/{param_name}"


def split_moment_key(key: str) -> tuple[str, str]:
    kind, _, name = key.partition("/")
    if kind not in SYNCED_KINDS or not name:
        raise ValueError(f"moment key {key!r}: expected '<exp_avg|exp_avg_sq|ef>/<parameter name>'")
    return kind, name


@dataclass
class GlobalState:
    """What the aggregator sends every worker at the start of a round."""

    round: int
    """The 1-based round about to be trained."""
    params: dict[str, Tensor]
    """Global θ, every trainable parameter by name (fp32)."""
    projections: dict[str, Tensor] = field(default_factory=dict)
    """LoRDO-Global: stored-form projection per low-rank parameter (basis, or DCT indices)."""
    moments: dict[str, Tensor] = field(default_factory=dict)
    """Averaged moments due this round, keyed by `moment_key`, already in `projections`' basis."""
    opt_step: int = 0
    """Inner-optimizer steps taken so far (bias correction of loaded moments)."""
    params_from_seed: bool = False
    """`params` is empty: θ is the seeded initialisation θ0, which the receiver builds itself."""
    params_delta: bool = False
    """`params` is the change of the clients' copy of θ since round `round` − 1 (a compressed
    downlink, lordo_fed.wire.payload): add it to the copy held from that round."""
    local_steps: int = 0
    """Asynchronous rounds with speed-matched steps: this round's local steps, chosen by the server
    (lordo_fed.rounds.async_rounds.SpeedMatch); 0: the node's own."""
    relay: list["WorkerUpdate"] = field(default_factory=list)
    """A relaying payload (`PayloadCodecs.relay`), with `params_delta` and `params` empty: the replies
    of round `round` − 1 the server applied, as it received them (Δ compressed, tokens; no moments),
    in worker order; the worker replays the mean and the outer step on its copy θ_c
    (lordo_fed.rounds.relay). Empty with `params_delta`: θ did not move (a skipped round)."""
    outer_lr: float = 0.0
    """With `relay`: the server's outer lr η of that round's step θ ← θ − η Δ̄."""
    relay_own: int | None = None
    """A relaying state sent to one node (`lordo_fed.rounds.relay.for_worker`): the worker whose reply
    `relay` leaves out, because that node sent it and keeps it (the downlink is then M − 1 replies, not
    M); None: none left out. On the wire as the worker id + 1 (0: none)."""
    relay_own_digest: str = ""
    """With `relay_own`: the fingerprint of the reply left out as the server relays it
    (`lordo_fed.rounds.relay.reply_digest`); the node replays only a kept reply that matches it."""

    def tensors(self) -> dict[str, Tensor]:
        """Everything that crosses the wire downstream, one flat dict (for byte counts)."""
        out = {f"param/{k}": v for k, v in self.params.items()}
        for reply in self.relay:
            out.update({f"relay/{reply.worker_id}/{k}": v for k, v in reply.delta.items()})
        out.update({f"proj/{k}": v for k, v in self.projections.items()})
        out.update(self.moments)
        return out


@dataclass
class WorkerUpdate:
    """What a worker returns after its K local steps."""

    worker_id: int
    """Which worker (partition id) produced this."""
    round: int
    """The round it trained."""
    delta: dict[str, Tensor]
    """Pseudo-gradient Δ = θ_ref − θ_local per parameter (fp32)."""
    moments: dict[str, Tensor]
    """Its moments that are due this round, keyed by `moment_key`."""
    tokens: int
    """Tokens trained on this round (the averaging weight)."""
    opt_step: int
    """Its inner-optimizer step count after the round."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Train loss and the like."""
    coords: dict[str, Tensor] = field(default_factory=dict)
    """A low-rank payload preset (lordo_fed.wire.lowrank): per low-rank parameter, the coordinates
    C of its Δ in the round's shared basis P; its Δ is then P·C + `delta[name]` (the residual)."""

    def tensors(self) -> dict[str, Tensor]:
        """Everything that crosses the wire upstream, one flat dict (for byte counts)."""
        out = {f"delta/{k}": v for k, v in self.delta.items()}
        out.update(self.moments)
        out.update({f"coords/{k}": v for k, v in self.coords.items()})
        return out
