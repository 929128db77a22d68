"""Bad settings stop a run before round 1 with a message naming the key, the value and what is
allowed: every constrained run-config key of pyproject.toml's [tool.flwr.app.config], every
constrained field a Hydra preset can set (AppConfig, CommonConfig, InnerConfig, OuterConfig,
RoundConfig, DataConfig, ModelConfig), and a missing corpus or tokenizer (named by its path).

All through `load_app_config`, the function the ServerApp (and every ClientApp) calls first;
the corpus checks through `LoRDOStrategy(cfg)`, which the ServerApp builds right after it.
(tests/unit/test_appconfig.py has a first sample of bad values and the unknown-key check;
tests/integration/test_flower_app.py::test_deployment_two_rounds_and_a_bad_config the end-to-end stop.)
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from lordo_fed.app.config import FLAT_KEYS, PRESET_DIR, load_app_config
from tests.unit.test_appconfig import pyproject_config

VARIANTS = ("['async_diloco', 'async_lookahead', 'async_lordo', 'desloc', 'diloco', 'heloco', 'heloco_lordo', "
            "'local_adam', 'lordo_global', 'lordo_local']")
MODEL_PRESETS = "tiny, small, 16m, 125m, 360m, 720m, custom"
OUTLIER = "expected 0 (off) or a finite number >= 1 (a multiple of the round's median pseudo-gradient norm)"

# (run-config key, bad value, the whole message or its exact beginning)
RUN_CONFIG_CASES = [
    ("num-server-rounds", 0, "run-config key 'num-server-rounds': num_rounds=0: expected an integer > 0"),
    ("num-server-rounds", 2.5, "run-config key 'num-server-rounds'=2.5: expected a number (an integer) like the default 4"),
    ("variant", "fedavg", f"run-config key 'variant': variant='fedavg': expected one of {VARIANTS}"),
    ("local-steps", 0, "run-config key 'local-steps': rounds.local_steps=0: expected an integer > 0"),
    ("local-steps-ramp", "8,x", "run-config key 'local-steps-ramp'='8,x': expected comma-separated integers like "
                                "'1,1,4' (value*count repeats one: '2*256'), or '' for the default"),
    ("local-steps-ramp", "8*x", "run-config key 'local-steps-ramp'='8*x': expected comma-separated integers like "
                                "'1,1,4' (value*count repeats one: '2*256'), or '' for the default"),
    ("local-steps-ramp", "8*0,32", "run-config key 'local-steps-ramp'='8*0,32': '8*0' repeats 8 0 times: expected a "
                                   "count >= 1"),
    ("local-steps-ramp", "32,1*100000", "run-config key 'local-steps-ramp'='32,1*100000': expected at most 100000 "
                                        "items in all"),
    ("local-steps-ramp", "8,8", "run-config key 'local-steps-ramp': rounds.local_steps_ramp=[8, 8]: expected integers "
                                "> 0 whose sum is a multiple of rounds.local_steps=32"),
    ("late-local-steps", 8, "run-config key 'late-local-steps': rounds.late_local_steps=8 with rounds.late_from_step=0: "
                            "expected the global step the short rounds start at"),
    ("late-local-steps", -8, "run-config key 'late-local-steps': rounds.late_local_steps=-8: expected an integer >= 0"),
    ("late-from-step", -1, "run-config key 'late-from-step': rounds.late_from_step=-1: expected an integer >= 0"),
    ("sync-exp-avg-every", -1, "run-config key 'sync-exp-avg-every': rounds.sync_exp_avg_every=-1: expected an integer >= 0 (0 = never)"),
    ("sync-exp-avg-sq-every", 2.5, "run-config key 'sync-exp-avg-sq-every'=2.5: expected a number (an integer) or '' for the method's own"),
    ("dense-sync-factor", -1, "run-config key 'dense-sync-factor': rounds.dense_sync_factor=-1: expected an integer >= 0 (0 = never)"),
    ("rank", -1, "run-config key 'rank': inner.rank=-1: expected an integer > 0"),
    ("rank", 8.5, "run-config key 'rank'=8.5: expected a number (an integer) like the default 8"),
    ("omega", -0.1, "run-config key 'omega': inner.omega=-0.1: expected a number in [0, 1]"),
    ("omega", math.nan, "run-config key 'omega': inner.omega=nan: expected a number in [0, 1]"),
    ("lr", 0.0, "run-config key 'lr': inner.lr=0.0: expected a number > 0"),
    ("lr", math.nan, "run-config key 'lr': inner.lr=nan: expected a number > 0"),
    ("warmup-steps", -1, "run-config key 'warmup-steps': inner.warmup_steps=-1: expected an integer >= 0"),
    ("proj-method", "pca", "run-config key 'proj-method': inner.proj_method='pca': expected one of ('auto', 'svd', 'rsvd', 'dct')"),
    ("error-feedback", "yes", "run-config key 'error-feedback'='yes': expected true or false like the default True"),
    ("error-feedback", 1, "run-config key 'error-feedback'=1: expected true or false like the default True"),
    ("full-rank-term", "grad", "run-config key 'full-rank-term': inner.full_rank_term='grad': expected one of ('error_fed', 'gradient')"),
    ("ef-decay", 1.5, "run-config key 'ef-decay': inner.ef_decay=1.5: expected a number in [0, 1] (1 = the paper)"),
    ("ef-density", 0.0, "run-config key 'ef-density': inner.ef_density=0.0: expected a number in (0, 1] (1 = the whole buffer)"),
    ("ef-reset", "no", "run-config key 'ef-reset'='no': expected true or false like the default False"),
    ("sync-ef", 0, "run-config key 'sync-ef'=0: expected true or false like the default False"),
    ("overlap-delay", 32, "run-config key 'overlap-delay': rounds.overlap_delay=32: expected an integer from 0 "
     "(synchronous rounds) to local_steps - 1 = 31"),
    ("wire-ef-decay", 1.5, "run-config key 'wire-ef-decay': rounds.wire_ef_decay=1.5: expected a number in [0, 1]"),
    ("sparse-mean", "median", "run-config key 'sparse-mean': rounds.sparse_mean='median': expected one of "
                              "('all', 'contributors')"),
    ("clip-median", 1, "run-config key 'clip-median'=1: expected true or false like the default False"),
    ("wire-ef-lr-scale", 1, "run-config key 'wire-ef-lr-scale'=1: expected true or false like the default False"),
    ("bases-from", "clients", "run-config key 'bases-from': rounds.bases_from='clients': expected one of "
                              "('server', 'downlink')"),
    ("switch-step", -1, "run-config key 'switch-step': inner.switch_step=-1: expected an integer >= 0 (0 = one phase)"),
    ("switch-fraction", 1.5, "run-config key 'switch-fraction': inner.switch_fraction=1.5: expected a number in [0, 1) "
                             "(0 = switch_step rules; None: the method's own)"),
    ("model-preset", "7b", f"run-config key 'model-preset': ModelConfig.preset='7b': unknown preset; expected one of {MODEL_PRESETS}"),
    ("outer", "adam", "run-config key 'outer': outer.name='adam': expected one of ['average', 'qhm', 'nesterov', 'mla'] (the outer optimizer)"),
    ("outer-lr", 0.0, "run-config key 'outer-lr': outer.lr=0.0: the outer learning rate must be a finite number > 0"),
    ("outer-lr", math.inf, "run-config key 'outer-lr': outer.lr=inf: the outer learning rate must be a finite number > 0"),
    ("outer-late-lr", -1.0, "run-config key 'outer-late-lr': outer.late_lr=-1.0: the late rounds' outer learning rate "
                            "must be a finite number > 0, or 0 for `lr` throughout"),
    ("outer-late-lr", 2.0, "run-config key 'outer-late-lr': outer.late_lr=2.0: the late rounds start at "
                           "rounds.late_from_step=0, that is never; expected the global step they start at"),
    ("payload-dtype", "fp16", "run-config key 'payload-dtype': payload_dtype='fp16': expected one of ('fp32', 'bf16', "
                              "'int8', 'int4', 'topk2bit', 'topk2bit-both', 'topk2bit-all', 'topk2bit-relay', 'topk1bit-relay', 'topk2bit-both-wide', 'topk2bit-both-wide-d64', 'topk2bit-both-wide-tiles', 'topk2bit-lut', 'lowrank+topk2bit', 'lowrank+topk2bit-wide', 'lowrank+topk2bit+rows')"),
    ("data-path", 3, "run-config key 'data-path'=3: expected a string like the default ''"),
    ("val-path", 3, "run-config key 'val-path'=3: expected a string like the default ''"),
    ("text-field", "", "run-config key 'text-field': DataConfig.text_field='': expected the name of the field or column "
                       "holding the text (e.g. 'text')"),
    ("tokenizer", " ", "run-config key 'tokenizer': DataConfig.tokenizer=' ': expected 'byte' or a path to a local "
                       "tokenizer.json"),
    ("batch-size", 0, "run-config key 'batch-size': DataConfig.batch_size=0: expected an int >= 1"),
    ("seq-len", 0, "run-config key 'seq-len': DataConfig.seq_len=0: expected an int >= 1"),
    ("seq-len", 4096, "run-config key 'seq-len': DataConfig.seq_len=4096: expected an int <= the model's max_seq_len=128 "
                      "(model preset 'small'; raise ModelConfig.max_seq_len or lower seq_len)"),
    ("output-dir", True, "run-config key 'output-dir'=True: expected a string like the default 'outputs/flower'"),
    ("seed", "x", "run-config key 'seed'='x': expected a number (an integer) like the default 0"),
    ("device", "gpu", "run-config key 'device': device='gpu': expected one of ('auto', 'cpu', 'cuda') or 'cuda:N'"),
    ("device", "cuda:first", "run-config key 'device': device='cuda:first': expected one of ('auto', 'cpu', 'cuda') or 'cuda:N'"),
    ("threads", -1, "run-config key 'threads': threads=-1: expected an integer >= 0"),
    ("eval-every", 0, "run-config key 'eval-every': eval_every=0: expected an integer > 0"),
    ("eval-batches", -1, "run-config key 'eval-batches': eval_batches=-1: expected an integer >= 0"),
    ("min-clients", -1, "run-config key 'min-clients': min_clients=-1: expected an integer > 0"),
    ("round-timeout", 0.0, "run-config key 'round-timeout': round_timeout=0.0: expected seconds > 0"),
    ("round-timeout", math.nan, "run-config key 'round-timeout': round_timeout=nan: expected seconds > 0"),
    ("resume", 5, "run-config key 'resume'=5: expected a string like the default ''"),
    ("tensorboard", "true", "run-config key 'tensorboard'='true': expected true or false like the default False"),
    ("client-state", "redis", "run-config key 'client-state': client_state='redis': expected one of ('disk', 'context')"),
    ("outlier-factor", -1.0, f"run-config key 'outlier-factor': outlier_factor=-1.0: {OUTLIER}"),
    ("outlier-factor", 0.5, f"run-config key 'outlier-factor': outlier_factor=0.5: {OUTLIER}"),
    ("outlier-factor", math.nan, f"run-config key 'outlier-factor': outlier_factor=nan: {OUTLIER}"),
    ("outlier-factor", math.inf, f"run-config key 'outlier-factor': outlier_factor=inf: {OUTLIER}"),
    ("preset", "nope", f"run-config key 'preset'='nope': no nope.yaml in {PRESET_DIR}; expected one of ["),
    ("data-plane", "tcp", "run-config key 'data-plane': data_plane.mode='tcp': expected one of ('auto', 'grpc', 'flower')"),
    ("data-plane-bind", 5, "run-config key 'data-plane-bind'=5: expected a string like the default '127.0.0.1'"),
    ("data-plane-address", 5, "run-config key 'data-plane-address'=5: expected a string like the default ''"),
    ("data-plane-port", 70000, "run-config key 'data-plane-port': data_plane.port=70000: expected 0 (any free port) "
                               "or 1..65535"),
    ("data-plane-certfile", "/x/server.pem", "run-config key 'data-plane-certfile': data_plane.certfile='/x/server.pem' "
                                             "without data_plane.keyfile: expected both (TLS) or neither"),
    ("data-plane-keyfile", "/x/server.key", "run-config key 'data-plane-keyfile': data_plane.keyfile='/x/server.key' "
                                            "without data_plane.certfile: expected both (TLS) or neither"),
    ("data-plane-insecure", "yes", "run-config key 'data-plane-insecure'='yes': expected true or false like the default False"),
    ("data-plane-stall-timeout", 0.0, "run-config key 'data-plane-stall-timeout': data_plane.stall_timeout=0.0: "
                                      "expected seconds > 0"),
    ("data-plane-memory-mb", -1, "run-config key 'data-plane-memory-mb': data_plane.memory_mb=-1: expected MB >= 0"),
    ("data-plane-max-uploads", 0, "run-config key 'data-plane-max-uploads': data_plane.max_uploads=0: expected an "
     "integer >= 1"),
    ("data-plane-checksum", "crc32", "run-config key 'data-plane-checksum': data_plane.checksum='crc32': expected one of "
     "('xxh3', 'sha256')"),
    ("partition", "bysource", "run-config key 'partition': DataConfig.partition='bysource': expected one of ('iid', "
     "'by_source', 'dirichlet')"),
    ("async-order", "fifo", "run-config key 'async-order': async_rounds.order='fifo': expected one of ('arrival', 'virtual')"),
    ("async-weight", 0.0, "run-config key 'async-weight': async_rounds.weight=0.0: expected a weight > 0"),
    ("async-cache", "mifa", "run-config key 'async-cache': async_rounds.cache='mifa': expected one of ('none', "
     "'ca2fl')"),
    ("async-grace", -1.0, "run-config key 'async-grace': async_rounds.grace=-1.0: expected seconds >= 0 "
     "(0 = no grace window)"),
    ("async-staleness-exponent", -1.0, "run-config key 'async-staleness-exponent': async_rounds.staleness_exponent=-1.0: "
     "expected an exponent >= 0 (0 = the constant weight ρ)"),
    ("async-match-speed", "yes", "run-config key 'async-match-speed'='yes': expected true or false like the default False"),
    ("async-max-staleness", -1, "run-config key 'async-max-staleness': async_rounds.max_staleness=-1: expected an "
                                "integer >= 0 (0 = no bound)"),
    ("async-speeds", "1,x", "run-config key 'async-speeds'='1,x': expected comma-separated numbers, one per "
                            "partition, like '1,1,4' (value*count repeats one: '2*256'), or '' for the default"),
    ("async-speeds", "1,0", "run-config key 'async-speeds': async_rounds.speeds=[1.0, 0.0]: expected virtual seconds "
                            "per step > 0"),
    ("async-local-steps", "4,2.5", "run-config key 'async-local-steps'='4,2.5': expected comma-separated integers, "
                                   "one per partition, like '1,1,4' (value*count repeats one: '2*256'), or '' for the "
                                   "default"),
    ("async-local-steps", "4,0", "run-config key 'async-local-steps': async_rounds.local_steps=[4, 0]: expected "
                                 "integers > 0 (local steps per round of each worker)"),
]


def raises_with(run_config: dict, message: str, preset_dir: Path = PRESET_DIR) -> str:
    with pytest.raises(ValueError) as err:
        load_app_config(run_config, preset_dir)
    text = str(err.value)
    assert text.startswith(message), f"\n got:      {text}\n expected: {message}"
    return text


@pytest.mark.parametrize("key,value,message", RUN_CONFIG_CASES,
                         ids=[f"{k}={v!r}" for k, v, _ in RUN_CONFIG_CASES])
def test_bad_run_config_value_names_the_key_the_value_and_what_is_allowed(key, value, message):
    raises_with({**pyproject_config(), key: value}, message)


def test_every_run_config_key_has_a_bad_value_case():
    assert set(pyproject_config()) == set(FLAT_KEYS) | {"preset"}
    assert {k for k, _, _ in RUN_CONFIG_CASES} == set(pyproject_config())


@pytest.mark.parametrize("extra,message", [
    ({"outer": "qhm"}, "run-config key 'payload-dtype': payload_dtype='topk2bit-relay' with outer.name='qhm' (variant 'lordo_global'): every client "
                       "replays the server's outer step from the relayed replies, which needs outer.name='average'"),
    ({"variant": "diloco"}, "run-config key 'payload-dtype': payload_dtype='topk2bit-relay' with diloco_outer.name='nesterov' (variant 'diloco')"),
    ({"variant": "heloco_lordo"}, "run-config key 'payload-dtype': payload_dtype='topk2bit-relay': relaying a round's replies needs synchronous rounds"),
])
def test_a_relay_needs_synchronous_rounds_and_the_plain_average(extra, message):
    raises_with({**pyproject_config(), "payload-dtype": "topk2bit-relay", **extra}, message)
    assert load_app_config({**pyproject_config(), "payload-dtype": "topk2bit-relay"}).payload_dtype == "topk2bit-relay"


@pytest.mark.parametrize("variant", ["lordo_local", "diloco", "heloco"])
def test_moment_sync_periods_are_refused_where_the_moments_stay_on_each_worker(variant):
    raises_with({**pyproject_config(), "variant": variant, "sync-exp-avg-sq-every": 8},
                f"run-config key 'sync-exp-avg-sq-every': rounds.sync_exp_avg_sq_every=8 with method {variant!r}: its "
                "moments stay on each worker (0 = never averaged); expected 0 or unset")
    load_app_config({**pyproject_config(), "variant": variant, "sync-exp-avg-sq-every": 0})  # 0 is what it runs


def test_the_late_outer_lr_needs_rounds_to_be_late_in():
    """`outer-late-lr` with `late-from-step`: accepted for a synchronous variant; an asynchronous method,
    which steps once per arrival, refuses a late lr of its own outer step (`diloco_outer`)."""
    from lordo_fed.optim.config import InnerConfig
    from lordo_fed.rounds.config import RoundConfig
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.rounds.outer import OuterConfig

    late = load_app_config({**pyproject_config(), "outer-late-lr": 2.0, "late-from-step": 96})
    assert (late.outer.late_lr, late.rounds.late_from_step) == (2.0, 96)
    rounds = RoundConfig(late_from_step=96)
    with pytest.raises(ValueError, match=re.escape("diloco_outer.late_lr=2.0: the asynchronous method 'heloco' steps "
                                                   "once per arrival, with no rounds to be late; expected 0")):
        resolve_method("heloco", InnerConfig(), rounds, OuterConfig(), OuterConfig(name="nesterov", late_lr=2.0))
    assert resolve_method("diloco", InnerConfig(), rounds, OuterConfig(),
                          OuterConfig(name="nesterov", late_lr=2.0)).outer.late_lr == 2.0


def test_a_repeated_list_value_is_the_list_written_out():
    """`value*count` in a list key is the same setting as the list written out in full: the K = 2 ramp of
    docs/results.md (section 17, part twenty) as '2*256', against 256 twos; floats and a mix too."""
    base = pyproject_config()
    short = load_app_config({**base, "local-steps-ramp": "2*256", "payload-dtype": "int8"})
    full = load_app_config({**base, "local-steps-ramp": ",".join(["2"] * 256), "payload-dtype": "int8"})
    assert short == full and short.rounds.local_steps_ramp == [2] * 256
    assert load_app_config({**base, "local-steps-ramp": "8*2, 16"}).rounds.local_steps_ramp == [8, 8, 16]
    assert load_app_config({**base, "variant": "heloco", "async-speeds": "1*3,4"}).async_rounds.speeds == [1.0, 1.0, 1.0, 4.0]


def test_repeat_in_a_hydra_config_is_the_list_written_out(tmp_path):
    """`${repeat:...}` reads the app's `value*count` grammar in the Hydra configs: in a reference-trainer override
    it composes the same TrainConfig as the list written out, and in a preset the same AppConfig as the app's
    key; a bad item or count is refused naming it."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from quality import Run, compose

    def trainer(ramp: str):
        return compose(Run("r", "t", "lordo_global", ("total_steps=24", f"rounds.local_steps_ramp={ramp}")), True,
                       tmp_path / "out")

    short, full = trainer("'${repeat:2*4,4}'"), trainer("[2,2,2,2,4]")
    assert short == full and short.rounds.local_steps_ramp == [2, 2, 2, 2, 4]
    for ramp, message in (("'${repeat:2*0}'", "${repeat:2*0}: '2*0' repeats 2 0 times: expected a count >= 1"),
                          ("'${repeat:2*x}'", "${repeat:2*x}: '2*x' is neither a number nor value*count; "
                                              "expected e.g. ${repeat:2*256,4*128}"),
                          ("'${repeat:2*200000}'", "${repeat:2*200000}: expected at most 100000 items in all")):
        with pytest.raises(Exception, match=re.escape(message)):
            trainer(ramp)
    (tmp_path / "ramp.yaml").write_text("defaults:\n  - app\n  - _self_\nrounds:\n  local_steps_ramp: ${repeat:2*256}\n")
    base = pyproject_config()
    assert (load_app_config({**base, "preset": "ramp"}, tmp_path).rounds.local_steps_ramp
            == load_app_config({**base, "local-steps-ramp": "2*256"}).rounds.local_steps_ramp == [2] * 256)


