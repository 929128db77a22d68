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

from lordo_fed.rounds.config import CommonConfig
from lordo_fed.rounds.methods import METHODS
from lordo_fed.transport.config import DataPlaneConfig

PRESET_DIR = Path(__file__).resolve().parent / "presets"
"""The Hydra presets of the Flower app (`preset` run-config key): installed with the package, so the
ServerApp, every ClientApp and every node worker read the same files."""
CLIENT_STATE_STORES = ("disk", "context")


@dataclass
class AppConfig(CommonConfig):
    """One Flower run of one method."""

    out_dir: str = "outputs/flower"
    """Where metrics, plots, checkpoints and client state go (give an absolute path: Flower runs the
    app from an installed copy, in its own working directory)."""
    variant: str = "lordo_global"
    """Method: lordo_global, lordo_local, diloco, local_adam, desloc; asynchronous: async_diloco, async_lookahead, heloco,
    async_lordo, heloco_lordo."""
    num_rounds: int = 4
    """Federated rounds (K local steps each); asynchronous variants: the same tokens, num_rounds x nodes replies."""
    min_clients: int = 2
    """Replies needed to apply a round; fewer, and the round is skipped (θ unchanged)."""
    round_timeout: float = 600.0
    """Seconds to wait for the replies of a round; later replies are excluded from it."""
    resume: str = ""
    """Checkpoint to resume from: a round JSON or a checkpoint directory ('' = start fresh)."""
    checkpoint_keep: int = 2
    """Newest checkpoints kept in out_dir/checkpoints."""
    outlier_factor: float = 0.0
    """Drop a reply whose ||Δ|| exceeds this multiple of the round's median (0 = off)."""
    client_state: str = "disk"
    """Where a client keeps its state between rounds: 'disk' (node-local files) or 'context'."""
    client_state_dir: str = ""
    """Directory for client state files ('' = <out_dir>/client_state)."""
    progress: bool = False
    """Show a progress bar of the local steps on each client."""
    data_plane: DataPlaneConfig = dataclasses.field(default_factory=DataPlaneConfig)
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
        if METHODS[self.variant].loop == "async" and self.data_plane.mode == "grpc":
            raise ValueError(f"data_plane.mode='grpc' with the asynchronous variant {self.variant!r}: not built yet "
                             "(asynchronous rounds travel inside Flower's messages); expected 'auto' or 'flower'")
        super().validate()
        return self

    @property
    def total_steps(self) -> int:
        """Local steps of the whole run (the learning-rate schedule's horizon)."""
        return self.num_rounds * self.rounds.local_steps


# Flat run-config key -> dotted field of AppConfig. These are the keys of
# [tool.flwr.app.config] in pyproject.toml, plus `preset`.
FLAT_KEYS: dict[str, str] = {
    "num-server-rounds": "num_rounds",
    "variant": "variant",
    "local-steps": "rounds.local_steps",
    "dense-sync-factor": "rounds.dense_sync_factor",
    "rank": "inner.rank",
    "omega": "inner.omega",
    "lr": "inner.lr",
    "warmup-steps": "inner.warmup_steps",
    "proj-method": "inner.proj_method",
    "error-feedback": "inner.error_feedback",
    "full-rank-term": "inner.full_rank_term",
    "ef-decay": "inner.ef_decay",
    "ef-density": "inner.ef_density",
    "ef-reset": "inner.ef_reset",
    "sync-ef": "rounds.sync_ef",
    "overlap-delay": "rounds.overlap_delay",
    "switch-step": "inner.switch_step",
    "model-preset": "model.preset",
    "outer": "outer.name",
    "outer-lr": "outer.lr",
    "payload-dtype": "payload_dtype",
    "data-path": "data.path",
    "val-path": "data.val_path",
    "text-field": "data.text_field",
    "batch-size": "data.batch_size",
    "seq-len": "data.seq_len",
    "output-dir": "out_dir",
    "seed": "seed",
    "device": "device",
    "threads": "threads",
    "eval-every": "eval_every",
    "eval-batches": "eval_batches",
    "min-clients": "min_clients",
    "round-timeout": "round_timeout",
    "resume": "resume",
    "tensorboard": "tensorboard",
    "client-state": "client_state",
    "outlier-factor": "outlier_factor",
    "data-plane": "data_plane.mode",
    "data-plane-bind": "data_plane.bind",
    "data-plane-address": "data_plane.address",
    "data-plane-port": "data_plane.port",
    "data-plane-certfile": "data_plane.certfile",
    "data-plane-keyfile": "data_plane.keyfile",
    "data-plane-insecure": "data_plane.insecure",
    "data-plane-stall-timeout": "data_plane.stall_timeout",
    "data-plane-memory-mb": "data_plane.memory_mb",
    "data-plane-max-uploads": "data_plane.max_uploads",
    "async-order": "async_rounds.order",
    "async-weight": "async_rounds.weight",
    "async-max-staleness": "async_rounds.max_staleness",
    "async-speeds": "async_rounds.speeds",
    "async-local-steps": "async_rounds.local_steps",
}
LIST_KEYS: dict[str, type] = {"async-speeds": float, "async-local-steps": int}
"""Flat keys of list fields, written as comma-separated numbers ('1,1,4'; '' = []), and their item type."""


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def flat_defaults() -> dict[str, Any]:
    """The default of every flat key (what pyproject.toml's [tool.flwr.app.config] must hold)."""
    base = AppConfig()
    return {"preset": "", **{k: ("" if k in LIST_KEYS else _get(base, v)) for k, v in FLAT_KEYS.items()}}


def _parse_list(key: str, value: str) -> list:
    """'1, 1, 4' -> [1.0, 1.0, 4.0] (the item type of `LIST_KEYS[key]`); '' -> []."""
    kind = LIST_KEYS[key]
    items = [v.strip() for v in value.split(",")] if value.strip() else []
    try:
        out = [kind(float(v)) if kind is float else int(v) for v in items]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise ValueError(f"run-config key {key!r}={value!r}: expected comma-separated {what} like '1,1,4' "
                         "(one per partition), or '' for the default") from None
    return out


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
        if isinstance(default, bool) != isinstance(value, bool) or (
                isinstance(default, int) and not isinstance(value, int)) or (
                isinstance(default, float) and not isinstance(value, (int, float))) or (
                isinstance(default, str) and not isinstance(value, str)):
            kind = {bool: "true or false", int: "a number (an integer)", float: "a number", str: "a string"}[type(default)]
            raise ValueError(f"run-config key {key!r}={value!r}: expected {kind} like the default {default!r}")
        if value == default and key not in explicit:
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
    for flat, dotted in FLAT_KEYS.items():
        section, _, field_name = dotted.rpartition(".")
        names = [dotted] + ([f"{section[:1].upper()}{section[1:]}Config.{field_name}"] if section else [])
        if any(re.search(rf"(^|\s){re.escape(name)}=", message) for name in names):
            return f"run-config key {flat!r}: {message}"
    return message


def as_dict(cfg: AppConfig) -> dict:
    return dataclasses.asdict(cfg)
