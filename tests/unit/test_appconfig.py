"""Flower run settings: pyproject keys, Hydra presets, precedence, errors before round 1."""

import tomllib
from pathlib import Path

import pytest

from lordo_fed.app.config import FLAT_KEYS, PRESET_DIR, flat_defaults, load_app_config

ROOT = Path(__file__).resolve().parents[2]


def pyproject_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_keys_and_defaults_match_the_app_config():
    assert pyproject_config() == flat_defaults()


def test_every_preset_composes_and_validates():
    presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    assert {"quickstart", "paper-16m", "paper-125m", "paper-360m", "paper-720m", "diloco", "local-adam",
            "desloc", "lordo-local", "sparseloco", "lordo-sparse", "diloco-sparse", "diloco-relay",
            "lordo-ramp"} <= set(presets)
    for name in presets:
        cfg = load_app_config({**pyproject_config(), "preset": name})
        assert cfg.num_rounds > 0, name
    ramp = load_app_config({**pyproject_config(), "preset": "lordo-ramp"})
    # the measured recipe: 256 rounds of 2 steps, then K = 32, int8, 2,048 steps (64 rounds of K = 32's tokens)
    assert (ramp.variant, ramp.rounds.local_steps_ramp, ramp.payload_dtype) == ("lordo_global", [2] * 256, "int8")
    assert (ramp.num_rounds, ramp.total_steps) == (304, 2048)
    # issue 30's recipe as measured (the ladder's avg-relay-1bit-lrs at outer lr 1.3)
    relay = load_app_config({**pyproject_config(), "preset": "diloco-relay"})
    assert (relay.variant, relay.payload_dtype, relay.rounds.wire_ef_decay, relay.rounds.wire_ef_lr_scale,
            relay.rounds.sparse_mean, relay.diloco_outer.name, relay.diloco_outer.lr) == (
        "diloco", "topk1bit-relay", 0.9, True, "all", "average", 1.3)


def test_precedence_defaults_then_preset_then_run_config():
    base = pyproject_config()
    cfg = load_app_config(base)
    assert (cfg.model.preset, cfg.inner.rank) == ("small", 8)
    cfg = load_app_config({**base, "preset": "paper-16m"})
    assert (cfg.model.preset, cfg.inner.rank, cfg.num_rounds) == ("16m", 32, 256)
    cfg = load_app_config({**base, "preset": "paper-16m", "rank": 16, "num-server-rounds": 3})
    assert (cfg.model.preset, cfg.inner.rank, cfg.num_rounds) == ("16m", 16, 3)
    assert load_app_config({**base, "preset": "diloco"}).variant == "diloco"


def test_a_key_the_user_set_wins_over_the_preset_even_at_its_default():
    """Flower merges pyproject's defaults into the run config: local-steps=32 (the default) looks
    unset, and quickstart's 16 stays, unless the key is named as set (Run.override_config)."""
    run_config = {**pyproject_config(), "preset": "quickstart", "local-steps": 32, "model-preset": "small"}
    merged = load_app_config(run_config)
    assert (merged.rounds.local_steps, merged.model.preset) == (16, "tiny")
    chosen = load_app_config(run_config, explicit=("local-steps", "model-preset", "preset"))
    assert (chosen.rounds.local_steps, chosen.model.preset) == (32, "small")
    assert chosen.inner.rank == merged.inner.rank == 8 and chosen.data.seq_len == 64  # the rest: quickstart's


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("omega", 1.5, "run-config key 'omega': inner.omega=1.5: expected a number in [0, 1]"),
        ("seq-len", 0, "run-config key 'seq-len': DataConfig.seq_len=0"),
        ("payload-dtype", "fp8", "run-config key 'payload-dtype': payload_dtype='fp8': expected one of ('fp32', 'bf16', 'int8', 'int4', 'topk2bit', 'topk2bit-both', 'topk2bit-all', 'topk2bit-relay', 'topk1bit-relay', 'topk2bit-both-wide', 'topk2bit-both-wide-d64', 'topk2bit-both-wide-tiles', 'topk2bit-lut', 'lowrank+topk2bit', 'lowrank+topk2bit-wide', 'lowrank+topk2bit+rows')"),
        ("variant", "ddp", "run-config key 'variant': variant='ddp': expected one of"),
        ("rank", "x", "run-config key 'rank'='x': expected a number"),
        ("preset", "nope", "run-config key 'preset'='nope': no nope.yaml"),
        ("outer-lr", -1.0, "run-config key 'outer-lr': outer.lr=-1.0"),
        ("model-preset", "1b", "model-preset"),
        ("proj-method", "qr", "run-config key 'proj-method': inner.proj_method='qr'"),
        ("min-clients", 0, "run-config key 'min-clients': min_clients=0"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(key, value, message):
    with pytest.raises(ValueError) as err:
        load_app_config({**pyproject_config(), key: value})
    assert message in str(err.value)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="unknown run-config key\\(s\\) \\['ranks'\\]"):
        load_app_config({**pyproject_config(), "ranks": 4})


