"""Settings of the data plane (run-config keys `data-plane*`, lordo_fed/app/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA_PLANE_MODES = ("auto", "grpc", "flower")


@dataclass
class DataPlaneConfig:
    """Where a round's payloads travel: Flower's messages, or the gRPC data plane beside them."""

    mode: str = "auto"
    """'grpc' (payloads over the data plane, Flower carries tickets), 'flower' (payloads inside
    Flower's messages) or 'auto' (grpc in a deployment, flower in simulation)."""
    bind: str = "127.0.0.1"
    """Address the ServerApp's data plane listens on ('0.0.0.0' for nodes on other machines)."""
    address: str = ""
    """Host the nodes dial ('' = the bind address; set it when binding 0.0.0.0)."""
    port: int = 0
    """Port of the data plane (0 = any free port; fix it to open it in a firewall)."""
    certfile: str = ""
    """TLS certificate (PEM) of the data plane: the SuperLink's server.pem (generate_certs.py)."""
    keyfile: str = ""
    """Private key (PEM) of that certificate: the SuperLink's server.key."""
    insecure: bool = False
    """Serve plaintext without a certificate (as Flower's --insecure); refused otherwise."""
    stall_timeout: float = 30.0
    """Seconds a transfer may go without a chunk before the data plane drops it."""
    memory_mb: int = 1024
    """MB of replies the server holds in memory; the rest spill to disk (bounded server memory)."""
    max_uploads: int = 4
    """Uploads the server reads at once; later ones wait their turn (memory flat in the number of nodes)."""

    def validate(self) -> "DataPlaneConfig":
        if self.mode not in DATA_PLANE_MODES:
            raise ValueError(f"data_plane.mode={self.mode!r}: expected one of {DATA_PLANE_MODES}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"data_plane.port={self.port!r}: expected 0 (any free port) or 1..65535")
        if not self.stall_timeout > 0:
            raise ValueError(f"data_plane.stall_timeout={self.stall_timeout!r}: expected seconds > 0")
        if self.memory_mb < 0:
            raise ValueError(f"data_plane.memory_mb={self.memory_mb!r}: expected MB >= 0")
        if isinstance(self.max_uploads, bool) or not isinstance(self.max_uploads, int) or self.max_uploads < 1:
            raise ValueError(f"data_plane.max_uploads={self.max_uploads!r}: expected an integer >= 1")
        if self.certfile and not self.keyfile:
            raise ValueError(f"data_plane.certfile={self.certfile!r} without data_plane.keyfile: expected both "
                             "(TLS) or neither")
        if self.keyfile and not self.certfile:
            raise ValueError(f"data_plane.keyfile={self.keyfile!r} without data_plane.certfile: expected both "
                             "(TLS) or neither")
        if self.certfile and self.insecure:
            raise ValueError("data_plane.insecure=True with a certfile: expected one or the other")
        return self

    def tls(self) -> tuple[bytes, bytes] | None:
        """(certificate chain, private key) PEM bytes; None when insecure. Raises ValueError naming
        what is missing when a grpc data plane has neither TLS files nor insecure=True."""
        if self.insecure:
            return None
        if not self.certfile:
            raise ValueError("data-plane='grpc' needs TLS: set data-plane-certfile and data-plane-keyfile (the "
                             "SuperLink's server.pem and server.key from scripts/generate_certs.py), or "
                             "data-plane-insecure=true for a plaintext deployment (as flower-superlink --insecure)")
        out = []
        for key, path in (("data-plane-certfile", self.certfile), ("data-plane-keyfile", self.keyfile)):
            try:
                out.append(Path(path).expanduser().read_bytes())
            except OSError as err:
                raise ValueError(f"run-config key {key!r}={path!r}: cannot read it ({err.strerror})") from err
        return out[0], out[1]
