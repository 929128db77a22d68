"""What a relaying state may carry (a relaying payload preset, lordo_fed.rounds.relay): the rules its
decoder (lordo_fed.wire.decode) and a checkpoint's loader apply to the relayed replies, the reply a
node's own state leaves out, and that reply's fingerprint.

The fingerprint is XXH3-128 (the data plane's default digest, lordo_fed.transport.checksum, which this
layer does not import): against a kept reply that is stale or not the one relayed, not a proof of origin,
since the state itself comes from the server.
"""

from __future__ import annotations

import xxhash

from lordo_fed.wire.messages import WorkerUpdate

FINGERPRINT_HEX = 32
"""Length of a fingerprint: XXH3-128 as lowercase hex."""


def fingerprint(data) -> str:
    """The lowercase hex XXH3-128 digest of `data` (any buffer)."""
    return xxhash.xxh3_128(data).hexdigest()


def relayed_reply_problem(reply: WorkerUpdate, state_round: int, previous: WorkerUpdate | None) -> str | None:
    """Why `reply` cannot be relayed in round `state_round`'s state after `previous` (None: it can): it must be
    of the previous round, Δ only, and each worker's once in increasing order (lordo_fed.rounds.relay)."""
    if reply.round != state_round - 1:
        return f"a reply of round {reply.round} relayed in round {state_round}'s state (expected round {state_round - 1})"
    if reply.moments or reply.coords:
        return "a relayed reply carries moments or coordinates (Δ only)"
    if previous is not None and reply.worker_id <= previous.worker_id:
        return (f"worker {reply.worker_id} after worker {previous.worker_id} (expected each worker once, in "
                "increasing order)")
    return None


def relay_own_problem(own: int, digest: str, params_delta: bool, has_params: bool, outer_lr: float,
                      relayed: list[int]) -> str | None:
    """Why a state cannot leave out worker `own`'s reply with fingerprint `digest` (None: it can, or `own`
    < 0 and no digest: none left out): only a relaying state (θ as a change, `params_delta`, with no θ's
    tensors and `outer_lr` > 0), a well-formed fingerprint, and a worker not also among the `relayed`
    ones. Named as the wire carries it (`relay_own` = worker id + 1)."""
    if own < 0:
        return f"relay_own_digest {digest[:40]!r} without relay_own (no reply left out)" if digest else None
    field = f"relay_own={own + 1}"
    if not params_delta or has_params or not outer_lr > 0:
        return (f"{field} (worker {own}'s reply left out) in a state that does not relay "
                f"(params_delta={params_delta}, {'θ' if has_params else 'no θ'}, outer_lr={outer_lr!r}): expected "
                "params_delta, no θ and outer_lr > 0")
    if len(digest) != FINGERPRINT_HEX or any(c not in "0123456789abcdef" for c in digest):
        return (f"relay_own_digest {digest[:40]!r}: expected the XXH3-128 digest of worker {own}'s reply, "
                f"{FINGERPRINT_HEX} lowercase hex digits")
    if own in relayed:
        return f"{field}: worker {own}'s reply is left out and relayed too"
    return None
