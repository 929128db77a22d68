"""Round checkpoints through real files: round trip, latest.json, pruning, refusing damaged or
half-written checkpoints, run compatibility, and RNG state."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.checkpoint import (
    FORMAT,
    CheckpointError,
    check_compatible,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from lordo_fed.rounds.outer import Nesterov
from lordo_fed.optim.projection import SVDProjection
from lordo_fed.rounds.config import RoundConfig


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "param/w": torch.randn(4, 3, generator=g),
        "proj/w": torch.randint(0, 1000, (3, 2), generator=g, dtype=torch.int64),
        "moment/exp_avg/w": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "counter/round": torch.tensor(seed + 1),
        "counter/opt_step": torch.tensor(10 * seed),
        "param/t": torch.randn(3, 5, generator=g).t(),  # non-contiguous on the way in
    }


def sample_meta(round_idx: int = 1) -> dict:
    return {"model_id": "tiny-llama", "method": "lordo-global", "schema": 1, "round": round_idx,
            "config": {"rank": 2, "betas": [0.9, 0.999]}, "metrics": [{"round": 1, "train_loss": 3.25}]}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def save_rounds(directory, rounds, keep=None):
    return {r: save_checkpoint(directory, r, sample_tensors(r), sample_meta(r), keep=keep) for r in rounds}


# ----------------------------------------------------------------------------- round trip


def test_round_trip_fp32_int64_bf16_and_meta(tmp_path):
    tensors, meta = sample_tensors(3), sample_meta(3)
    path = save_checkpoint(tmp_path / "ckpt", 3, tensors, meta)
    assert path == tmp_path / "ckpt" / "round_00003.json"
    assert (tmp_path / "ckpt" / "round_00003.safetensors").is_file()
    record = json.loads(path.read_text())
    assert record["format"] == FORMAT and record["round"] == 3
    assert record["tensors_file"] == "round_00003.safetensors"
    assert record["tensors_bytes"] == (tmp_path / "ckpt" / "round_00003.safetensors").stat().st_size
    assert len(record["tensors_sha256"]) == 64 and record["meta"] == meta

    for source in (path, tmp_path / "ckpt" / "round_00003.safetensors", tmp_path / "ckpt", str(path)):
        loaded, loaded_meta = load_checkpoint(source)
        assert_same_tensors(tensors, loaded)
        assert loaded["proj/w"].dtype == torch.int64 and loaded["moment/exp_avg/w"].dtype == torch.bfloat16
        assert loaded_meta == meta


def test_aggregator_state_dict_round_trip(tmp_path):
    params = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.tensor([0.5, -0.5, 1.0])}

    def make() -> Aggregator:
        return Aggregator(params, {"w": 2}, RoundConfig(4, 1, 1), Nesterov(lr=0.7, momentum=0.9),
                          SVDProjection(), seed=5)

    a = make()
    a.params["w"].add_(1.5)
    a.round, a.opt_step = 3, 8
    save_checkpoint(tmp_path, 3, {**a.state_dict(), **rng_state()}, {"round": 3})
    tensors, _ = load_checkpoint(tmp_path)
    b = make()
    b.load_state_dict(tensors)
    assert (b.round, b.opt_step) == (3, 8)
    assert torch.equal(a.params["w"], b.params["w"]) and torch.equal(a.params["b"], b.params["b"])
    assert set(a.projections) == set(b.projections)
    assert all(torch.equal(a.projections[k], b.projections[k]) for k in a.projections)


def test_meta_that_is_not_json_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path, 1, sample_tensors(), {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_shared_storage_tensors_are_saved(tmp_path):
    base = torch.arange(10.0)
    tensors = {"a": base, "b": base, "c": base[2:5]}
    save_checkpoint(tmp_path, 1, tensors, {})
    loaded, _ = load_checkpoint(tmp_path)
    assert_same_tensors({k: v.contiguous() for k, v in tensors.items()}, loaded)


# ----------------------------------------------------------------------------- latest.json and pruning


def test_latest_points_to_the_newest(tmp_path):
    save_rounds(tmp_path, [1, 2, 3])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["checkpoint"] == "round_00003.json" and latest["round"] == 3
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["round"] == 3 and int(tensors["counter/round"]) == 4
    assert load_checkpoint(tmp_path / "latest.json")[1]["round"] == 3


def test_keep_prunes_older_pairs(tmp_path):
    save_rounds(tmp_path, range(1, 6), keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest.json", "round_00004.json", "round_00004.safetensors",
                     "round_00005.json", "round_00005.safetensors"]
    assert [r for r, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert load_checkpoint(tmp_path / "round_00004.json")[1]["round"] == 4


def test_keep_one_keeps_only_the_one_just_written(tmp_path):
    save_rounds(tmp_path, [1, 2], keep=1)
    assert [r for r, _ in list_checkpoints(tmp_path)] == [2]
    assert not (tmp_path / "round_00001.safetensors").exists()


def test_saving_an_older_round_never_deletes_a_newer_one(tmp_path):
    save_rounds(tmp_path, [1, 2, 3, 4], keep=None)
    save_checkpoint(tmp_path, 2, sample_tensors(2), sample_meta(2), keep=2)  # resumed from round 2
    assert [r for r, _ in list_checkpoints(tmp_path)] == [1, 2, 3, 4]
    save_checkpoint(tmp_path, 3, sample_tensors(3), sample_meta(3), keep=2)
    assert [r for r, _ in list_checkpoints(tmp_path)] == [2, 3, 4]
    assert load_checkpoint(tmp_path)[1]["round"] == 3  # latest.json: what this run wrote last


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, {}, {}, keep=0)
    with pytest.raises(ValueError, match="round_idx"):
        save_checkpoint(tmp_path, -1, {}, {})


# ----------------------------------------------------------------------------- refusing damaged checkpoints


def test_truncated_tensors_are_refused_naming_the_file(tmp_path):
    json_path = save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    st = tmp_path / "round_00001.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    for source in (json_path, st):
        with pytest.raises(CheckpointError, match="cut off mid-write or modified") as err:
            load_checkpoint(source)
        assert "round_00001.safetensors" in str(err.value)


def test_modified_byte_is_refused_by_sha(tmp_path):
    json_path = save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    st = tmp_path / "round_00001.safetensors"
    data = bytearray(st.read_bytes())
    data[-3] ^= 0xFF  # inside tensor data: still a parsable file of the same size
    st.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256") as err:
        load_checkpoint(json_path)
    assert "round_00001.safetensors" in str(err.value) and "modified" in str(err.value)


def test_json_without_its_tensors_is_refused(tmp_path):
    json_path = save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    (tmp_path / "round_00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="round_00001.safetensors") as err:
        load_checkpoint(json_path)
    assert "missing" in str(err.value)


def test_corrupt_json_is_refused(tmp_path):
    json_path = save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    json_path.write_text(json_path.read_text()[:40])
    with pytest.raises(CheckpointError, match="corrupt JSON") as err:
        load_checkpoint(json_path)
    assert str(json_path) in str(err.value)


def test_wrong_format_is_refused(tmp_path):
    json_path = save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    record = json.loads(json_path.read_text())
    record["format"] = "someone.else.v9"
    json_path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="someone.else.v9") as err:
        load_checkpoint(json_path)
    assert str(json_path) in str(err.value)


def test_unparsable_safetensors_with_matching_hash_is_refused(tmp_path):
    import hashlib

    json_path = save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    st = tmp_path / "round_00001.safetensors"
    garbage = b"\xff" * 64
    st.write_bytes(garbage)
    record = json.loads(json_path.read_text())
    record.update(tensors_sha256=hashlib.sha256(garbage).hexdigest(), tensors_bytes=len(garbage))
    json_path.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="not a readable safetensors") as err:
        load_checkpoint(json_path)
    assert "round_00001.safetensors" in str(err.value)


def test_tensors_from_another_save_are_refused(tmp_path):
    save_rounds(tmp_path, [1, 2], keep=None)
    (tmp_path / "round_00001.safetensors").write_bytes((tmp_path / "round_00002.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="round_00001.safetensors"):
        load_checkpoint(tmp_path / "round_00001.json")


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_checkpoint(tmp_path / "nope.json")
    with pytest.raises(CheckpointError, match="nope.json"):
        load_checkpoint(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="contains no checkpoint"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    (tmp_path / "round_00001.json").unlink()
    with pytest.raises(CheckpointError, match="never finished"):
        load_checkpoint(tmp_path / "round_00001.safetensors")


# ----------------------------------------------------------------------------- crash leftovers


def simulate_crash_mid_save(directory, round_idx):
    """What a run killed while saving `round_idx` leaves: a temp file and tensors without a JSON."""
    (directory / f".round_{round_idx:05d}.json.0123abcd.tmp").write_text('{"format": "lordo_fed.chec')
    (directory / "something.tmp").write_bytes(b"\x00" * 100)
    full = save_checkpoint(directory / "scratch", round_idx, sample_tensors(round_idx), {})
    (directory / f"round_{round_idx:05d}.safetensors").write_bytes(full.with_suffix(".safetensors").read_bytes())


@pytest.mark.parametrize("with_latest", [True, False])
def test_directory_load_ignores_crash_leftovers(tmp_path, with_latest):
    save_rounds(tmp_path, [1, 2], keep=None)
    simulate_crash_mid_save(tmp_path, 3)
    if not with_latest:
        (tmp_path / "latest.json").unlink()
    tensors, meta = load_checkpoint(tmp_path)
    assert meta == sample_meta(2)
    assert_same_tensors(tensors, sample_tensors(2))


def test_directory_load_falls_back_past_a_damaged_newest(tmp_path, caplog):
    save_rounds(tmp_path, [1, 2, 3], keep=None)
    st = tmp_path / "round_00003.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    (tmp_path / "round_00002.json").write_text("{")
    tensors, meta = load_checkpoint(tmp_path)
    assert meta["round"] == 1
    assert "round_00003.safetensors" in caplog.text  # the fallback is not silent
    (tmp_path / "latest.json").write_text("not json")
    assert load_checkpoint(tmp_path)[1]["round"] == 1


def test_directory_with_only_damaged_checkpoints_is_refused(tmp_path):
    save_rounds(tmp_path, [1], keep=None)
    (tmp_path / "round_00001.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no complete checkpoint") as err:
        load_checkpoint(tmp_path)
    assert "round_00001.safetensors" in str(err.value)


def test_next_save_removes_stale_temp_files_of_this_module(tmp_path):
    save_rounds(tmp_path, [1], keep=None)
    simulate_crash_mid_save(tmp_path, 2)
    save_checkpoint(tmp_path, 2, sample_tensors(2), sample_meta(2))
    assert not list(tmp_path.glob(".round_*.tmp"))
    assert (tmp_path / "something.tmp").exists()  # not ours: left alone
    assert load_checkpoint(tmp_path)[1] == sample_meta(2)


# ----------------------------------------------------------------------------- compatibility


def test_check_compatible_passes_on_a_match():
    meta = sample_meta()
    check_compatible(meta, {"model_id": "tiny-llama", "method": "lordo-global", "schema": 1}, "x.json")
    check_compatible(meta, {"config.rank": 2, "config.betas": (0.9, 0.999)}, "x.json")  # tuple == JSON list


def test_check_compatible_mismatch_names_key_values_and_file(tmp_path):
    json_path = save_checkpoint(tmp_path, 1, sample_tensors(), sample_meta())
    _, meta = load_checkpoint(json_path)
    with pytest.raises(CheckpointError) as err:
        check_compatible(meta, {"model_id": "tiny-llama", "method": "diloco"}, json_path)
    msg = str(err.value)
    assert str(json_path) in msg and "method" in msg and "'lordo-global'" in msg and "'diloco'" in msg
    assert "model_id" not in msg
    with pytest.raises(CheckpointError, match="schema_version is missing"):
        check_compatible(meta, {"schema_version": 2}, json_path)
    with pytest.raises(CheckpointError, match=r"config.rank is 2 in the checkpoint, expected 4"):
        check_compatible(meta, {"config.rank": 4}, json_path)


# ----------------------------------------------------------------------------- RNG


def draw():
    return (torch.rand(5), torch.randn(3), np.random.random(4), np.random.normal(size=3),
            [random.random() for _ in range(4)], random.gauss(0, 1))


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's legacy state
    random.gauss(0, 1)  # and one in Python's
    sd = rng_state()
    assert {"rng/torch", "rng/numpy", "rng/python"} <= set(sd)
    assert all(v.dtype == torch.uint8 for v in sd.values())
    save_checkpoint(tmp_path, 1, sd, {})
    expected = draw()

    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    assert not torch.equal(draw()[0], expected[0])

    loaded, _ = load_checkpoint(tmp_path)
    set_rng_state(loaded)
    got = draw()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert np.array_equal(got[2], expected[2]) and np.array_equal(got[3], expected[3])
    assert got[4] == expected[4] and got[5] == expected[5]


def test_set_rng_state_refuses_incomplete_state_without_changing_anything():
    torch.manual_seed(7)
    sd = rng_state()
    del sd["rng/python"]
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="rng/python"):
        set_rng_state(sd)
    assert torch.equal(torch.get_rng_state(), before)
    sd = rng_state()
    sd["rng/numpy"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="rng/numpy"):
        set_rng_state(sd)