def test_flat_keys_point_at_real_fields():
    defaults = flat_defaults()
    assert set(defaults) == set(FLAT_KEYS) | {"preset"}


def test_lr_and_ef_decay_left_empty_take_each_methods_own(monkeypatch):
    """'' (pyproject's default) leaves inner.lr and inner.ef_decay to the method (`METHOD_DEFAULTS`); a
    value the run sets wins for the method it runs, 0.0 included (not mistaken for "unset"); a preset's
    value stands unless the run sets the key; '' named as set takes the preset's value back."""
    from lordo_fed.rounds import methods

    monkeypatch.setitem(methods.METHOD_DEFAULTS, "lordo_local", {"lr": 1e-3, "ef_decay": 1.0})
    base = pyproject_config()

    def resolved(run_config, explicit=()):
        cfg = load_app_config(run_config, explicit=explicit)
        return methods.resolve_method(cfg.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps).inner

    cfg = load_app_config({**base, "variant": "lordo_local"})
    assert (cfg.inner.lr, cfg.inner.ef_decay) == (None, None)
    own = resolved({**base, "variant": "lordo_local"})
    assert (own.lr, own.ef_decay) == (1e-3, 1.0)
    other = resolved({**base, "variant": "lordo_global"})
    assert (other.lr, other.ef_decay) == tuple(methods.METHOD_DEFAULTS["lordo_global"][k] for k in ("lr", "ef_decay"))
    chosen = resolved({**base, "variant": "lordo_local", "lr": 0.02, "ef-decay": 0.0})
    assert (chosen.lr, chosen.ef_decay) == (0.02, 0.0)
    assert resolved({**base, "preset": "paper-16m", "variant": "lordo_local"}).lr == 0.008  # the preset's
    assert resolved({**base, "preset": "paper-16m", "variant": "lordo_local", "lr": ""}, explicit=("lr",)).lr == 1e-3
    with pytest.raises(ValueError, match=r"run-config key 'lr'='fast': expected a number or '' for the method's own"):
        load_app_config({**base, "lr": "fast"})


def test_moment_sync_periods_left_empty_take_each_methods_own():
    """'' leaves K_u and K_v to the method (LoRDO-Global every round, DES-LOC 3 and 6); a value the run sets
    wins, for DES-LOC's periods as for LoRDO-Global's; a preset's periods stand unless the run sets the key.
    What the rounds then average: part fifteen's setting (docs/results.md, section 17) both moments every 8th."""
    from lordo_fed.rounds import methods

    base = pyproject_config()

    def resolved(run_config):
        cfg = load_app_config(run_config)
        return methods.resolve_method(cfg.variant, cfg.inner, cfg.rounds, cfg.outer, cfg.diloco_outer, cfg.total_steps).rounds

    def periods(rounds):
        return rounds.sync_exp_avg_every, rounds.sync_exp_avg_sq_every

    assert load_app_config(base).rounds.sync_exp_avg_every is None
    assert periods(resolved(base)) == (1, 1)
    assert periods(resolved({**base, "variant": "desloc"})) == (3, 6)
    assert periods(resolved({**base, "variant": "desloc", "sync-exp-avg-every": 2})) == (2, 6)
    assert periods(resolved({**base, "variant": "lordo_local"})) == (0, 0)
    assert periods(resolved({**base, "preset": "lordo-sparse"})) == (0, 0)
    with pytest.raises(ValueError, match=r"bases_from='downlink' with averaged states \(sync_exp_avg_every=0, "
                                         r"sync_exp_avg_sq_every=4"):  # the preset's own bases need local moments
        load_app_config({**base, "preset": "lordo-sparse", "sync-exp-avg-sq-every": 4})
    every8 = resolved({**base, "sync-exp-avg-every": 8, "sync-exp-avg-sq-every": 8})
    assert periods(every8) == (8, 8)
    assert [r for r in range(1, 25) if every8.due(r)] == [8, 16, 24]
    assert every8.due(16) == ("exp_avg", "exp_avg_sq")