def test_good_edge_values_are_accepted():
    cfg = load_app_config({**pyproject_config(), "outlier-factor": 1.0, "omega": 1, "outer-lr": 1, "device": "cuda:1",
                           "seq-len": 128, "eval-batches": 0, "threads": 0, "error-feedback": False})
    assert (cfg.outlier_factor, cfg.inner.omega, cfg.outer.lr, cfg.device) == (1.0, 1, 1, "cuda:1")
    assert load_app_config({**pyproject_config(), "outlier-factor": 3}).outlier_factor == 3


# (dotted field a preset sets, bad value, message)
PRESET_CASES = [
    ("checkpoint_keep", 0, "checkpoint_keep=0: expected an integer > 0"),
    ("eval_every", "x", "eval_every: Value 'x' of type 'str' could not be converted to Integer (preset 'bad')"),
    ("inner.rank", "abc", "inner.rank: Value 'abc' of type 'str' could not be converted to Integer (preset 'bad')"),
    ("inner.rnak", 8, "inner.rnak: Key 'rnak' not in 'InnerConfig' (preset 'bad')"),
    ("inner.name", "sgd", "inner.name='sgd': expected one of ('lordo', 'adamw')"),
    ("inner.betas", [0.9, 1.0], "inner.betas=[0.9, 1.0]: expected two numbers in [0, 1)"),
    ("inner.betas", [0.9], "inner.betas=[0.9]: expected two numbers in [0, 1)"),
    ("inner.eps", 0.0, "inner.eps=0.0: expected eps > 0 and weight_decay >= 0"),
    ("inner.weight_decay", -0.1, "inner.weight_decay=-0.1: expected eps > 0 and weight_decay >= 0"),
    ("inner.ef_dtype", "fp16", "inner.ef_dtype='fp16': expected one of ('fp32', 'bf16')"),
    ("inner.qh_placement", "middle", "inner.qh_placement='middle': expected one of ('outside', 'inside')"),
    ("inner.projection", "both", "inner.projection='both': expected one of ('global', 'local')"),
    ("inner.init_projection", "zeros", "inner.init_projection='zeros': expected one of ('gradient', 'random')"),
    ("inner.proj_interval", -1, "inner.proj_interval=-1: expected an integer >= 0 (0 = K, the round length)"),
    ("inner.grad_clip", -1.0, "inner.grad_clip=-1.0: expected a number >= 0 (0 disables clipping)"),
    ("inner.schedule", "linear", "inner.schedule='linear': expected one of ('wsd', 'cosine', 'constant')"),
    ("inner.decay_fraction", 1.5, "inner.decay_fraction=1.5: expected a number in [0, 1]"),
    ("inner.min_lr_ratio", -0.1, "inner.min_lr_ratio=-0.1: expected a number in [0, 1]"),
    ("rounds.sync_exp_avg_every", -1, "run-config key 'sync-exp-avg-every': rounds.sync_exp_avg_every=-1: expected an integer >= 0 (0 = never)"),
    ("rounds.sync_exp_avg_sq_every", -2, "run-config key 'sync-exp-avg-sq-every': rounds.sync_exp_avg_sq_every=-2: expected an integer >= 0 (0 = never)"),
    ("outer.beta", 1.5, "outer.beta=1.5: must be a number in [0, 1]"),
    ("outer.nu", -0.1, "outer.nu=-0.1: must be a number in [0, 1]"),
    ("outer.momentum", 2.0, "outer.momentum=2.0: must be a number in [0, 1]"),
    ("diloco_outer.lr", 0.0, "diloco_outer.lr=0.0: the outer learning rate must be a finite number > 0"),
    ("diloco_outer.name", "adam", "diloco_outer.name='adam': expected one of ['average', 'qhm', 'nesterov', 'mla']"),
    ("data.tokenizer", "", "run-config key 'tokenizer': DataConfig.tokenizer='': expected 'byte' or a path to a local "
                           "tokenizer.json"),
    ("data.val_fraction", 1.0, "DataConfig.val_fraction=1.0: expected a number in [0, 1)"),
    ("data.eval_windows", "last", "DataConfig.eval_windows='last': expected one of ('first', 'spread')"),
    ("data.partition", "random", "run-config key 'partition': DataConfig.partition='random': expected one of ('iid', "
                                 "'by_source', 'dirichlet')"),
    ("data.dirichlet_alpha", 0.0, "DataConfig.dirichlet_alpha=0.0: expected a finite number > 0"),
    ("data.seed", -1, "DataConfig.seed=-1: expected an int >= 0"),
    ("model.preset", "custom", "ModelConfig.dim=None: preset='custom' provides no value, so dim must be set explicitly"),
    ("model.dim", 0, "ModelConfig.dim=0: expected a positive integer"),
    ("model.n_layers", -1, "ModelConfig.n_layers=-1: expected a positive integer"),
    ("model.n_heads", 3, "ModelConfig.n_heads=3: must divide dim=128 (head size = dim / n_heads)"),
    ("model.n_kv_heads", 3, "ModelConfig.n_kv_heads=3: must divide n_heads=4"),
    ("model.ffn_hidden", 0, "ModelConfig.ffn_hidden=0: expected a positive integer"),
    ("model.multiple_of", 0, "ModelConfig.multiple_of=0: expected a positive integer"),
    ("model.norm_eps", 0.0, "ModelConfig.norm_eps=0.0: expected a positive number"),
    ("model.rope_theta", -1.0, "ModelConfig.rope_theta=-1.0: expected a positive number"),
    ("model.init_std", 0.0, "ModelConfig.init_std=0.0: expected a positive number"),
    ("model.max_seq_len", 0, "ModelConfig.max_seq_len=0: expected a positive integer"),
    # the default seq_len (128) no longer fits: named as the run-config key that fixes it
    ("model.max_seq_len", 64, "run-config key 'seq-len': DataConfig.seq_len=128: expected an int <= the model's "
                              "max_seq_len=64"),
    ("model.lowrank_pattern", "(", "lowrank_pattern='(' is not a valid regular expression"),
]


