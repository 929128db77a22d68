"""Optimizer-state memory per method, from real optimizer state tensors, and a client's peak RSS.

State bytes: the inner optimizer of each method is built with `build_inner_optimizer` (the same
factory the workers use) over the preset's model and stepped once; every tensor it then keeps in
`optimizer.state` (moments, error-feedback buffer, projection, step counters) is counted with
`lordo_fed.metrics.optimizer_state_bytes`. 125m and 720m are built on the `meta` device (real
shapes and dtypes, no storage); 16m is also built for real and stepped once on random tokens,
and both counts must agree. Each count is checked against docs/algorithm.md ("Communication and memory per
low-rank p×q matrix"): AdamW 2pq floats per matrix; GaLore 2pr + rq (moments and basis); LoRDO
2pr + rq + pq (the error-feedback buffer, fp32 or bf16); parameters that are not low-rank
(embedding, norms) keep two full-size moments under every method; plus one fp32 step counter per
parameter tensor.

| config          | methods                             | low-rank matrices          |
|-----------------|-------------------------------------|----------------------------|
| adamw           | ddp, diloco, local_adam, desloc     | 2pq                        |
| lordo_ef_fp32   | lordo_global, lordo_local, lowrank_ddp | 2pr + rq + pq (fp32 EF) |
| lordo_ef_bf16   | the same, EF stored in bf16         | 2pr + rq + pq/2            |
| lordo_no_ef     | the same without EF (= GaLore's state) | 2pr + rq                |
| lordo_ef_top4   | EF compressed: top 1/4 of E, int8 values | 2pr + rq + 5⌈pq/4⌉ + 4 |
| lordo_ef_top32  | EF compressed: top 1/32 of E, int8 values | 2pr + rq + 5⌈pq/32⌉ + 4 |

Peak memory: a subprocess acts as one client for one round, as in deployment: it builds the model
and its worker, decodes the encoded `GlobalState` the server would send, trains K local steps on
random byte tokens, encodes its `WorkerUpdate`, and reports its peak resident set after each
stage (the interpreter and torch alone are the first figure): VmHWM from /proc/self/status,
because Linux's `getrusage(RUSAGE_SELF).ru_maxrss` (also reported) inherits the parent's
high-water mark across fork/exec, which made every client read as large as the benchmark itself.

    python benchmarks/memory.py           # 16m, 125m, 360m, 720m x vocab 256 / 50257; 16m client peaks
    python benchmarks/memory.py --peak-presets 125m,360m,720m   # a worker's peak at scale (~15 min)
    python benchmarks/memory.py --quick   # 16m state counts (vocab 256), tiny client peaks

At 125m and beyond a client round is one local step of batch 1 x 128 (parameters, gradients and
optimizer state set the peak there, not activations; a CPU takes seconds per step at 720m).
Writes benchmarks/results/memory.json and memory.png.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from lordo_fed.metrics import optimizer_state_bytes, peak_rss_bytes, tensor_bytes
from lordo_fed.model import ModelConfig, build_model, count_parameters, lm_loss, lowrank_parameter_names
from lordo_fed.optim.config import InnerConfig, build_inner_optimizer
from lordo_fed.optim.ef_compress import kept_entries
from lordo_fed.optim.projection import get_projection_method, projection_side

try:
    from benchmarks.common import BYTE_VOCAB, GPT2_VOCAB, RANKS, human_bytes, make_parser, new_figure, png_path, \
        print_rows, result_header, run_child, write_json
except ImportError:  # run as `python benchmarks/memory.py` without the repo root on sys.path
    from common import BYTE_VOCAB, GPT2_VOCAB, RANKS, human_bytes, make_parser, new_figure, png_path, \
        print_rows, result_header, run_child, write_json


CONFIGS: dict[str, dict] = {
    "adamw": dict(name="adamw"),
    "lordo_ef_fp32": dict(name="lordo", error_feedback=True, ef_dtype="fp32"),
    "lordo_ef_bf16": dict(name="lordo", error_feedback=True, ef_dtype="bf16"),
    "lordo_no_ef": dict(name="lordo", error_feedback=False),
    "lordo_ef_top4": dict(name="lordo", error_feedback=True, ef_density=1 / 4),
    "lordo_ef_top32": dict(name="lordo", error_feedback=True, ef_density=1 / 32),
}
METHODS_OF = {
    "adamw": ["ddp", "diloco", "local_adam", "desloc"],
    "lordo_ef_fp32": ["lowrank_ddp", "lordo_global", "lordo_local"],
    "lordo_ef_bf16": ["lowrank_ddp", "lordo_global", "lordo_local"],
    "lordo_no_ef": ["lowrank_ddp", "lordo_global", "lordo_local"],
    "lordo_ef_top4": ["lowrank_ddp", "lordo_global", "lordo_local"],
    "lordo_ef_top32": ["lowrank_ddp", "lordo_global", "lordo_local"],
}
# The client process of the peak-memory measurement runs this method for each config.
PEAK_METHOD = {"adamw": "diloco", "lordo_ef_fp32": "lordo_global", "lordo_ef_bf16": "lordo_global",
               "lordo_no_ef": "lordo_global", "lordo_ef_top4": "lordo_global", "lordo_ef_top32": "lordo_global"}


def inner_config(config: str, rank: int) -> InnerConfig:
    from lordo_fed.rounds.methods import METHOD_DEFAULTS

    own = METHOD_DEFAULTS[PEAK_METHOD[config]]  # the lr and γ of the method the config stands for
    return InnerConfig(rank=rank, projection="global", proj_method="svd", **{**own, **CONFIGS[config]}).validate()


# ---------------------------------------------------------------------------------------------
# state bytes


def stepped_optimizer(model: torch.nn.Module, config: str, rank: int, real: bool) -> torch.optim.Optimizer:
    """The inner optimizer of `config` after one step: a real gradient of random tokens (real
    model) or empty meta gradients (meta model: the state tensors get their real shapes)."""
    opt = build_inner_optimizer(model, inner_config(config, rank), lowrank_parameter_names(model))
    if hasattr(opt, "low_rank_params"):
        svd = get_projection_method("svd")
        for i, (p, group) in enumerate(opt.low_rank_params()):
            side = projection_side(p.shape)
            if real:
                stored = svd.initial(p.shape, group["rank"], side, seed=i)
            else:
                stored = torch.empty((group["rank"], p.shape[1]) if side == "right" else (p.shape[0], group["rank"]),
                                     device="meta")
            opt.set_projection(p, stored)
    if real:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model.vocab_size, (2, 33), generator=gen)
        lm_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
    else:
        for p in model.parameters():
            p.grad = torch.empty_like(p)
    opt.step()
    return opt


def state_breakdown(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes per state key (exp_avg, exp_avg_sq, ef, proj, step) over all parameters."""
    out: dict[str, int] = {}
    for st in opt.state.values():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[key] = out.get(key, 0) + tensor_bytes(value)
    return dict(sorted(out.items()))


