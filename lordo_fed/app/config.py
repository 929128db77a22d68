"""Settings of a Flower run: flat run-config keys, Hydra presets, one validation before round 1.

Precedence, lowest first: the defaults of `AppConfig`; the Hydra preset named by the `preset`
run-config key (a YAML file in `PRESET_DIR`, lordo_fed/app/presets/, composed with Hydra's Compose API because
`@hydra.main` cannot wrap Flower code); then every flat run-config key whose value differs from
its default in pyproject.toml (which equals `AppConfig`'s, a test checks it). So
`flwr run . --run-config "preset='paper-16m' rank=32"` takes the 16M preset with rank 32.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from lordo_fed.config import (FlatKey, ListSyntaxError, expand_repeats, flat_keys, get_dotted, register_resolvers, section,
                              setting)
from lordo_fed.app import CHECKSUMS
from lordo_fed.rounds.config import CommonConfig
from lordo_fed.rounds.methods import METHODS, resolve_method
from lordo_fed.wire.payload import resolve_payload

PRESET_DIR = Path(__file__).resolve().parent / "presets"
"""The Hydra presets of the Flower app (`preset` run-config key): installed with the package, so the
ServerApp, every ClientApp and every node worker read the same files."""
CLIENT_STATE_STORES = ("disk", "context")
DATA_PLANE_MODES = ("auto", "grpc", "flower")


@dataclass
class DataPlaneConfig:
    """Where a round's payloads travel: Flower's messages, or the gRPC data plane beside them."""

    mode: str = setting("data-plane", "auto")
    """'grpc' (payloads over the data plane, Flower carries tickets), 'flower' (payloads inside
    Flower's messages) or 'auto' (grpc in a deployment, flower in simulation)."""
    bind: str = setting("data-plane-bind", "127.0.0.1")
    """Address the ServerApp's data plane listens on ('0.0.0.0' for nodes on other machines)."""
    address: str = setting("data-plane-address", "")
    """Host the nodes dial ('' = the bind address; set it when binding 0.0.0.0)."""
    port: int = setting("data-plane-port", 0)
    """Port of the data plane (0 = any free port; fix it to open it in a firewall)."""
    certfile: str = setting("data-plane-certfile", "")
    """TLS certificate (PEM) of the data plane: the SuperLink's server.pem (generate_certs.py)."""
    keyfile: str = setting("data-plane-keyfile", "")
    """Private key (PEM) of that certificate: the SuperLink's server.key."""
    insecure: bool = setting("data-plane-insecure", False)
    """Serve plaintext without a certificate (as Flower's --insecure); refused otherwise."""
    stall_timeout: float = setting("data-plane-stall-timeout", 30.0)
    """Seconds a transfer may go without a chunk before the data plane drops it."""
    memory_mb: int = setting("data-plane-memory-mb", 1024)
    """MB of replies the server holds in memory; the rest spill to disk (bounded server memory)."""
    max_uploads: int = setting("data-plane-max-uploads", 4)
    """Uploads the server reads at once; later ones wait their turn (memory flat in the number of nodes)."""
    checksum: str = setting("data-plane-checksum", CHECKSUMS[0])
    """Digest of every payload, both ways: 'xxh3' (fast, against corruption) or 'sha256' (cryptographic)."""

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
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"data_plane.checksum={self.checksum!r}: expected one of {CHECKSUMS}")
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