def write_preset(preset_dir: Path, dotted: str, value) -> None:
    doc: dict = {"defaults": ["app", "_self_"]}
    node = doc
    *sections, name = dotted.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = value
    preset_dir.mkdir(parents=True, exist_ok=True)
    (preset_dir / "bad.yaml").write_text(yaml.safe_dump(doc))


@pytest.mark.parametrize("dotted,value,message", PRESET_CASES,
                         ids=[f"{k}={v!r}" for k, v, _ in PRESET_CASES])
def test_bad_preset_value_names_the_field_the_value_and_what_is_allowed(tmp_path, dotted, value, message):
    write_preset(tmp_path, dotted, value)
    text = raises_with({"preset": "bad"}, message, tmp_path)
    if not message.startswith("run-config key"):
        # fields no run-config key sets are not attributed to one (diloco_outer.lr is not 'lr',
        # DataConfig.seed is not 'seed')
        assert "run-config key" not in text


def test_a_run_config_key_wins_over_a_bad_preset_value(tmp_path):
    write_preset(tmp_path, "inner.rank", 0)
    raises_with({"preset": "bad"}, "run-config key 'rank': inner.rank=0: expected an integer > 0", tmp_path)
    assert load_app_config({"preset": "bad", "rank": 4}, tmp_path).inner.rank == 4


