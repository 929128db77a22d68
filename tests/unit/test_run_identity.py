"""One run per output directory, and a resume that only ever continues the same run: the
checkpoint loader never falls back to another run's checkpoint, a fresh run into a directory that
holds another run's checkpoints is refused before anything is written, and a resume with other
settings is refused naming them (server/records.py, lordo_fed/checkpoint.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from lordo_fed.app.config import flat_defaults, load_app_config
from lordo_fed.checkpoint import RUN_KEY, CheckpointError, describe_directory, load_checkpoint, save_checkpoint
from server.records import Recorder, preflight, settings_differ

ROOT = Path(__file__).resolve().parents[2]


def save_run(directory: Path, uid: str, rounds: range, num_rounds: int = 4) -> None:
    for r in rounds:
        save_checkpoint(directory, r, {"param/w": torch.full((2,), float(r))},
                        {RUN_KEY: uid, "round": r, "variant": "lordo_global",
                         "config": {"num_rounds": num_rounds, "model": {"preset": "tiny"}}}, keep=None)


def test_a_damaged_newest_checkpoint_falls_back_within_its_run_not_to_another_runs(tmp_path):
    """The issue's reproduction: run A wrote rounds 1-4, run B then rounds 1-2 into the same
    directory, and B's round 2 was truncated. The loader used to return A's round 4."""
    save_run(tmp_path, "run-a", range(1, 5))
    save_run(tmp_path, "run-b", range(1, 3), num_rounds=2)
    tensors = tmp_path / "round_00002.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:40])
    _, meta = load_checkpoint(tmp_path)
    assert (meta[RUN_KEY], meta["round"]) == ("run-b", 1)
    # with B's round 1 gone too, nothing of run B is complete: refused, naming A's as another run's
    (tmp_path / "round_00001.json").unlink()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint of run run-b.*round_00004.json belongs to "
                                              r"another run"):
        load_checkpoint(tmp_path)


def test_without_latest_json_a_directory_of_two_runs_is_refused(tmp_path):
    save_run(tmp_path, "run-a", range(3, 5))
    save_run(tmp_path, "run-b", range(1, 3))
    (tmp_path / "latest.json").unlink()
    with pytest.raises(CheckpointError, match=r"holds checkpoints of 2 runs .*give the round file"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path / "round_00004.json")[1][RUN_KEY] == "run-a"  # a named file still loads


def test_describe_directory_reads_the_newest_checkpoints_json(tmp_path):
    assert describe_directory(tmp_path / "none") is None and describe_directory(tmp_path) is None
    save_run(tmp_path, "run-a", range(1, 4))
    found = describe_directory(tmp_path)
    assert {k: found[k] for k in ("round", "run_uid", "variant", "num_rounds", "preset", "files")} == {
        "round": 3, "run_uid": "run-a", "variant": "lordo_global", "num_rounds": 4, "preset": "tiny", "files": 3}


def recorder(out: Path, **overrides) -> Recorder:
    cfg = load_app_config({**flat_defaults(), "output-dir": str(out), **overrides})
    return Recorder(cfg, out, "model-id")


def test_a_fresh_run_into_another_runs_directory_is_refused_before_anything_is_written(tmp_path):
    first = recorder(tmp_path)
    first.claim_fresh()
    first.save(1, {"param/w": torch.zeros(2)}, 10, 100)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(CheckpointError) as err:
        recorder(tmp_path, **{"num-server-rounds": 2}).claim_fresh()
    message = str(err.value)
    assert f"output-dir {tmp_path} already holds another run's checkpoints (round 1 of 4" in message
    assert f"resume='{tmp_path / 'checkpoints'}'" in message and "another output-dir" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    recorder(tmp_path / "elsewhere").claim_fresh()  # an empty directory is free


def test_resume_adopts_the_run_and_refuses_other_settings(tmp_path):
    first = recorder(tmp_path)
    first.claim_fresh()
    first.save(2, {"param/w": torch.zeros(2)}, 10, 100)
    tensors, meta = load_checkpoint(tmp_path / "checkpoints")
    # more rounds, another deadline, another output-dir: the same run continued
    again = recorder(tmp_path, **{"num-server-rounds": 8, "round-timeout": 30.0})
    again.adopt(meta, tmp_path / "checkpoints" / "round_00002.json")
    assert (again.run_uid, again.last_round) == (first.run_uid, 2)
    status = json.loads((tmp_path / "run.json").read_text())
    assert status == {"run_uid": first.run_uid, "status": "running", "round": 2, "num_rounds": 4,
                      "variant": "lordo_global", "resume": str(tmp_path / "checkpoints")}
    # another rank or seed is another run
    with pytest.raises(CheckpointError, match=r"other settings: inner.rank is 8 there, 16 now; seed is 0 there, 3 now"):
        recorder(tmp_path, rank=16, seed=3).adopt(meta, tmp_path / "x.json")
    # resuming into an output-dir that holds a third run's checkpoints: refused
    other = recorder(tmp_path / "other")
    other.claim_fresh()
    other.save(1, {"param/w": torch.zeros(2)}, 1, 1)
    with pytest.raises(CheckpointError, match="already holds another run's checkpoints"):
        recorder(tmp_path / "other").adopt(meta, tmp_path / "x.json")


def test_settings_differ_skips_what_a_resume_may_change():
    saved = {"num_rounds": 4, "out_dir": "a", "inner": {"rank": 8, "lr": 0.1}, "data_plane": {"port": 1},
             "data": {"cache_dir": "x", "path": "p"}}
    now = {"num_rounds": 9, "out_dir": "b", "inner": {"rank": 8, "lr": 0.2}, "data_plane": {"port": 2},
           "data": {"cache_dir": "y", "path": "p"}}
    assert settings_differ(saved, now) == [("inner.lr", 0.1, 0.2)]


def test_the_scripts_name_an_unknown_run_config_key_with_the_keys_meant(capsys):
    """scripts/run_config.py, which submit_run.sh runs before `flwr run` (Flower's own refusal
    shows only "[code: 15] Invalid run configuration"; a bad value the ServerApp refuses only once
    Flower has started); and the merge simulate.sh relies on."""
    spec = importlib.util.spec_from_file_location("run_config", ROOT / "scripts" / "run_config.py")
    run_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_config)
    assert run_config.main(["check", str(ROOT), "num-server-round=2 rank=16", "presett='x'"]) == 2
    err = capsys.readouterr().err
    assert "unknown run-config key 'num-server-round'; did you mean 'num-server-rounds'?" in err
    assert "unknown run-config key 'presett'; did you mean 'preset'" in err and "'rank'" not in err
    assert run_config.main(["check", str(ROOT), "num-server-rounds=2 rank=16 resume='/x y'"]) == 0
    assert run_config.main(["get", "output-dir", "preset='q' output-dir='/a b'", "output-dir='/c'"]) == 0
    assert capsys.readouterr().out.strip() == "/c"  # a later string wins, as in flwr run
    # a bad value is refused as the ServerApp would refuse it, before Flower starts
    assert run_config.main(["check", str(ROOT), "num-server-rounds=2", "rank=-1"]) == 2
    assert "run-config key 'rank': inner.rank=-1: expected an integer > 0" in capsys.readouterr().err
    assert run_config.main(["check", str(ROOT), "preset='diloco-sparse'", "payload-dtype='int7'"]) == 2
    assert "run-config key 'payload-dtype'" in capsys.readouterr().err


def test_the_scripts_check_another_apps_keys_only(tmp_path):
    """submit_run.sh also submits other Flower apps (the harness's echo app): their values are theirs."""
    spec = importlib.util.spec_from_file_location("run_config", ROOT / "scripts" / "run_config.py")
    run_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_config)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "echo"\n[tool.flwr.app.config]\n'
                                             'num-server-rounds = 1\nrank = "x"\n')
    assert run_config.main(["check", str(tmp_path), "num-server-rounds=2 rank=-1"]) == 0
    assert run_config.main(["check", str(tmp_path), "ranks=1"]) == 2


