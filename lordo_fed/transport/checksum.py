"""The data plane's integrity check: a digest of every payload, computed by its sender and its
receiver as the bytes stream (docs/deployment.md, "Integrity on the data plane").

Why two kinds: the check is there against corruption (a truncated spool, a framing bug, a bit
flipped on a plaintext link) and to let a Flower reply name the upload it vouches for; who sent
the bytes is already proven by the capability token (lordo_fed.transport.tokens), and under TLS
the bytes in transit are authenticated by TLS itself. A cryptographic hash adds nothing to
either and costs the most CPU on the data plane's path (sha256 runs at ~0.8–2 GB/s per core
here, and every byte is hashed twice, by its sender and its receiver; results.md, section 9):
- `xxh3` (the default): XXH3-128, a non-cryptographic checksum at memory speed (~20 GB/s here),
  as strong as a CRC against accidental corruption;
- `sha256`: for a deployment that wants a cryptographic digest of every payload in its logs.

The server picks the kind for both directions; the ticket names it, and an upload that declares
another kind is refused.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import xxhash

from lordo_fed.app import CHECKSUMS  # the `data-plane-checksum` run-config key's values

__all__ = ["CHECKSUMS", "HEX_LENGTH", "check_kind", "checksum_of", "digest_of", "is_digest", "new_digest"]
HEX_LENGTH = {"xxh3": 32, "sha256": 64}
"""Length of each kind's lowercase hex digest."""


class Digest(Protocol):
    def update(self, data, /) -> None: ...

    def hexdigest(self) -> str: ...


def check_kind(kind: str) -> str:
    """`kind` when it is one of `CHECKSUMS`, else ValueError naming it and what was expected."""
    if kind not in CHECKSUMS:
        raise ValueError(f"data-plane checksum {kind!r}: expected one of {CHECKSUMS}")
    return kind


def new_digest(kind: str) -> Digest:
    """A running digest of kind `kind` (`update` as the bytes stream, `hexdigest` at the end)."""
    return xxhash.xxh3_128() if check_kind(kind) == "xxh3" else hashlib.sha256()


def digest_of(kind: str, data) -> str:
    """The lowercase hex digest of `data` (any buffer) in kind `kind`."""
    d = new_digest(kind)
    d.update(data)
    return d.hexdigest()


def checksum_of(message) -> str:
    """The digest kind a Ticket, Chunk or UploadChunk names (proto/lordo_fed/v1/dataplane.proto):
    "sha256" when it names none, as a peer from before the `checksum` fields sends."""
    return message.checksum or "sha256"


def is_digest(kind: str, text: str) -> bool:
    """Whether `text` has the form of a `kind` digest (lowercase hex of its length)."""
    return len(text) == HEX_LENGTH.get(kind, -1) and all(c in "0123456789abcdef" for c in text)