def formula(shapes: dict[str, tuple[int, ...]], ranks: dict[str, int], config: str) -> dict[str, float]:
    """ALGORITHM.md's memory table in bytes: per low-rank p×q matrix AdamW 2pq, GaLore 2pr + rq,
    LoRDO 2pr + rq + pq (EF at its dtype); every other parameter 2 full-size moments; 4 bytes of
    step counter per parameter tensor. Also the share on the low-rank matrices alone."""
    cfg = CONFIGS[config]
    lordo = cfg["name"] == "lordo"
    ef_size = {"fp32": 4, "bf16": 2}[cfg.get("ef_dtype", "fp32")] if cfg.get("error_feedback") else 0
    density = cfg.get("ef_density", 1.0)
    lowrank = other = 0.0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if lordo and name in ranks:
            p, q = shape
            r = ranks[name]
            # E: pq values at its dtype, or compressed: k int32 indices + k int8 values + one fp32 scale
            ef = (5 * kept_entries(shape, density) + 4) if density < 1 else ef_size * p * q
            if projection_side(shape) == "right":  # p >= q: moments p×r, basis r×q
                lowrank += 4 * (2 * p * r + r * q) + ef
            else:  # the mirror image: moments r×q, basis p×r
                lowrank += 4 * (2 * r * q + p * r) + ef
        elif name in ranks:
            lowrank += 4 * 2 * numel
        else:
            other += 4 * 2 * numel
    steps = 4.0 * len(shapes)
    return {"total": lowrank + other + steps, "lowrank_matrices": lowrank, "other_params": other, "step_counters": steps}