# ----------------------------------------------------------------------------- corpus and tokenizer
def server_start(tmp_path: Path, **run_config):
    """What the ServerApp does before round 1: load_app_config, then build the strategy (which
    loads the corpus for its validation split)."""
    from server.strategy import LoRDOStrategy

    cfg = load_app_config({"preset": "quickstart", "device": "cpu", "output-dir": str(tmp_path / "out"), **run_config})
    return LoRDOStrategy(cfg)


def test_a_missing_data_path_is_named(tmp_path):
    missing = tmp_path / "no" / "corpus.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(f"corpus path not found: {str(missing)!r}; expected a file "
                                                         "or a directory of *.txt/*.md/*.jsonl/*.parquet/*.bin files "
                                                         "or Hugging Face datasets saved to disk")):
        server_start(tmp_path, **{"data-path": str(missing)})
    assert not (tmp_path / "out" / "server.jsonl").exists()


def test_the_server_evaluates_on_val_path_and_names_it_when_missing(tmp_path):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("A held-out text, for evaluation only.\n\n" * 400)
    strategy = server_start(tmp_path, **{"val-path": str(held_out)})
    x, _ = strategy.val_batches[0]
    assert bytes(x[0].tolist()) == held_out.read_bytes()[: x.shape[1]]
    missing = tmp_path / "gone.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(f"DataConfig.val_path={str(missing)!r}: corpus path not found")):
        server_start(tmp_path, **{"val-path": str(missing)})