@dataclass
class AppConfig(CommonConfig):
    """One Flower run of one method."""

    out_dir: str = setting("output-dir", "outputs/flower")
    """Where metrics, plots, checkpoints and client state go (give an absolute path: Flower runs the
    app from an installed copy, in its own working directory)."""
    variant: str = setting("variant", "lordo_global")
    """Method: lordo_global, lordo_local, diloco, local_adam, desloc; asynchronous: async_diloco, async_lookahead, heloco,
    async_lordo, heloco_lordo."""
    num_rounds: int = setting("num-server-rounds", 4)
    """Federated rounds (K local steps each); asynchronous variants: the same tokens, num_rounds x nodes replies."""
    min_clients: int = setting("min-clients", 2)
    """Replies needed to apply a round; fewer, and the round is skipped (θ unchanged)."""
    round_timeout: float = setting("round-timeout", 600.0)
    """Seconds to wait for the replies of a round; later replies are excluded from it."""
    resume: str = setting("resume", "")
    """Checkpoint to resume from: a round JSON or a checkpoint directory ('' = start fresh)."""
    checkpoint_keep: int = 2
    """Newest checkpoints kept in out_dir/checkpoints."""
    outlier_factor: float = setting("outlier-factor", 0.0)
    """Drop a reply whose ||Δ|| exceeds this multiple of the round's median (0 = off)."""
    client_state: str = setting("client-state", "disk")
    """Where a client keeps its state between rounds: 'disk' (node-local files) or 'context'."""
    client_state_dir: str = ""
    """Directory for client state files ('' = <out_dir>/client_state)."""
    progress: bool = False
    """Show a progress bar of the local steps on each client."""
    data_plane: DataPlaneConfig = section(DataPlaneConfig)
    """How payloads travel: inside Flower's messages, or over the gRPC data plane beside them."""

    def validate(self) -> "AppConfig":
        if self.variant not in METHODS or METHODS[self.variant].loop not in ("rounds", "async"):
            allowed = sorted(n for n, s in METHODS.items() if s.loop in ("rounds", "async"))
            raise ValueError(f"variant={self.variant!r}: expected one of {allowed}")
        for name in ("num_rounds", "min_clients", "checkpoint_keep"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer > 0")
        if not self.round_timeout > 0:
            raise ValueError(f"round_timeout={self.round_timeout!r}: expected seconds > 0")
        if not (self.outlier_factor == 0 or (math.isfinite(self.outlier_factor) and self.outlier_factor >= 1)):
            raise ValueError(f"outlier_factor={self.outlier_factor!r}: expected 0 (off) or a finite number >= 1 "
                             f"(a multiple of the round's median pseudo-gradient norm)")
        if self.client_state not in CLIENT_STATE_STORES:
            raise ValueError(f"client_state={self.client_state!r}: expected one of {CLIENT_STATE_STORES}")
        self.data_plane.validate()
        super().validate()
        codecs = resolve_payload(self.payload_dtype).codecs
        spec = METHODS[self.variant]
        outer_name = "diloco_outer" if spec.diloco_outer else "outer"
        if codecs is not None and codecs.relay and spec.loop != "rounds":
            resolve_payload(self.payload_dtype).check_method(False, asynchronous=True)  # raises, naming why
        if codecs is not None and codecs.relay and getattr(self, outer_name).name != "average":
            raise ValueError(f"payload_dtype={self.payload_dtype!r} with {outer_name}.name="
                             f"{getattr(self, outer_name).name!r} (variant {self.variant!r}): every client replays the "
                             f"server's outer step from the relayed replies, which needs {outer_name}.name='average' "
                             "(the `diloco-sparse` preset's)")
        resolve_method(self.variant, self.inner, self.rounds, self.outer, self.diloco_outer,
                       self.total_steps)  # the method's own checks
        return self

    @property
    def total_steps(self) -> int:
        """Local steps of the whole run (the learning-rate schedule's horizon)."""
        return self.rounds.steps_before(self.num_rounds + 1)


FLAT: dict[str, FlatKey] = flat_keys(AppConfig)
"""Every flat run-config key of a Flower run, derived from the fields of `AppConfig`'s tree that are
declared with `setting` (lordo_fed.config). These, plus `preset`, are the keys of
[tool.flwr.app.config] in pyproject.toml (a test checks both hold the same defaults)."""
FLAT_KEYS: dict[str, str] = {k: f.dotted for k, f in FLAT.items()}
"""Flat key -> dotted field of AppConfig."""
LIST_KEYS: dict[str, type] = {k: f.item_type for k, f in FLAT.items() if f.item_type is not None}
"""Flat keys of list fields, written as comma-separated numbers ('1,1,4'; '' = []), and their item type;
`value*count` repeats a value (`local-steps-ramp='2*256'`: 256 rounds of 2 steps)."""


def flat_defaults() -> dict[str, Any]:
    """The default of every flat key (what pyproject.toml's [tool.flwr.app.config] must hold)."""
    base = AppConfig()
    return {"preset": "", **{k: ("" if k in LIST_KEYS or FLAT[k].optional and get_dotted(base, v) is None
                                 else get_dotted(base, v)) for k, v in FLAT_KEYS.items()}}


def _parse_list(key: str, value: str) -> list:
    """'1, 1, 4' -> [1.0, 1.0, 4.0] (the item type of `LIST_KEYS[key]`); '2*3,4' -> [2, 2, 2, 4]; '' -> []
    (`lordo_fed.config.expand_repeats`)."""
    kind = LIST_KEYS[key]
    what = "integers" if kind is int else "numbers"
    each = ", one per partition," if key.startswith("async-") else ""
    try:
        return expand_repeats(value, float if kind is float else int)
    except ListSyntaxError:
        raise ValueError(f"run-config key {key!r}={value!r}: expected comma-separated {what}{each} like '1,1,4' "
                         f"(value*count repeats one: '2*256'), or '' for the default") from None
    except ValueError as err:
        raise ValueError(f"run-config key {key!r}={value!r}: {err}") from None


def load_app_config(run_config: Mapping[str, Any], preset_dir: Path = PRESET_DIR,
                    explicit: Iterable[str] = ()) -> AppConfig:
    """Compose and validate the run's settings; any bad key or value raises ValueError naming it.

    Flower hands the app the run config already merged with pyproject.toml's defaults, so a key
    holding its default value looks unset and leaves the preset's value in place. `explicit` names
    the keys the user did set (`flwr run --run-config`, Flower's `Run.override_config`): those win
    over the preset even when they equal the default (`preset='quickstart' local-steps=32`).
    """
    explicit = set(explicit)
    unknown = sorted(set(run_config) - set(FLAT_KEYS) - {"preset"})
    if unknown:
        raise ValueError(f"unknown run-config key(s) {unknown}: expected any of {sorted(FLAT_KEYS) + ['preset']}")
    defaults = flat_defaults()
    overrides = {}
    for key, value in run_config.items():
        if key == "preset":
            continue
        default = defaults[key]
        if FLAT[key].optional:  # '' = None (the method's own default), else a value of the field's type
            if value == "":
                if key in explicit:
                    overrides[FLAT_KEYS[key]] = None
                continue
            default = FLAT[key].type()
        if isinstance(default, bool) != isinstance(value, bool) or (
                isinstance(default, int) and not isinstance(value, int)) or (
                isinstance(default, float) and not isinstance(value, (int, float))) or (
                isinstance(default, str) and not isinstance(value, str)):
            kind = {bool: "true or false", int: "a number (an integer)", float: "a number", str: "a string"}[type(default)]
            like = "or '' for the method's own" if FLAT[key].optional else f"like the default {default!r}"
            raise ValueError(f"run-config key {key!r}={value!r}: expected {kind} {like}")
        if value == default and key not in explicit and not FLAT[key].optional:
            continue
        overrides[FLAT_KEYS[key]] = _parse_list(key, value) if key in LIST_KEYS else value
    cfg = compose_app_config(str(run_config.get("preset", "")), overrides, preset_dir)
    try:
        return cfg.validate()
    except ValueError as err:
        raise ValueError(_name_flat_key(str(err))) from err


def compose_app_config(preset: str, overrides: Mapping[str, Any], preset_dir: Path = PRESET_DIR) -> AppConfig:
    """AppConfig defaults < preset YAML < overrides (dotted keys), through Hydra's Compose API."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if preset and not (preset_dir / f"{preset}.yaml").is_file():
        available = sorted(p.stem for p in preset_dir.glob("*.yaml"))
        raise ValueError(f"run-config key 'preset'={preset!r}: no {preset}.yaml in {preset_dir}; expected one of {available}")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()  # a preset may write a long list as ${repeat:2*256}
    ConfigStore.instance().store(name="app", node=AppConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(preset_dir), version_base=None):
            raw = compose(config_name=preset or "app",
                          overrides=[f"{k}={_hydra_value(v)}" for k, v in overrides.items()])
        return OmegaConf.to_object(raw)
    except (HydraException, OmegaConfBaseException) as err:
        # A wrong type or an unknown key in a preset YAML: name the dotted key, keep the reason.
        cause = err if isinstance(err, OmegaConfBaseException) else (err.__cause__ or err.__context__)
        if isinstance(cause, OmegaConfBaseException) and cause.full_key and cause.msg:
            where = f" (preset {preset!r})" if preset else ""
            raise ValueError(f"{cause.full_key}: {str(cause.msg).splitlines()[0]}{where}") from err
        raise ValueError(f"preset {preset!r}: {err}") from err


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _name_flat_key(message: str) -> str:
    """Prefix a validation message with the run-config key it is about, when one matches: the
    dotted field (inner.lr=, num_rounds=) or its class-qualified form (data.seq_len ->
    DataConfig.seq_len=, model.preset -> ModelConfig.preset=). Fields no flat key sets
    (diloco_outer.lr, DataConfig.seed) keep their own name only."""
    found = []  # (where the field is named, key): the message is about the field it names first
    for flat, dotted in FLAT_KEYS.items():
        section, _, field_name = dotted.rpartition(".")
        names = [dotted] + ([f"{section[:1].upper()}{section[1:]}Config.{field_name}"] if section else [])
        found += [(m.start(), flat) for name in names if (m := re.search(rf"(^|\s){re.escape(name)}=", message))]
    return f"run-config key {min(found)[1]!r}: {message}" if found else message


def as_dict(cfg: AppConfig) -> dict:
    return dataclasses.asdict(cfg)