def count_states(preset: str, vocab: int, real: bool) -> list[dict]:
    """One row per config for a preset: measured state bytes, breakdown, formula."""
    rank = RANKS[preset]
    rows = []
    for config in CONFIGS:
        torch.manual_seed(0)
        if real:
            model = build_model(ModelConfig(preset=preset), vocab)
        else:
            with torch.device("meta"):
                model = build_model(ModelConfig(preset=preset), vocab)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        ranks = {n: rank for n in lowrank_parameter_names(model) if rank < min(shapes[n])}
        opt = stepped_optimizer(model, config, rank, real)
        measured = optimizer_state_bytes(opt)
        f = formula(shapes, ranks, config)
        n_params = count_parameters(model)
        rows.append({
            "preset": preset, "vocab_size": vocab, "rank": rank, "config": config, "methods": METHODS_OF[config],
            "device": "cpu" if real else "meta", "num_params": n_params, "num_param_tensors": len(shapes),
            "param_bytes": 4 * n_params, "lowrank_param_share": sum(math.prod(shapes[n]) for n in ranks) / n_params,
            "state_bytes": measured, "state_breakdown": state_breakdown(opt),
            "formula_bytes": f["total"], "formula_breakdown": f, "matches_formula": measured == f["total"],
            "state_over_params": measured / (4 * n_params),
        })
        del opt, model
        gc.collect()
    return rows


# ---------------------------------------------------------------------------------------------
# peak memory of a client process


def _maxrss_bytes() -> int:
    """getrusage(RUSAGE_SELF).ru_maxrss in bytes (Linux reports kB, macOS bytes).

    Caveat: Linux carries the high-water mark across fork/execve, so a child's ru_maxrss starts
    at its parent's RSS; `peak_rss_bytes` (VmHWM, the peak of this process's own address space)
    is the figure to trust. Reported next to it to show the difference."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _rss_bytes() -> int | None:
    """Current resident set (VmRSS from /proc/self/status) in bytes, or None without /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _stage() -> dict[str, int | None]:
    """Peak so far, current RSS and raw ru_maxrss, in bytes."""
    return {"peak": peak_rss_bytes(), "rss": _rss_bytes(), "ru_maxrss": _maxrss_bytes()}


def _settings(config: str, rank: int, local_steps: int):
    from lordo_fed.rounds.methods import resolve_method
    from lordo_fed.rounds.outer import OuterConfig
    from lordo_fed.rounds.config import RoundConfig

    # A seeded round-1 basis: the client process gets a complete GlobalState without the round-0
    # gradient exchange (which does not change what a round holds in memory).
    inner = InnerConfig(rank=rank, init_projection="random", **{k: v for k, v in CONFIGS[config].items() if k != "name"})
    return resolve_method(PEAK_METHOD[config], inner, RoundConfig(local_steps=local_steps), OuterConfig())


