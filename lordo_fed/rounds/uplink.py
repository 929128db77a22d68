"""A worker's end of the uplink: Δ and the due moments as the payload preset sends them, Δ with
error feedback.

A compressed payload preset (docs/algorithm.md, "Compressed payloads") loses part of Δ in every
round. Error feedback keeps it: the worker compresses Δ + e and keeps e ← Δ + e − decoded, so
what a round leaves out travels in a later one (Σ sent + e = Σ Δ); e is part of the worker's
saved state. With a `lowrank+` preset under LoRDO-Global a matrix trained in the round's shared
basis P goes as its coordinates C = proj_P(Δ + e) plus the compressed residual
R = Δ + e − P·Ĉ, and e keeps R − R̂ (lordo_fed.wire.lowrank). The moments are states, not
increments: they are quantised without error feedback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from lordo_fed.optim.projection import projection_side
from lordo_fed.wire import lowrank
from lordo_fed.wire.compress import Encoded, ErrorFeedback, support
from lordo_fed.wire.payload import PayloadCodecs


class Uplink:
    """What a worker sends, compressed per `codecs` (None: as it is), with Δ's residual kept."""

    def __init__(self, codecs: PayloadCodecs | None, ef_decay: float = 1.0) -> None:
        self.codecs = codecs
        """The run's payload preset (lordo_fed.wire.payload); None: fp32 or bf16, sent as it is."""
        self.ef = ErrorFeedback(ef_decay)
        """What compression left out of Δ so far, per parameter (sent in later rounds)."""
        self.ef_ratio: float | None = None
        """‖e‖/‖Δ‖ of the last `compress_delta`: the residual left against the round's Δ."""
        self.reselected: float | None = None
        """Of the top-k indices the last `compress_delta` sent, the share this worker also sent the
        round before (None until two rounds have sent top-k tensors)."""
        self._support: dict[str, Tensor] = {}  # each top-k tensor's positions sent last round (int32)

    def encode(self, delta: dict[str, Tensor], moments: dict[str, Tensor], shared: Iterable[str],
               basis: Callable[[str], Tensor], ef_scale: float = 1.0) -> tuple[dict, dict, dict[str, Encoded]]:
        """(Δ, moments, coordinates) as the preset sends them: Δ with error feedback (`compress_delta`;
        the residual decayed by β·`ef_scale`, the lr's fall with `RoundConfig.wire_ef_lr_scale`), the
        moments quantised; unchanged, without coordinates, when nothing is compressed."""
        if self.codecs is None:
            return delta, moments, {}
        delta, coords = self.compress_delta(delta, list(shared), basis, ef_scale)
        return delta, self.codecs.encode_moments(moments), coords

    def compress_delta(self, delta: dict[str, Tensor], shared: list[str],
                       basis: Callable[[str], Tensor],
                       ef_scale: float = 1.0) -> tuple[dict[str, Encoded], dict[str, Encoded]]:
        """(Δ, coordinates) with error feedback (the residual decayed by β·`ef_scale`): with a `lowrank+`
        preset, each matrix of `shared` (the round's shared bases; `basis(name)` the one it trained in) as
        its coordinates in that basis plus the compressed residual, the rest compressed whole."""
        codecs = self.codecs
        out, coords = {}, {}
        delta_sq = sum(float(d.float().square().sum()) for d in delta.values())  # before the residual takes d's memory
        for name, d in delta.items():
            if codecs.lowrank is not None and name in shared:
                b = basis(name).detach().to("cpu", torch.float32)
                side = projection_side(d.shape)
                out[name], coords[name] = self.ef.compress_split(
                    name, d, codecs.delta, lambda t, b=b, s=side: lowrank.split(t, b, s, codecs.lowrank), ef_scale)
            else:
                out[name] = self.ef.compress(name, d, codecs.delta_spec(name, tuple(d.shape)), ef_scale)[0]
        left = sum(float(self.ef.residual[n].square().sum()) for n in delta if n in self.ef.residual)
        self.ef_ratio = (left / delta_sq) ** 0.5 if delta_sq > 0 else 0.0
        self._track_support(out)
        return out, coords

    def _track_support(self, sent: dict[str, Encoded]) -> None:
        """`reselected` of this round's top-k tensors against the last round's, and keep this round's."""
        again = total = 0
        current = {}
        for name, enc in sent.items():
            if enc.spec.kind != "topk":
                continue
            current[name] = support(enc).to(torch.int32)
            if name in self._support:
                again += int(torch.isin(current[name], self._support[name]).sum())
                total += current[name].numel()
        self.reselected = again / total if total else None
        self._support = current