def tree(directory: Path) -> dict[str, int]:
    """Every file under `directory`, with its modification time (ns): what a check must leave alone."""
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*")) if p.is_file()}


def test_preflight_tells_what_the_serverapp_would_and_writes_nothing(tmp_path, capsys):
    """scripts/simulate.sh checks the output-dir and resume before Flower starts (`run_config.py check --local`):
    each refusal the ServerApp would make, and a finished run resumed, are told by `preflight` the same way."""
    out = tmp_path / "out"
    first = recorder(out, **{"num-server-rounds": 2})
    first.claim_fresh()
    first.save(1, {"param/w": torch.zeros(2)}, 10, 100)
    first.save(2, {"param/w": torch.ones(2)}, 20, 200)
    before = tree(tmp_path)
    ckpt = out / "checkpoints"
    cfg = lambda **kw: load_app_config({**flat_defaults(), "output-dir": str(out), "num-server-rounds": 2, **kw})
    with pytest.raises(CheckpointError, match=r"output-dir .*out already holds another run's checkpoints \(round 2 of 2"):
        preflight(cfg(), tmp_path)
    with pytest.raises(CheckpointError, match="already holds another run's checkpoints"):  # relative: from the app dir
        preflight(cfg(**{"output-dir": "out"}), tmp_path)
    assert preflight(cfg(**{"output-dir": "elsewhere"}), tmp_path) is None
    done = preflight(cfg(resume=str(ckpt)), tmp_path)
    assert done == f"lordo-fed: the run in {out} finished all 2 rounds already (round 2 checkpointed): nothing to do. " \
                  "To train longer, resume with a larger num-server-rounds."
    assert preflight(cfg(resume="out/checkpoints", **{"num-server-rounds": 3}), tmp_path) is None  # more rounds: trains
    with pytest.raises(CheckpointError, match=r"other settings: inner.rank is 8 there, 16 now"):
        preflight(cfg(resume=str(ckpt), rank=16), tmp_path)
    with pytest.raises(CheckpointError, match=r"variant"):  # another method's checkpoint
        preflight(cfg(resume=str(ckpt), variant="lordo_local"), tmp_path)
    with pytest.raises(CheckpointError, match="nowhere"):
        preflight(cfg(resume=str(tmp_path / "nowhere")), tmp_path)
    assert tree(tmp_path) == before

    # the scripts' exit status: 2 refused (the ServerApp's message), 4 nothing to do, 0 go
    spec = importlib.util.spec_from_file_location("run_config", ROOT / "scripts" / "run_config.py")
    run_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_config)
    capsys.readouterr()
    assert run_config.main(["check", "--local", str(ROOT), f"output-dir='{out}' num-server-rounds=2"]) == 2
    assert "error: output-dir" in capsys.readouterr().err
    assert run_config.main(["check", "--local", str(ROOT), f"output-dir='{out}' num-server-rounds=2 resume='{ckpt}'"]) == 4
    assert "nothing to do" in capsys.readouterr().out
    assert run_config.main(["check", str(ROOT), f"output-dir='{out}' num-server-rounds=2"]) == 0  # without --local
    assert run_config.main(["check", "--local", str(ROOT), f"output-dir='{tmp_path / 'new'}'"]) == 0
    assert tree(tmp_path) == before