def client_child(spec: dict) -> dict:
    """One client round in this process (run by `--child`): decode, K steps, encode; RSS per stage."""
    import numpy as np

    from lordo_fed.wire import codec
    from lordo_fed.wire.decode import decode_global_state
    from lordo_fed.wire.encode import encode_update
    from lordo_fed.data import TokenShard
    from lordo_fed.rounds.methods import make_worker, resolve_method  # noqa: F401 (imported before the first stage)
    from lordo_fed.rounds.outer import OuterConfig  # noqa: F401
    from lordo_fed.rounds.config import RoundConfig  # noqa: F401

    torch.set_num_threads(1)
    stages = {"after_import": _stage()}
    torch.manual_seed(0)
    device = torch.device(spec.get("device", "cpu"))
    model = build_model(ModelConfig(preset=spec["preset"]), BYTE_VOCAB).to(device)
    settings = _settings(spec["config"], spec["rank"], spec["local_steps"])
    shard = TokenShard(np.random.default_rng(0).integers(0, BYTE_VOCAB, 200_000, dtype=np.int64))
    worker = make_worker(0, model, settings, shard, lowrank_parameter_names(model), total_steps=1000,
                         batch_size=spec["batch_size"], seq_len=spec["seq_len"], seed=0)
    stages["after_model"] = _stage()
    model_id = codec.model_id(dict(model.named_parameters()))
    state = decode_global_state(Path(spec["global_state"]).read_bytes(), model_id)
    stages["after_decode"] = _stage()
    t0 = time.perf_counter()
    update = worker.train_round(state)
    seconds = time.perf_counter() - t0
    stages["after_round"] = _stage()
    up = encode_update(update, model_id, spec.get("payload_dtype", "fp32"))
    stages["after_encode"] = _stage()
    # on a GPU: the device's peak (parameters, gradients, optimizer state, activations), bf16 autocast
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"stages": stages, "peak_rss_bytes": peak_rss_bytes(), "ru_maxrss_bytes": _maxrss_bytes(),
            "device": str(device), "peak_device_bytes": device_peak,
            "optimizer_state_bytes": optimizer_state_bytes(worker.optimizer),
            "update_bytes": len(up), "round_seconds": seconds, "train_loss": update.metrics["train_loss"]}


def peak_memory(preset: str, config: str, tmp: Path, local_steps: int, batch_size: int, device: str = "cpu") -> dict:
    """Run `client_child` in a fresh interpreter for one config; the server side (the encoded
    GlobalState of round 1) is prepared here and handed over as a file."""
    from lordo_fed.wire import codec
    from lordo_fed.wire.encode import encode_global_state
    from lordo_fed.rounds.methods import lowrank_ranks, make_aggregator

    rank = RANKS[preset]
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset), BYTE_VOCAB)
    settings = _settings(config, rank, local_steps)
    ranks = lowrank_ranks(model, ModelConfig().lowrank_pattern, rank, settings.inner.name)
    agg = make_aggregator(model, settings, ranks, seed=0)
    path = tmp / f"global_state_{preset}_{config}.bin"
    n_params = count_parameters(model)
    # fp32 payloads of 720m exceed protobuf's 2 GiB message limit (the codec refuses them): bf16 there
    payload_dtype = "fp32" if 4 * n_params < 0.9 * 2**31 else "bf16"
    path.write_bytes(encode_global_state(agg.global_state(), codec.model_id(dict(model.named_parameters())),
                                               payload_dtype))
    del agg, model
    seq_len = min(128, ModelConfig(preset=preset).max_seq_len or 128)
    spec = {"preset": preset, "config": config, "rank": rank, "local_steps": local_steps,
            "batch_size": batch_size, "seq_len": seq_len, "global_state": str(path), "device": device,
            "payload_dtype": payload_dtype}
    out = run_child(__file__, spec, f"client process for {preset}/{config}", timeout=600)
    stages = out["stages"]
    out.update(preset=preset, vocab_size=BYTE_VOCAB, config=config, method=PEAK_METHOD[config], rank=rank,
               num_params=n_params, param_bytes=4 * n_params, local_steps=local_steps, batch_size=batch_size,
               seq_len=seq_len, global_state_bytes=path.stat().st_size, payload_dtype=payload_dtype,
               peak_over_baseline_bytes=out["peak_rss_bytes"] - stages["after_import"]["peak"])
    path.unlink()
    return out


# ---------------------------------------------------------------------------------------------
# output


def print_tables(state_rows: list[dict], peak_rows: list[dict]) -> None:
    print_rows(f"{'preset':6} {'vocab':>6} {'params':>8} {'config':14} {'dev':4} {'state':>10} {'formula':>10} "
               f"{'= ?':>4} {'x params':>8}",
               (f"{r['preset']:6} {r['vocab_size']:>6} {r['num_params'] / 1e6:7.1f}M {r['config']:14} {r['device']:4} "
                f"{human_bytes(r['state_bytes']):>10} {human_bytes(r['formula_bytes']):>10} "
                f"{'yes' if r['matches_formula'] else 'NO':>4} {r['state_over_params']:8.3f}" for r in state_rows))
    if peak_rows:
        print()
        print_rows(f"{'preset':6} {'config':14} {'method':13} {'import':>10} {'model':>10} {'peak':>10} "
                   f"{'peak-import':>11} {'opt state':>10}",
                   (f"{r['preset']:6} {r['config']:14} {r['method']:13} "
                    f"{human_bytes(r['stages']['after_import']['peak']):>10} "
                    f"{human_bytes(r['stages']['after_model']['peak']):>10} {human_bytes(r['peak_rss_bytes']):>10} "
                    f"{human_bytes(r['peak_over_baseline_bytes']):>11} {human_bytes(r['optimizer_state_bytes']):>10}"
                    for r in peak_rows))


