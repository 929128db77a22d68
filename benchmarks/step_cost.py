"""Step cost: the LoRDO inner step against AdamW, and the price of a projection refresh.

1. Inner step. Two copies of the same model (same θ0), one stepped by `torch.optim.AdamW` and one
   by `LoRDO` (LoRDO-Global's inner step: the shared projection fixed, error feedback on, QH term
   outside), on the same batches. Forward+backward and `optimizer.step()` are timed separately,
   interleaved (A, B, A, B, ...) so that load on a shared machine hits both alike; the ratio of
   medians is reported. Projections are not refreshed inside the timed steps: under LoRDO-Global
   the server refits them once per round (item 2), under LoRDO-Local a worker does it every
   T_proj steps.
2. Projection refresh. Seconds to fit a rank-r projection with exact SVD (`torch.linalg.svd`),
   randomized SVD (Halko et al., 2 power iterations) and DCT column selection, on 720m-shaped
   matrices (2048 x 5632, 2048 x 2048, and the 720m preset's own shapes), r = 256 (d / 8); and the
   whole-model refresh: the sum over every low-rank matrix of the 720m preset (built on `meta`).
3. Perplexity. What each refresh method does to quality is measured by benchmarks/quality.py
   (runs proj_rsvd_lordo_global / proj_dct_lordo_global against rank16_lordo_global); this script
   copies those figures from results/quality.json when it exists.

    python benchmarks/step_cost.py           # 16m model, batch 8 x 128; 720m-shaped refreshes (~1 min on 2 cores)
    python benchmarks/step_cost.py --quick   # tiny model, small matrices (seconds)
    python benchmarks/step_cost.py --device cuda
Writes benchmarks/results/step_cost.json and step_cost.png.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from typing import Callable

import torch

from lordo_fed.device import autocast, pick_device
from lordo_fed.model import ModelConfig, build_model, count_parameters, lm_loss, lowrank_parameter_names
from lordo_fed.optim import LoRDO
from lordo_fed.optim.config import InnerConfig, build_inner_optimizer
from lordo_fed.rounds.methods import METHOD_DEFAULTS
from lordo_fed.optim.projection import get_projection_method, projection_side

try:
    from benchmarks.common import RANKS, RESULTS, make_parser, new_figure, png_path, result_header, write_json
except ImportError:  # run as `python benchmarks/step_cost.py`
    from common import RANKS, RESULTS, make_parser, new_figure, png_path, result_header, write_json

PROJ_METHODS = ("svd", "rsvd", "dct")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of fn(), with the device drained before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


OPTIMIZERS = ("adamw", "adamw_fast", "lordo", "lordo_batched")
"""torch AdamW as the product builds it (torch's default: a for-loop on the CPU, foreach on CUDA),
AdamW's fastest form (foreach on the CPU, fused on CUDA: the issue's yardstick), the per-parameter
LoRDO (the reference) and the batched LoRDO (the product's default)."""


def make_optimizer(name: str, model: torch.nn.Module, preset: str, seed: int) -> torch.optim.Optimizer:
    """One of OPTIMIZERS; LoRDO with LoRDO-Global's shared projection set (seeded random basis)."""
    names = lowrank_parameter_names(model)
    kind = "adamw" if name.startswith("adamw") else "lordo"
    own = METHOD_DEFAULTS["ddp" if kind == "adamw" else "lordo_global"]  # the method's lr and γ
    cfg = InnerConfig(name=kind, rank=RANKS[preset], projection="global", init_projection="random",
                      batched=name == "lordo_batched", **own).validate()
    opt = build_inner_optimizer(model, cfg, names, seed=seed)
    if name == "adamw_fast":
        cuda = next(model.parameters()).device.type == "cuda"
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
        d = opt.defaults
        opt = torch.optim.AdamW(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], foreach=not cuda, fused=cuda)
    if isinstance(opt, LoRDO):
        method = get_projection_method(opt.param_groups[0]["proj_method"])  # "auto" resolved by the factory
        device = next(model.parameters()).device
        for i, (p, group) in enumerate(opt.low_rank_params()):
            side = projection_side(p.shape)
            opt.set_projection(p, method.initial(p.shape, group["rank"], side, seed=seed + i, device=device))
    return opt


