"""Payload presets: which codec each kind of tensor of a round travels with (`payload_dtype`).

| preset      | Δ (error feedback on the worker)        | moments            | the rest  |
|-------------|-----------------------------------------|--------------------|-----------|
| fp32, bf16  | raw                                     | raw                | raw       |
| int8        | int8, one scale per 64 values           | int8 / 64          | fp32      |
| int4        | int4 / 32                               | int8 / 64          | fp32      |
| topk2bit    | top-k 3% of each 4096, 2-bit values     | int8 / 64          | fp32      |

"The rest" is θ (downstream), the shared bases (they must stay orthonormal) and integer tensors.
Δ's compression residual is kept on the worker and added to the next round's Δ (error feedback,
lordo_fed.wire.compress.ErrorFeedback); the moments are states, not increments, and are sent
quantised as they are. A receiver accepts exactly the specs of the run's preset (`codecs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lordo_fed.codec import PAYLOAD_DTYPES
from lordo_fed.wire.compress import CodecSpec


@dataclass(frozen=True)
class PayloadCodecs:
    """The codecs of a compressed preset."""

    delta: CodecSpec
    """Pseudo-gradients, with error feedback of the residual on the worker."""
    moments: CodecSpec
    """Synced optimizer moments (low-rank and full-size)."""

    def specs(self) -> frozenset[CodecSpec]:
        """What a receiver of this preset's payloads configures (`lordo_fed.codec.decode_*`'s `codecs`)."""
        return frozenset(s.canonical() for s in (self.delta, self.moments))


_INT8 = CodecSpec("quant", bits=8, block=64)
PRESETS: dict[str, PayloadCodecs] = {
    "int8": PayloadCodecs(delta=_INT8, moments=_INT8),
    "int4": PayloadCodecs(delta=CodecSpec("quant", bits=4, block=32), moments=_INT8),
    "topk2bit": PayloadCodecs(delta=CodecSpec("topk", bits=2, chunk=4096, density=0.03), moments=_INT8),
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
    """The compressed specs a receiver of preset `name` accepts (None: none)."""
    codecs = payload_codecs(name)
    return None if codecs is None else codecs.specs()
