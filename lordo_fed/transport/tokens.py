"""Capability tokens of the data plane: one node, one round, one direction, until a deadline.

The server mints a token per node and round for the download of the round's state and another
for the upload of the node's reply, and sends both inside that node's Flower message (which
Flower delivers to that node alone, over TLS with node authentication in a secure deployment).
Holding the token is the permission: the data plane checks it on every call.

A token is `<claims>.<mac>`: the claims (node id, round, direction, expiry, a random nonce) in
URL-safe base64 JSON, and an HMAC-SHA256 of them under a secret that only the server process
holds (a new one per run: tokens of an earlier run are worthless). Checking is stateless but for
replays: an upload token is spent once its upload is accepted, and a second use is refused.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass

DOWNLOAD = "download"
UPLOAD = "upload"


class TokenError(Exception):
    """A token the data plane refuses; the message says why (logged with the node)."""


@dataclass(frozen=True)
class Claims:
    """What a valid token grants."""

    node_id: int
    round: int
    kind: str
    """DOWNLOAD or UPLOAD."""
    expires: float
    """Unix time after which the token is refused."""
    nonce: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenIssuer:
    """Mints and checks the tokens of one server run (thread-safe)."""

    def __init__(self, secret: bytes | None = None, clock=time.time):
        self._secret = secret or secrets.token_bytes(32)
        self._clock = clock
        self._spent: set[str] = set()
        self._lock = threading.Lock()

    def issue(self, node_id: int, round_idx: int, kind: str, ttl: float) -> str:
        """A token for `node_id` to `kind` the payload of round `round_idx`, valid `ttl` seconds."""
        if kind not in (DOWNLOAD, UPLOAD):
            raise ValueError(f"token kind {kind!r}: expected {DOWNLOAD!r} or {UPLOAD!r}")
        claims = {"n": int(node_id), "r": int(round_idx), "k": kind, "e": self._clock() + ttl,
                  "x": secrets.token_hex(8)}
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{body}.{_b64(self._mac(body))}"

    def check(self, token: str, node_id: int, kind: str, round_idx: int | None = None) -> Claims:
        """The claims of `token` presented by `node_id` for `kind`; TokenError says why not:
        missing, malformed, forged (wrong MAC), another direction, another node's, another
        round's, expired, or an upload token already spent."""
        if not token:
            raise TokenError("no token")
        body, _, mac = token.partition(".")
        try:
            given = _unb64(mac)
        except (ValueError, TypeError):
            raise TokenError("malformed token") from None
        if not body or not hmac.compare_digest(given, self._mac(body)):
            raise TokenError("invalid token (not issued by this server run)")
        raw = json.loads(_unb64(body))
        claims = Claims(int(raw["n"]), int(raw["r"]), str(raw["k"]), float(raw["e"]), str(raw["x"]))
        if claims.kind != kind:
            raise TokenError(f"a {claims.kind} token presented for an {kind}" if kind == UPLOAD
                             else f"an {claims.kind} token presented for a {kind}")
        if claims.node_id != int(node_id):
            raise TokenError(f"token issued to node {claims.node_id}, presented by node {node_id}")
        if round_idx is not None and claims.round != round_idx:
            raise TokenError(f"token for round {claims.round}, the data plane serves round {round_idx}")
        if self._clock() > claims.expires:
            raise TokenError(f"token expired {self._clock() - claims.expires:.1f}s ago")
        if kind == UPLOAD:
            with self._lock:
                if claims.nonce in self._spent:
                    raise TokenError("upload token already used (replayed)")
        return claims

    def spend(self, claims: Claims) -> bool:
        """Mark an upload token as used; False if it already was (a concurrent replay)."""
        with self._lock:
            if claims.nonce in self._spent:
                return False
            self._spent.add(claims.nonce)
            return True

    def _mac(self, body: str) -> bytes:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).digest()