def plot(state_rows: list[dict], peak_rows: list[dict], out_png) -> None:
    vocabs = sorted({r["vocab_size"] for r in state_rows})
    presets = sorted({r["preset"] for r in state_rows}, key=RANKS.get)
    configs = list(CONFIGS)
    n_panels = len(vocabs) + (1 if peak_rows else 0)
    fig = new_figure(max(4.5, 1.9 * len(presets)) * n_panels, 4.6)
    width = 0.8 / (len(configs) + 1)
    for j, vocab in enumerate(vocabs):
        ax = fig.add_subplot(1, n_panels, j + 1)
        sel = {(r["preset"], r["config"]): r for r in state_rows if r["vocab_size"] == vocab and r["device"] == "meta"}
        sel.update({(r["preset"], r["config"]): r for r in state_rows
                    if r["vocab_size"] == vocab and (r["preset"], r["config"]) not in sel})
        xs0 = range(len(presets))
        ax.bar([x - 0.4 + width / 2 for x in xs0], [sel[(p, configs[0])]["param_bytes"] / 1e9 for p in presets], width,
               color="0.75", label="parameters (fp32)" if j == 0 else None)
        for m, config in enumerate(configs):
            xs = [x - 0.4 + (m + 1.5) * width for x in xs0]
            ys = [sel[(p, config)]["state_bytes"] / 1e9 for p in presets]
            bars = ax.bar(xs, ys, width, color=f"C{m}", label=config if j == 0 else None)
            for bar, p in zip(bars, presets):
                ax.annotate(f"{sel[(p, config)]['state_over_params']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                            bar.get_height()), ha="center", va="bottom", fontsize=6, rotation=90,
                            xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(list(xs0), [f"{p}\n{sel[(p, configs[0])]['num_params'] / 1e6:.0f}M, r={RANKS[p]}" for p in presets])
        ax.set_yscale("log")
        ax.margins(y=0.2)
        ax.set_ylabel("optimizer state per worker (GB)")
        ax.set_title(f"vocab {vocab}; labels: state / parameter bytes", fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    if peak_rows:
        ax = fig.add_subplot(1, n_panels, n_panels)
        xs = range(len(peak_rows))
        segments = [("python + torch", "after_import", "0.8"), ("+ model, worker, decoded state", "after_decode", "0.6")]
        bottom = [0.0] * len(peak_rows)
        for label, stage, color in segments:
            top = [r["stages"][stage]["peak"] / 1e6 for r in peak_rows]
            ax.bar(xs, [t - b for t, b in zip(top, bottom)], bottom=bottom, color=color, label=label)
            bottom = top
        top = [r["peak_rss_bytes"] / 1e6 for r in peak_rows]
        ax.bar(xs, [t - b for t, b in zip(top, bottom)], bottom=bottom,
               color=[f"C{configs.index(r['config'])}" for r in peak_rows])
        for i, r in enumerate(peak_rows):
            ax.annotate(f"{top[i]:.0f} MB\n(opt. state {r['optimizer_state_bytes'] / 1e6:.1f})", (i, top[i]),
                        ha="center", va="bottom", fontsize=6)
        ax.set_xticks(list(xs), [f"{r['preset']}\n{r['config']}" for r in peak_rows], fontsize=6)
        ax.set_ylabel("client peak RSS (MB, VmHWM)")
        ax.margins(y=0.15)
        r0 = peak_rows[0]
        ax.set_title(f"one client round: K={r0['local_steps']}, batch {r0['batch_size']}x{r0['seq_len']}, "
                     f"vocab 256 (colour: + round, reply)", fontsize=8)
        ax.legend(fontsize=6, loc="lower right")
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out_png, format="png")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(client_child(json.loads(sys.argv[2]))))
        return
    parser = make_parser("memory", __doc__, "16m state counts (vocab 256) and tiny client peaks only")
    parser.add_argument("--device", default="cpu", help="where the client process trains: cpu or cuda "
                        "(cuda adds the device's peak, torch.cuda.max_memory_allocated)")
    parser.add_argument("--peak-presets", default=None,
                        help="comma-separated presets of the client peak measurement (default: 16m; tiny with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        presets, vocabs, real_vocabs, peak_preset, peak_configs = ["16m"], [BYTE_VOCAB], [BYTE_VOCAB], "tiny", \
            ["adamw", "lordo_ef_fp32"]
        local_steps, batch_size = 2, 2
    else:
        presets, vocabs, real_vocabs, peak_preset, peak_configs = ["16m", "125m", "360m", "720m"], \
            [BYTE_VOCAB, GPT2_VOCAB], [BYTE_VOCAB, GPT2_VOCAB], "16m", list(CONFIGS)
        local_steps, batch_size = 4, 8
    peak_presets = args.peak_presets.split(",") if args.peak_presets else [peak_preset]
    for p in peak_presets:
        if p not in RANKS:
            parser.error(f"--peak-presets: unknown preset {p!r}: expected some of {sorted(RANKS)}")
    t0 = time.perf_counter()
    state_rows = []
    for preset in presets:
        for vocab in vocabs:
            state_rows += count_states(preset, vocab, real=False)
            if preset == "16m" and vocab in real_vocabs:
                real = count_states(preset, vocab, real=True)
                for r_real, r_meta in zip(real, state_rows[-len(real):]):
                    if r_real["state_bytes"] != r_meta["state_bytes"]:
                        raise AssertionError(f"{preset}/{vocab}/{r_real['config']}: real {r_real['state_bytes']} "
                                             f"!= meta {r_meta['state_bytes']}")
                state_rows += real
    mismatched = [r for r in state_rows if not r["matches_formula"]]
    if mismatched:
        raise AssertionError(f"state bytes differ from the formula: {[(r['preset'], r['config']) for r in mismatched]}")
    peak_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in peak_presets:
            big = RANKS[preset] >= RANKS["125m"]  # one step of batch 1: state, not activations, sets the peak
            for c in peak_configs:
                row = peak_memory(preset, c, Path(tmp), 1 if big else local_steps, 1 if big else batch_size, args.device)
                peak_rows.append(row)
                dev = f", device {human_bytes(row['peak_device_bytes'])}" if row["peak_device_bytes"] else ""
                print(f"  peak {preset} {c}: RSS {human_bytes(row['peak_rss_bytes'])}{dev}", flush=True)
    config = {"presets": presets, "vocab_sizes": vocabs, "ranks": {p: RANKS[p] for p in presets},
              "configs": CONFIGS, "methods_of": METHODS_OF, "real_16m_vocabs": real_vocabs,
              "peak": {"presets": peak_presets, "configs": peak_configs, "methods": PEAK_METHOD,
                       "local_steps": local_steps, "batch_size": batch_size, "vocab_size": BYTE_VOCAB},
              "notes": ["state_bytes: optimizer_state_bytes after one optimizer step (meta device: real shapes)",
                        "formula: ALGORITHM.md per low-rank matrix (AdamW 2pq, GaLore 2pr+rq, LoRDO +pq EF) "
                        "+ 2 full moments for every other parameter + a 4-byte step counter per tensor",
                        "the outer optimizer's state (DiLoCo Nesterov momentum, QHM) lives on the server",
                        "peak_rss_bytes: VmHWM (peak resident set) of a fresh client process for one round; "
                        "ru_maxrss_bytes is reported too, but on Linux it inherits the parent's "
                        "high-water mark across fork/exec"]}
    result = result_header("memory", args.quick, config)
    result["seconds"] = time.perf_counter() - t0
    result["state"] = state_rows
    result["peak"] = peak_rows
    out = write_json(result, args.out)
    print_tables(state_rows, peak_rows)
    plot(state_rows, peak_rows, png_path(out))
    print(f"written {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