def inner_step(preset: str, vocab: int, batch: int, seq: int, steps: int, warmup: int, device: torch.device,
               seed: int = 0) -> dict:
    """Median seconds of forward+backward and of optimizer.step() for each of OPTIMIZERS (interleaved)."""
    torch.manual_seed(seed)
    base = build_model(ModelConfig(preset=preset), vocab).to(device)
    models = {name: copy.deepcopy(base) for name in OPTIMIZERS}
    opts = {name: make_optimizer(name, m, preset, seed) for name, m in models.items()}
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(warmup + steps)]
    times: dict[str, dict[str, list[float]]] = {n: {"fwd_bwd": [], "step": []} for n in models}
    for i, tokens in enumerate(batches):
        for name, model in models.items():
            opt = opts[name]

            def fwd_bwd() -> None:
                with autocast(device):
                    loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
                loss.backward()

            t_fb = timed(fwd_bwd, device)
            t_step = timed(opt.step, device)
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                times[name]["fwd_bwd"].append(t_fb)
                times[name]["step"].append(t_step)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    for n in med:
        med[n]["total"] = med[n]["fwd_bwd"] + med[n]["step"]
    ratios = {f"{k}_ratio_{a}_vs_{b}": med[a][k] / med[b][k] for k in ("step", "total")
              for a in ("lordo", "lordo_batched") for b in ("adamw", "adamw_fast")}
    return {
        "preset": preset, "vocab_size": vocab, "params": count_parameters(base), "rank": RANKS[preset],
        "batch": batch, "seq_len": seq, "timed_steps": steps, "warmup_steps": warmup,
        "adamw_fast": "fused" if device.type == "cuda" else "foreach",
        "median_seconds": med,
        # the product's step (batched LoRDO) against AdamW's fastest form: the goal
        "step_ratio_lordo_to_adamw": med["lordo_batched"]["step"] / med["adamw_fast"]["step"],
        "total_ratio_lordo_to_adamw": med["lordo_batched"]["total"] / med["adamw_fast"]["total"],
        **ratios,
        "samples": times,
    }


def test_matrix(shape: tuple[int, int], device: torch.device, seed: int) -> torch.Tensor:
    """A pseudo-gradient-like matrix: a decaying spectrum plus noise (fit time hardly depends on it)."""
    gen = torch.Generator().manual_seed(seed)
    p, q = shape
    k = min(p, q, 512)
    u = torch.randn(p, k, generator=gen)
    v = torch.randn(k, q, generator=gen)
    scale = torch.arange(1, k + 1, dtype=torch.float32).pow(-1.0)
    return ((u * scale) @ v + 0.01 * torch.randn(p, q, generator=gen)).to(device)


def refresh_times(shapes: list[tuple[int, int]], rank: int, repeats: int, device: torch.device) -> list[dict]:
    """Median seconds of one fit per (method, shape); the first call per method warms up caches."""
    rows = []
    for shape in shapes:
        m = test_matrix(shape, device, seed=sum(shape))
        side = projection_side(shape)
        for name in PROJ_METHODS:
            method = get_projection_method(name)
            method.fit(m, rank, side, seed=0)  # warm-up: DCT matrix cache, LAPACK workspaces
            secs = [timed(lambda: method.fit(m, rank, side, seed=r), device) for r in range(repeats)]
            rows.append({"method": name, "shape": list(shape), "rank": rank, "side": side,
                         "median_seconds": statistics.median(secs), "samples": secs})
            print(f"  refresh {name:5s} {shape}: {statistics.median(secs):.3f} s", flush=True)
    return rows


def batched_refresh(counts: dict[tuple[int, int], int], rank: int, device: torch.device,
                    methods: tuple[str, ...]) -> dict[str, float]:
    """Seconds of the aggregator's whole-model refit as the server runs it (`fit_projections`:
    same-shaped matrices stacked, one batched fit per stack, on `device`), measured once per
    method after a warm-up on one matrix of each shape. The exact SVD is left out on the CPU
    (~170 s at 720m: the per-matrix sum above estimates it)."""
    from lordo_fed.rounds.bases import fit_projections

    deltas, ranks = {}, {}
    for (p, q), n in counts.items():
        for i in range(n):
            name = f"{p}x{q}/{i}"
            deltas[name] = test_matrix((p, q), torch.device("cpu"), seed=i) if i < 2 else deltas[f"{p}x{q}/{i % 2}"]
            ranks[name] = rank
    out = {}
    for name in methods:
        method = get_projection_method(name)
        warm = {n: deltas[n] for n in deltas if n.endswith("/0")}
        fit_projections(warm, {n: rank for n in warm}, method, seed=0, device=device)
        out[name] = timed(lambda: fit_projections(deltas, ranks, method, seed=0, device=device), device)
        print(f"  whole-model refresh, batched, {name}: {out[name]:.2f} s", flush=True)
    return out


def model_matrices(preset: str) -> dict[tuple[int, int], int]:
    """Low-rank matrix shape -> how many the preset has (built on meta: no memory)."""
    with torch.device("meta"):
        model = build_model(ModelConfig(preset=preset), 256)
    params = dict(model.named_parameters())
    counts: dict[tuple[int, int], int] = {}
    for n in lowrank_parameter_names(model):
        shape = tuple(params[n].shape)
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def quality_effect() -> dict | None:
    """Perplexity per refresh method from benchmarks/quality.py's result, when it has been run."""
    path = RESULTS / "quality.json"
    if not path.exists():
        return None
    runs = json.loads(path.read_text())["runs"]
    labels = {"svd": "rank16_lordo_global", "rsvd": "proj_rsvd_lordo_global", "dct": "proj_dct_lordo_global"}
    found = {m: runs[l]["val_ppl"] for m, l in labels.items() if l in runs}
    return {"source": str(path.relative_to(RESULTS.parent.parent)), "val_ppl": found} if found else None


