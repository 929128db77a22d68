"""The communication and memory benchmarks in --quick mode: they run, and their numbers mean what
they claim (docs/algorithm.md, "Communication and memory per low-rank p×q matrix")."""

from pathlib import Path

import pytest

from tests.integration.test_benchmarks import run_quick


def run_with_figure(script: str, tmp_path: Path) -> dict:
    result = run_quick(script, tmp_path, timeout=240, OMP_NUM_THREADS="1")
    assert (tmp_path / script).with_suffix(".png").stat().st_size > 10_000  # the figure was drawn
    return result


@pytest.fixture(scope="module")
def communication(tmp_path_factory):
    return run_with_figure("communication.py", tmp_path_factory.mktemp("communication"))


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    return run_with_figure("memory.py", tmp_path_factory.mktemp("memory"))


def _row(rows, **match):
    (row,) = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return row


def test_communication_quick_configuration(communication):
    rows = communication["rows"]
    assert {(r["preset"], r["vocab_size"], r["K"], r["payload_dtype"]) for r in rows} == {("16m", 256, 32, "fp32")}
    assert {r["variant"] for r in rows} == {"ddp", "diloco", "local_adam", "desloc", "lordo_global[svd]",
                                            "lordo_global[dct]", "lordo_global[svd,F=4]", "lordo_global[svd,F=0]",
                                            "lordo_local"}
    assert all(r["rank"] == 32 for r in rows)


def test_lordo_global_sends_8x_less_than_ddp_at_k32(communication):
    rows = communication["rows"]
    ddp = _row(rows, variant="ddp")
    for variant in ("lordo_global[svd]", "lordo_global[dct]"):
        lordo = _row(rows, variant=variant)
        assert ddp["total_bytes_per_step"] / lordo["total_bytes_per_step"] > 8
        assert ddp["up_bytes_per_step"] / lordo["up_bytes_per_step"] > 8
        assert lordo["reduction_vs_ddp"] == pytest.approx(ddp["total_bytes_per_step"] / lordo["total_bytes_per_step"])
        # it sends its moments, so more than DiLoCo's bare pseudo-gradient, less than Local Adam
        assert _row(rows, variant="diloco")["up_bytes_per_round"] < lordo["up_bytes_per_round"] \
            < _row(rows, variant="local_adam")["up_bytes_per_round"]
    # DCT projections are r int64 indices: a smaller broadcast than fp32 SVD bases
    assert _row(rows, variant="lordo_global[dct]")["down_bytes_per_round"] \
        < _row(rows, variant="lordo_global[svd]")["down_bytes_per_round"]


def test_dense_sync_factor_sends_the_full_size_moments_every_f_rounds(communication):
    """LoRDO-Global's uplink is Δ + the low-rank moments + the full-size moments of the other
    parameters (embedding, norms); F = 4 sends the last a quarter as often, F = 0 never."""
    rows = communication["rows"]
    every, f4, never = (_row(rows, variant=v) for v in ("lordo_global[svd]", "lordo_global[svd,F=4]",
                                                       "lordo_global[svd,F=0]"))
    assert f4["cycle_rounds"] == 4 and never["cycle_rounds"] == 1 and f4["dense_sync_factor"] == 4
    dense = every["up_tensor_bytes_per_round"] - never["up_tensor_bytes_per_round"]  # both dense moments, fp32
    # 16m with the byte vocabulary: embedding 256 x 256, 9 RMSNorm weights of 256 (2 x 4 layers + final)
    assert dense == 2 * 4 * (256 * 256 + 9 * 256)
    assert f4["up_tensor_bytes_per_round"] == pytest.approx(never["up_tensor_bytes_per_round"] + dense / 4)
    diloco = _row(rows, variant="diloco")["up_tensor_bytes_per_round"]
    assert diloco < never["up_tensor_bytes_per_round"] < f4["up_tensor_bytes_per_round"] < every["up_tensor_bytes_per_round"]


