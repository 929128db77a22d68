"""Payload presets: which codec each kind of tensor of a round travels with (`payload_dtype`).

| preset      | Δ up (error feedback on the worker)     | moments (both ways) | θ down                            |
|-------------|-----------------------------------------|---------------------|-----------------------------------|
| fp32, bf16  | raw                                     | raw                 | raw                               |
| int8        | int8, one scale per 64 values           | int8 / 64 (v: √v)   | int8 / 64 change of the clients' copy |
| int4        | int4 / 32                               | int8 / 64           | int8 / 64 change                  |
| topk2bit    | blocks' matrices: top-k 3% of each 4096, 2-bit values (sign and two magnitudes per chunk), positions Rice-coded; embedding and norms int8 / 64 | int8 / 64 | int8 / 64 change |
| topk2bit-both | every tensor (embedding and norms too) as topk2bit | int8 / 64 | topk2bit change: the server re-sparsifies θ − θ_c, what it leaves stays in θ − θ_c |
| topk2bit-all | every tensor as topk2bit | int8 / 64 | int8 / 64 change |
| topk2bit-relay | every tensor as topk2bit | int8 / 64 | the round's accepted replies, relayed, each node's own left out (it kept it): each worker replays the mean and outer step (θ_c = θ exactly; M − 1 x the uplink) |
| topk1bit-relay | every tensor top-k 3% of each 4096, 1-bit values (the sign and the chunk's mean magnitude), positions Rice-coded | int8 / 64 | as topk2bit-relay |
| topk2bit-both-wide | every tensor as topk2bit | int8 / 64 | as topk2bit at 12% of each chunk: room for the union of 4 workers' 3% |
| topk2bit-both-wide-d64 | every tensor top-k 1/64 (SparseLoCo's production density) | int8 / 64 | top-k 4/64 |
| topk2bit-both-wide-tiles | as topk2bit-both-wide, a 2-D tensor cut into 64×64 tiles (SparseLoCo's cut) | int8 / 64 | as topk2bit-both-wide, tiled |
| topk2bit-lut | as topk2bit, the 2-bit values as SparseLoCo's 4-entry table per tensor | int8 / 64 | int8 / 64 change |
| lowrank+topk2bit | low-rank matrices: coordinates in the round's shared basis int8 / 64 + the residual as topk2bit; the rest as topk2bit | int8 / 64 | int8 / 64 change |
| lowrank+topk2bit-wide | low-rank matrices as lowrank+topk2bit; the rest (embedding and norms too) as topk2bit | int8 / 64 | as topk2bit-both-wide |
| lowrank+topk2bit+rows | as lowrank+topk2bit, the embedding row-sparse: the rows whose change is ≥ 10% of the largest row's, int8 per row | int8 / 64 | int8 / 64 change |

The `lowrank+` presets need shared bases (LoRDO-Global; lordo_fed.wire.lowrank). Δ's compression
residual is kept on the worker and added to the next round's Δ (error feedback,
lordo_fed.wire.compress.ErrorFeedback); the moments are states, not increments, and are sent
quantised as they are, the second moment v through its square root rounded up (v̂ ≥ v: blockwise
int8 of v itself zeroes 74% of a realistic v and multiplies Adam's largest step by 10^6). Downstream the server keeps the clients' copy θ_c of θ (deterministic) and
sends the compressed change θ − θ_c, which both sides add to θ_c (lordo_fed.rounds.aggregator): what the
change leaves out stays in θ − θ_c and goes with a later round. The shared bases travel fp32 (they
must stay orthonormal), integer tensors raw. A receiver accepts exactly the specs of the run's
preset (`Payload.receiver_specs`, `Payload.downlink_specs`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Mapping

from torch import Tensor

from lordo_fed.wire.codec import PAYLOAD_DTYPES
from lordo_fed.model import DEFAULT_LOWRANK_PATTERN
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
    lowrank: CodecSpec | None = None
    """Coordinates of a low-rank matrix's Δ in the round's shared basis (None: Δ whole); its
    residual then travels with `delta` (lordo_fed.wire.lowrank)."""
    dense: CodecSpec | None = None
    """Δ of the parameters outside the blocks' matrices (the embedding, norm gains: names not
    matching `DEFAULT_LOWRANK_PATTERN`), when not `delta` (None: `delta`)."""
    rows: CodecSpec | None = None
    """Δ of the 2-D parameters outside the blocks' matrices (the embedding), row-sparse (None: `dense`)."""
    relay: bool = False
    """θ downstream as the round's accepted replies, relayed as the server received them (issue 30's
    option B, SparseLoCo's all-gather): every worker replays the server's mean and outer step on its
    copy θ_c (lordo_fed.rounds.relay), so θ_c is θ exactly, at M − 1 times the uplink's bytes down (each
    node's own reply is left out of its state: it kept it).
    Needs the plain-average outer step (`outer.name='average'`: nothing but θ to replay)."""

    @property
    def tracks_copy(self) -> bool:
        """Whether θ travels as a change of the clients' copy θ_c (`down` or `relay`), which server and
        workers then keep."""
        return self.down is not None or self.relay

    def delta_spec(self, name: str, shape: tuple[int, ...]) -> CodecSpec:
        """The codec of Δ (or its residual) of parameter `name` of `shape`: `delta` for the blocks'
        matrices; outside them `rows` for a 2-D one (the embedding) and `dense` for the rest.

        Top-k keeps 3% of a tensor a round and error feedback delivers the rest over ~1/3% rounds:
        for the tied embedding (every row's logit moves every step) and the norm gains (4 of 128
        entries a round) that delay made the top-k presets trail fp32 from the first rounds (small
        preset, round 4: val ppl 85.0 with them top-k, 18.8 with them int8, fp32 13.0;
        docs/results.md section 12)."""
        if self.dense is None or _BLOCK_MATRIX.search(name):
            return self.delta
        return self.rows if self.rows is not None and len(shape) == 2 else self.dense

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
        """What the server configures for replies (`lordo_fed.wire.decode.decode_update`'s `codecs`)."""
        return frozenset(s.canonical() for s in (self.delta, self.moments, self.moment_spec("exp_avg_sq/"),
                                                 self.lowrank, self.dense, self.rows) if s is not None)

    def down_specs(self) -> frozenset[CodecSpec]:
        """What a worker configures for the server's states (`decode_global_state`'s `codecs`): with
        `relay` also the replies' specs (the state carries them)."""
        relayed = (self.delta, self.dense, self.rows) if self.relay else ()
        return frozenset(s.canonical() for s in (self.moments, self.moment_spec("exp_avg_sq/"), self.down, *relayed)
                         if s is not None)


