"""Payload presets: which codec each kind of tensor of a round travels with (`payload_dtype`).

| preset      | Δ up (error feedback on the worker)     | moments (both ways) | θ down                            |
|-------------|-----------------------------------------|---------------------|-----------------------------------|
| fp32, bf16  | raw                                     | raw                 | raw                               |
| int8        | int8, one scale per 64 values           | int8 / 64 (v: √v)   | int8 / 64 change of the clients' copy |
| int4        | int4 / 32                               | int8 / 64           | int8 / 64 change                  |
| topk2bit    | top-k 3% of each 4096, 2-bit values     | int8 / 64           | int8 / 64 change                  |

Δ's compression residual is kept on the worker and added to the next round's Δ (error feedback,
lordo_fed.wire.compress.ErrorFeedback); the moments are states, not increments, and are sent
quantised as they are, the second moment v through its square root rounded up (v̂ ≥ v: blockwise
int8 of v itself zeroes 74% of a realistic v and multiplies Adam's largest step by 10^6). Downstream the server keeps the clients' copy θ_c of θ (deterministic) and
sends the compressed change θ − θ_c, which both sides add to θ_c (lordo_fed.aggregator): what the
change leaves out stays in θ − θ_c and goes with a later round. The shared bases travel fp32 (they
must stay orthonormal), integer tensors raw. A receiver accepts exactly the specs of the run's
preset (`receiver_codecs`, `downlink_codecs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from torch import Tensor

from lordo_fed.codec import PAYLOAD_DTYPES
from lordo_fed.wire.compress import CodecSpec, Encoded, encode


@dataclass(frozen=True)
class PayloadCodecs:
    """The codecs of a compressed preset."""

    delta: CodecSpec
    """Pseudo-gradients, with error feedback of the residual on the worker."""
    moments: CodecSpec
    """Synced optimizer moments (low-rank and full-size), both ways."""
    down: CodecSpec | None = None
    """θ downstream, as the change of the clients' copy (None: θ raw)."""

    def moment_spec(self, key: str) -> CodecSpec:
        """The codec of moment `key` ('<kind>/<param>'): second moments quantise their square roots,
        rounded up (`CodecSpec.sqrt`), so that no positive v decodes to 0."""
        if key.startswith("exp_avg_sq/") and self.moments.kind == "quant":
            return dataclasses.replace(self.moments, sqrt=True)
        return self.moments

    def encode_moments(self, moments: Mapping[str, Tensor]) -> dict[str, Encoded]:
        """Every moment compressed with its codec (`moment_spec`)."""
        return {k: encode(v, self.moment_spec(k)) for k, v in moments.items()}

    def specs(self) -> frozenset[CodecSpec]:
        """What the server configures for replies (`lordo_fed.codec.decode_update`'s `codecs`)."""
        return frozenset(s.canonical() for s in (self.delta, self.moments, self.moment_spec("exp_avg_sq/")))

    def down_specs(self) -> frozenset[CodecSpec]:
        """What a worker configures for the server's states (`decode_global_state`'s `codecs`)."""
        return frozenset(s.canonical() for s in (self.moments, self.moment_spec("exp_avg_sq/"), self.down)
                         if s is not None)


_INT8 = CodecSpec("quant", bits=8, block=64)
PRESETS: dict[str, PayloadCodecs] = {
    "int8": PayloadCodecs(delta=_INT8, moments=_INT8, down=_INT8),
    "int4": PayloadCodecs(delta=CodecSpec("quant", bits=4, block=32), moments=_INT8, down=_INT8),
    "topk2bit": PayloadCodecs(delta=CodecSpec("topk", bits=2, chunk=4096, density=0.03), moments=_INT8, down=_INT8),
}
PAYLOADS = (*PAYLOAD_DTYPES, *PRESETS)
"""Every value `payload_dtype` takes."""


def payload_codecs(name: str) -> PayloadCodecs | None:
    """The codecs of preset `name` (None for fp32 and bf16); ValueError naming the choices."""
    if name in PAYLOAD_DTYPES:
        return None
    if name not in PRESETS:
        raise ValueError(f"payload_dtype={name!r}: expected one of {PAYLOADS}")
    return PRESETS[name]


def wire_dtype(name: str) -> str:
    """How the tensors a preset leaves uncompressed travel: bf16 for 'bf16', else fp32."""
    payload_codecs(name)
    return "bf16" if name == "bf16" else "fp32"


def receiver_codecs(name: str) -> frozenset[CodecSpec] | None:
    """The compressed specs a server of preset `name` accepts in replies (None: none)."""
    codecs = payload_codecs(name)
    return None if codecs is None else codecs.specs()


def downlink_codecs(name: str) -> frozenset[CodecSpec] | None:
    """The compressed specs a worker of preset `name` accepts in the server's states (None: none)."""
    codecs = payload_codecs(name)
    return None if codecs is None else codecs.down_specs()