def test_diloco_uplink_is_the_pseudo_gradient(communication):
    rows = communication["rows"]
    diloco = _row(rows, variant="diloco")
    params = diloco["num_params"]
    assert params > 3_000_000
    up = diloco["up_bytes_per_round"]
    assert 4 * params <= up < 1.01 * 4 * params  # Δ in fp32 plus protobuf framing
    assert diloco["up_tensor_bytes_per_round"] == 4 * params
    # per step is per round / K; DDP moves a gradient every step
    assert diloco["up_bytes_per_step"] == pytest.approx(up / 32)
    ddp = _row(rows, variant="ddp")
    assert 4 * params <= ddp["up_bytes_per_step"] < 1.01 * 4 * params
    assert ddp["up_bytes_per_round"] == pytest.approx(32 * ddp["up_bytes_per_step"])
    # Local Adam: θ and both full-size moments; DES-LOC: Δ + u/3 + v/6 per round on average
    assert _row(rows, variant="local_adam")["up_tensor_bytes_per_round"] == 3 * 4 * params
    assert _row(rows, variant="desloc")["up_tensor_bytes_per_round"] == pytest.approx(1.5 * 4 * params)


def test_memory_lordo_state_matches_formula(memory):
    rows = [r for r in memory["state"] if r["preset"] == "16m" and r["vocab_size"] == 256]
    assert {r["device"] for r in rows} == {"cpu", "meta"}  # counted for real and on meta
    for config in ("lordo_ef_fp32", "lordo_ef_bf16", "lordo_no_ef", "lordo_ef_top4", "lordo_ef_top32", "adamw"):
        real = _row(rows, config=config, device="cpu")
        meta = _row(rows, config=config, device="meta")
        assert real["state_bytes"] == meta["state_bytes"] == real["formula_bytes"], config
        assert real["matches_formula"]
    ef32, ef16, no_ef = (_row(rows, config=c, device="cpu") for c in ("lordo_ef_fp32", "lordo_ef_bf16", "lordo_no_ef"))
    lowrank_numel = round(ef32["lowrank_param_share"] * ef32["num_params"])
    # the error-feedback buffer is one full-size copy of every low-rank matrix, at its dtype
    assert ef32["state_breakdown"]["ef"] == 4 * lowrank_numel
    assert ef16["state_breakdown"]["ef"] == 2 * lowrank_numel
    assert "ef" not in no_ef["state_breakdown"]
    # the compressed buffer: int32 index + int8 value per kept entry (1/32 of each matrix) + one scale
    topk = _row(rows, config="lordo_ef_top32", device="cpu")["state_breakdown"]
    assert "ef" not in topk and topk["ef_val"] * 4 == topk["ef_idx"]
    assert lowrank_numel / 32 <= topk["ef_val"] < lowrank_numel / 32 + 64
    top4, top32 = (_row(rows, config=c, device="cpu")["state_bytes"] for c in ("lordo_ef_top4", "lordo_ef_top32"))
    assert no_ef["state_bytes"] < top32 < top4 < ef16["state_bytes"]
    assert no_ef["state_bytes"] < ef16["state_bytes"] < ef32["state_bytes"] < _row(rows, config="adamw", device="cpu")["state_bytes"]


def test_memory_adamw_is_two_fp32_moments(memory):
    adamw = _row(memory["state"], preset="16m", vocab_size=256, config="adamw", device="cpu")
    n, tensors = adamw["num_params"], adamw["num_param_tensors"]
    assert adamw["state_bytes"] == 2 * 4 * n + 4 * tensors  # + one fp32 step counter per tensor
    assert adamw["state_breakdown"] == {"exp_avg": 4 * n, "exp_avg_sq": 4 * n, "step": 4 * tensors}


def test_memory_client_peak(memory):
    peaks = memory["peak"]
    assert {r["config"] for r in peaks} == {"adamw", "lordo_ef_fp32"} and {r["preset"] for r in peaks} == {"tiny"}
    for r in peaks:
        stages = r["stages"]
        assert 50e6 < stages["after_import"]["peak"] <= r["peak_rss_bytes"] < 4e9
        assert r["peak_rss_bytes"] == stages["after_encode"]["peak"]
        assert r["optimizer_state_bytes"] > 0 and r["update_bytes"] > 4 * r["num_params"]