_BLOCK_MATRIX = re.compile(DEFAULT_LOWRANK_PATTERN)
_INT8 = CodecSpec("quant", bits=8, block=64)
_TOPK2BIT = CodecSpec("topk", bits=2, chunk=4096, density=0.03, levels="sign", index_coding="rice")
PRESETS: dict[str, PayloadCodecs] = {
    "int8": PayloadCodecs(delta=_INT8, moments=_INT8, down=_INT8),
    "int4": PayloadCodecs(delta=CodecSpec("quant", bits=4, block=32), moments=_INT8, down=_INT8),
    "topk2bit": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8, down=_INT8, dense=_INT8),
    "topk2bit-both": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8, down=_TOPK2BIT),
    "topk2bit-all": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8, down=_INT8),
    "topk2bit-relay": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8, relay=True),
    "topk1bit-relay": PayloadCodecs(delta=dataclasses.replace(_TOPK2BIT, bits=1), moments=_INT8, relay=True),
    "topk2bit-both-wide": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8,
                                        down=dataclasses.replace(_TOPK2BIT, density=0.12)),
    "topk2bit-both-wide-d64": PayloadCodecs(delta=dataclasses.replace(_TOPK2BIT, density=1 / 64), moments=_INT8,
                                            down=dataclasses.replace(_TOPK2BIT, density=4 / 64)),
    "topk2bit-both-wide-tiles": PayloadCodecs(delta=dataclasses.replace(_TOPK2BIT, tile=64), moments=_INT8,
                                              down=dataclasses.replace(_TOPK2BIT, density=0.12, tile=64)),
    "topk2bit-lut": PayloadCodecs(delta=dataclasses.replace(_TOPK2BIT, levels="lut"), moments=_INT8, down=_INT8,
                                  dense=_INT8),
    "lowrank+topk2bit": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8, down=_INT8, lowrank=_INT8, dense=_INT8),
    "lowrank+topk2bit-wide": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8, lowrank=_INT8,
                                           down=dataclasses.replace(_TOPK2BIT, density=0.12)),
    "lowrank+topk2bit+rows": PayloadCodecs(delta=_TOPK2BIT, moments=_INT8, down=_INT8, lowrank=_INT8, dense=_INT8,
                                           rows=CodecSpec("rows", bits=8, threshold=0.1)),
}
PAYLOADS = (*PAYLOAD_DTYPES, *PRESETS)
"""Every value `payload_dtype` takes."""