def plot(result: dict, path) -> None:
    fig = new_figure(12, 4.5)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    step = result["inner_step"]
    names = list(OPTIMIZERS)
    fb = [step["median_seconds"][n]["fwd_bwd"] * 1e3 for n in names]
    st = [step["median_seconds"][n]["step"] * 1e3 for n in names]
    ax1.bar(names, fb, label="forward + backward")
    ax1.bar(names, st, bottom=fb, label="optimizer.step()")
    ax1.set(ylabel="ms per step (median)",
            title=f"Inner step, {step['preset']} ({step['params'] / 1e6:.1f} M params), batch {step['batch']} x "
                  f"{step['seq_len']}\nbatched LoRDO / AdamW {step['adamw_fast']}: step "
                  f"{step['step_ratio_lordo_to_adamw']:.2f}, total {step['total_ratio_lordo_to_adamw']:.2f}")
    ax1.legend()
    rows = result["refresh"]
    shapes = sorted({tuple(r["shape"]) for r in rows}, key=lambda s: s[0] * s[1])
    width = 0.8 / len(PROJ_METHODS)
    for j, name in enumerate(PROJ_METHODS):
        ys = [next(r["median_seconds"] for r in rows if r["method"] == name and tuple(r["shape"]) == s) for s in shapes]
        ax2.bar([i + j * width for i in range(len(shapes))], ys, width, label=name)
    ax2.set_xticks([i + width for i in range(len(shapes))], [f"{p}x{q}" for p, q in shapes], fontsize=8)
    ax2.set(yscale="log", ylabel="seconds per fit (median)", title=f"Projection refresh, rank {rows[0]['rank']}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = make_parser("step_cost", __doc__, "tiny model, 256-sized matrices (seconds)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    parser.add_argument("--preset", default=None, help="model of the inner-step timing (default 16m; tiny with --quick)")
    args = parser.parse_args()
    device = pick_device(args.device)
    preset = args.preset or ("tiny" if args.quick else "16m")
    batch, seq, steps, warmup = (2, 32, 5, 2) if args.quick else (8, 128, 60, 5)
    refresh_preset = "small" if args.quick else "720m"
    rank = RANKS[refresh_preset]
    counts = model_matrices(refresh_preset)
    shapes = ([(64, 176), (64, 64)] if args.quick else [(2048, 5632), (2048, 2048)])
    shapes += [s for s in counts if s not in shapes]
    repeats = 2 if args.quick else 3
    load_before = os.getloadavg()
    started = time.perf_counter()
    print(f"inner step: {preset}, batch {batch} x {seq}, {steps} timed steps each, on {device}", flush=True)
    step = inner_step(preset, 256, batch, seq, steps, warmup, device)
    print(f"  step LoRDO/AdamW = {step['step_ratio_lordo_to_adamw']:.2f}, "
          f"total = {step['total_ratio_lordo_to_adamw']:.2f}", flush=True)
    print(f"projection refresh, rank {rank}, shapes {shapes}", flush=True)
    refresh = refresh_times(shapes, rank, repeats, device)
    whole = {}
    for name in PROJ_METHODS:
        per = {tuple(r["shape"]): r["median_seconds"] for r in refresh if r["method"] == name}
        whole[name] = sum(per[s] * n for s, n in counts.items())
    batched = batched_refresh(counts, rank, device, ("svd", "rsvd", "dct") if device.type == "cuda" else ("rsvd", "dct"))
    header = result_header("step_cost", args.quick, {
        "device": str(device), "inner_preset": preset, "batch": batch, "seq_len": seq, "timed_steps": steps,
        "refresh_preset": refresh_preset, "rank": rank, "repeats": repeats,
        "lordo": "projection=global (fixed shared basis), error feedback fp32, QH outside, omega 0.95",
    })
    if device.type == "cuda":
        header["machine"]["gpu"] = torch.cuda.get_device_name(device)
    result = {
        **header, "seconds": time.perf_counter() - started,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "inner_step": step, "refresh": refresh,
        "whole_model_refresh": {"preset": refresh_preset, "matrices": {f"{p}x{q}": n for (p, q), n in counts.items()},
                                "seconds": whole, "batched_seconds": batched},
        "perplexity_effect": quality_effect(),
    }
    out = write_json(result, args.out)
    plot(result, png_path(out))
    print(json.dumps({"step_ratio": step["step_ratio_lordo_to_adamw"], "total_ratio": step["total_ratio_lordo_to_adamw"],
                      "whole_model_refresh_s": whole, "batched_refresh_s": batched}, indent=1))
    print(f"wrote {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