def test_a_corpus_directory_without_text_files_is_named(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=re.escape(f"corpus directory {str(corpus)!r} contains no *.txt/*.md/*.jsonl/*.parquet/*.bin files")):
        server_start(tmp_path, **{"data-path": str(corpus)})


def test_an_empty_corpus_is_named(tmp_path):
    corpus = tmp_path / "empty.txt"
    corpus.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"corpus is empty: 1 source(s) ({str(corpus)!r}...) gave no tokens")):
        server_start(tmp_path, **{"data-path": str(corpus)})


def test_a_missing_tokenizer_is_named(tmp_path):
    preset_dir = tmp_path / "presets"
    missing = tmp_path / "tok" / "tokenizer.json"
    write_preset(preset_dir, "data.tokenizer", str(missing))
    cfg = load_app_config({"preset": "bad", "device": "cpu", "output-dir": str(tmp_path / "out")}, preset_dir)
    from server.strategy import LoRDOStrategy

    with pytest.raises(FileNotFoundError, match=re.escape(f"tokenizer file not found: {str(missing)!r}; expected a "
                                                         f"local tokenizer.json")):
        LoRDOStrategy(cfg)
    # the run-config key sets the same field
    with pytest.raises(FileNotFoundError, match=re.escape(f"tokenizer file not found: {str(missing)!r}")):
        server_start(tmp_path, tokenizer=str(missing))