@dataclass(frozen=True)
class Payload:
    """A run's `payload_dtype`, resolved once (`resolve_payload`) into what each side needs."""

    name: str
    """The preset's name: 'fp32', 'bf16', or a compressed preset of `PRESETS`."""
    codecs: PayloadCodecs | None
    """The codecs of a compressed preset (None for fp32 and bf16)."""

    @property
    def wire_dtype(self) -> str:
        """How the tensors the preset leaves uncompressed travel: bf16 for 'bf16', else fp32."""
        return "bf16" if self.name == "bf16" else "fp32"

    @property
    def receiver_specs(self) -> frozenset[CodecSpec] | None:
        """The compressed specs a server accepts in replies (None: none)."""
        return None if self.codecs is None else self.codecs.specs()

    @property
    def downlink_specs(self) -> frozenset[CodecSpec] | None:
        """The compressed specs a worker accepts in the server's states (None: none)."""
        return None if self.codecs is None else self.codecs.down_specs()

    def check_method(self, shared_bases: bool, asynchronous: bool = False) -> None:
        """Refuse a `lowrank+` preset (ValueError naming it) where no shared basis exists to send Δ's
        coordinates in: methods other than LoRDO-Global, and asynchronous rounds (a stale reply's
        basis is not the server's); and a relaying preset in asynchronous rounds."""
        if self.codecs is not None and self.codecs.relay and asynchronous:
            raise ValueError(f"payload_dtype={self.name!r}: relaying a round's replies needs synchronous rounds (an "
                             "asynchronous pull has no round of replies to replay); use 'topk2bit-both-wide'")
        if self.codecs is None or self.codecs.lowrank is None:
            return
        if asynchronous:
            raise ValueError(f"payload_dtype={self.name!r}: low-rank Δ needs the round's shared basis, which "
                             "asynchronous rounds do not have (a reply trained in an older one); use 'int8', 'int4' "
                             "or 'topk2bit'")
        if not shared_bases:
            raise ValueError(f"payload_dtype={self.name!r}: low-rank Δ is sent in the round's shared basis, which only "
                             "LoRDO-Global (method 'lordo_global', with low-rank matrices) has; use 'topk2bit' "
                             "otherwise")


FP32 = Payload("fp32", None)
"""Uncompressed fp32 tensors both ways (the default)."""


def resolve_payload(name: str) -> Payload:
    """`payload_dtype` `name` as a `Payload`; ValueError naming the choices."""
    if name in PAYLOAD_DTYPES:
        return Payload(name, None)
    if name not in PRESETS:
        raise ValueError(f"payload_dtype={name!r}: expected one of {PAYLOADS}")
    return Payload(name, PRESETS[name])
