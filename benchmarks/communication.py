"""Bytes each worker sends and receives, per round and per training step, measured on the wire.

For every method the real round messages are built with the model's true parameter shapes
(random values: the encoded size does not depend on them), serialized with `lordo_fed.wire.encode`
(the `lordo_fed.v1` protobuf the Flower app sends) and measured with `len(bytes)`:

- ddp: one gradient up and one (all-reduced) gradient down per step, each measured as a
  `WorkerUpdate` whose delta is the full gradient; per round = K x that. (lowrank_ddp all-reduces
  the same full gradient, so it costs the same.)
- diloco, lordo_local: Δ up, θ down, every round; no optimizer state travels.
- local_adam: Δ + both full-size AdamW moments up, θ + averaged moments down, every round.
- desloc: Δ every round, first moment every K_u = 3 rounds, second every K_v = 6 (averaged over
  one 6-round cycle).
- lordo_global: Δ + the low-rank moments (and the full-size moments of the parameters that are
  not low-rank: embedding, norms) up; θ + projections + averaged moments down, every round.
  Projections as fp32 SVD bases (`svd`) or as r int64 DCT column indices (`dct`). Also with the
  full-size moments averaged every F rounds only (`rounds.dense_sync_factor`, F = 4) or never
  (F = 0): `lordo_global[svd,F=4]`, `lordo_global[svd,F=0]`.

Steady state is measured (a round whose predecessor averaged moments, i.e. round > the longest
sync period), so the first round's smaller broadcast is not counted. The periods, the moment
shapes and the ranks come from `lordo_fed.rounds.methods` / `lordo_fed.rounds.aggregator`, not from this file.
Every message is also checked against the analytic count of docs/algorithm.md
("Communication per low-rank p×q matrix"): the tensor bytes must match it exactly; what the
measured size adds is protobuf framing (names, shapes, headers).

Per-step figures are per worker: bytes per round / K. A ratio is method / DDP at the same preset,
vocabulary and payload dtype; `reduction_vs_ddp` is its inverse ("x less than DDP").

    python benchmarks/communication.py           # 16m + 125m, vocab 256 + 50257, K 8/32/128, fp32 + bf16
    python benchmarks/communication.py --quick   # 16m, vocab 256, K = 32, fp32
Writes benchmarks/results/communication.json and communication.png.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass

import torch

from lordo_fed.wire import codec
from lordo_fed.wire.encode import encode_global_state, encode_update
from lordo_fed.rounds.bases import low_rank_shape
from lordo_fed.rounds.methods import resolve_method
from lordo_fed.model import ModelConfig, build_model, count_parameters, lowrank_parameter_names
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.outer import OuterConfig
from lordo_fed.optim.projection import projection_side
from lordo_fed.wire.messages import GlobalState, WorkerUpdate, moment_key
from lordo_fed.rounds.config import RoundConfig

try:
    from benchmarks.common import BYTE_VOCAB, GPT2_VOCAB, RANKS, human_bytes, make_parser, new_figure, png_path, \
        print_rows, result_header, write_json
except ImportError:  # run as `python benchmarks/communication.py` without the repo root on sys.path
    from common import BYTE_VOCAB, GPT2_VOCAB, RANKS, human_bytes, make_parser, new_figure, png_path, \
        print_rows, result_header, write_json



@dataclass(frozen=True)
class Variant:
    """One row family: a method of `lordo_fed.rounds.methods.METHODS`, plus its projection encoding."""

    method: str
    proj_method: str = "svd"
    dense_sync_factor: int = 1
    """`rounds.dense_sync_factor`: F x the moment periods for parameters that are not low-rank."""

    @property
    def label(self) -> str:
        if self.method != "lordo_global":
            return self.method
        factor = f",F={self.dense_sync_factor}" if self.dense_sync_factor != 1 else ""
        return f"{self.method}[{self.proj_method}{factor}]"


VARIANTS = (Variant("ddp"), Variant("diloco"), Variant("local_adam"), Variant("desloc"),
            Variant("lordo_global", "svd"), Variant("lordo_global", "dct"),
            Variant("lordo_global", "svd", 4), Variant("lordo_global", "svd", 0), Variant("lordo_local"))

# Header values of the encoded messages. They are varints and change the size by a byte or two
# at most with K; every message is encoded once, with these values (B = 16 sequences of 256).
_TOKENS_PER_STEP = 16 * 256
_HEADER_K = 128


class ModelShapes:
    """Parameter names and shapes of a preset (built on the meta device: no memory, no init)."""

    def __init__(self, preset: str, vocab_size: int, rank: int):
        with torch.device("meta"):
            model = build_model(ModelConfig(preset=preset), vocab_size)
        self.preset, self.vocab_size, self.rank = preset, vocab_size, rank
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.num_params = count_parameters(model)
        self.model_id = codec.model_id(dict(model.named_parameters()))
        # lordo_fed.rounds.methods.lowrank_ranks, on shapes: only matrices with rank < min(p, q)
        self.ranks = {n: rank for n in lowrank_parameter_names(model) if rank < min(self.shapes[n])}
        del model
        # One buffer of random fp32 values; every float tensor of a message is a view into it.
        gen = torch.Generator().manual_seed(0)
        self.buffer = torch.randn(self.num_params, generator=gen)

    def view(self, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        n = math.prod(shape)
        offset %= max(1, self.num_params - n + 1)
        return self.buffer[offset:offset + n].view(shape)

    def params(self) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for name, shape in self.shapes.items():
            out[name] = self.view(shape, offset)
            offset += math.prod(shape)
        return out

    def moment_shape(self, name: str, low_rank: bool) -> tuple[int, ...]:
        if low_rank and name in self.ranks:
            return low_rank_shape(self.shapes[name], self.ranks[name])
        return self.shapes[name]

    def moments(self, rounds: RoundConfig, round_idx: int, lordo: bool) -> dict[str, torch.Tensor]:
        """What `Worker.due_moments(round_idx)` returns: each parameter's moments due that round
        (`RoundConfig.due`; low-rank shape for LoRDO's low-rank matrices, full size otherwise)."""
        out = {}
        for j, name in enumerate(self.shapes):
            low_rank = lordo and name in self.ranks
            for i, kind in enumerate(rounds.due(round_idx, low_rank)):
                out[moment_key(kind, name)] = self.view(self.moment_shape(name, low_rank), 7919 * (i + 1) + 104_729 * j)
        return out

    def projections(self, proj_method: str) -> dict[str, torch.Tensor]:
        """Stored-form projections of LoRDO-Global: an SVD basis (r×q right, p×r left, fp32) or
        r sorted int64 DCT column indices (lordo_fed.optim.projection)."""
        out = {}
        for name, r in self.ranks.items():
            shape = self.shapes[name]
            side = projection_side(shape)
            if proj_method == "dct":
                n = shape[1] if side == "right" else shape[0]
                out[name] = torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(1))[:r]).values
            else:
                out[name] = self.view((r, shape[1]) if side == "right" else (shape[0], r), 31 * len(out))
        return out


def _moment_numel(ms: ModelShapes, lordo: bool, low_rank: bool) -> int:
    """Floats in one moment of every parameter that is (`low_rank`) or is not LoRDO's low-rank."""
    return sum(math.prod(ms.moment_shape(n, low_rank)) for n in ms.shapes if (lordo and n in ms.ranks) == low_rank)


def _sync_period(rounds: RoundConfig) -> int:
    periods = [p for low_rank in (True, False) for p in rounds.periods(low_rank).values() if p]
    return math.lcm(*periods) if periods else 1


def _varint_len(value: int) -> int:
    return max(1, (int(value).bit_length() + 6) // 7)


class Encoder:
    """Encodes messages and returns their sizes. A message whose size is already known (same
    tensor names, shapes and dtypes, same header varint lengths: protobuf sizes depend on nothing
    else) is not encoded twice."""

    def __init__(self, ms: ModelShapes, payload_dtype: str):
        self.ms, self.payload_dtype = ms, payload_dtype
        self.cache: dict[tuple, tuple[int, int]] = {}
        self.encoded = 0
        self.seconds = 0.0

    @staticmethod
    def _signature(kind: str, msg) -> tuple:
        # The serialized size depends on the header integers only through their varint lengths.
        ints = (msg.round, msg.opt_step) if kind == "down" else (msg.round, msg.opt_step, msg.tokens, msg.worker_id)
        head = tuple(_varint_len(i) for i in ints)
        if kind == "up":
            head += (tuple(sorted(msg.metrics)),)
        return (kind, head, tuple((k, tuple(t.shape), t.dtype) for k, t in msg.tensors().items()))

    def size(self, kind: str, msg) -> tuple[int, int]:
        """(len(encoded bytes), tensor bytes) of a GlobalState ('down') or WorkerUpdate ('up')."""
        key = self._signature(kind, msg)
        if key not in self.cache:
            t0 = time.perf_counter()
            if kind == "down":
                data = encode_global_state(msg, self.ms.model_id, self.payload_dtype)
            else:
                data = encode_update(msg, self.ms.model_id, self.payload_dtype)
            n = codec.payload_nbytes(data)
            del data  # one message alive at a time (125m with the GPT-2 vocabulary: ~0.5 GB each)
            gc.collect()
            self.seconds += time.perf_counter() - t0
            self.encoded += 1
            self.cache[key] = (n, codec.tensors_nbytes(msg, self.payload_dtype))
        return self.cache[key]


def measure_variant(enc: Encoder, variant: Variant, k: int) -> dict:
    """Bytes up/down per round of one method at K = k (steady state, averaged over a sync cycle)."""
    ms, dtype = enc.ms, enc.payload_dtype
    # one phase (bytes do not depend on the two-phase switch; LoRDO-Local's own switch would need the run's length)
    inner = InnerConfig(rank=ms.rank, proj_method=variant.proj_method, switch_fraction=0.0)
    settings = resolve_method(variant.method, inner, RoundConfig(local_steps=k, dense_sync_factor=variant.dense_sync_factor),
                              OuterConfig())
    lordo = settings.inner.name == "lordo"
    server_projections = lordo and settings.inner.projection == "global" and bool(ms.ranks)
    params = ms.params()
    metrics = {"train_loss": 3.0, "train_loss_last": 3.0, "lr": 1e-3}

    if settings.loop == "ddp":
        # A gradient all-reduce per step: one full gradient out, the averaged gradient back.
        grad = WorkerUpdate(worker_id=0, round=0, delta=params, moments={}, tokens=_TOKENS_PER_STEP,
                            opt_step=_HEADER_K, metrics={"loss": 3.0})
        n, tensor_n = enc.size("up", grad)
        up = down = float(n * k)
        tensors_up = tensors_down = float(tensor_n * k)
        cycle = 1
    else:
        rounds = settings.rounds
        cycle = _sync_period(rounds)
        up = down = tensors_up = tensors_down = 0.0
        projections = ms.projections(variant.proj_method) if server_projections else {}
        for t in range(cycle + 1, 2 * cycle + 1):  # steady state: round t-1 had its syncs
            state = GlobalState(round=t, params=params, projections=projections,
                                moments=ms.moments(rounds, t - 1, lordo), opt_step=(t - 1) * _HEADER_K)
            n, tensor_n = enc.size("down", state)
            down += n
            tensors_down += tensor_n
            update = WorkerUpdate(worker_id=0, round=t, delta=params, moments=ms.moments(rounds, t, lordo),
                                  tokens=_TOKENS_PER_STEP * _HEADER_K, opt_step=t * _HEADER_K, metrics=metrics)
            n, tensor_n = enc.size("up", update)
            up += n
            tensors_up += tensor_n
        up, down, tensors_up, tensors_down = (x / cycle for x in (up, down, tensors_up, tensors_down))

    formula_up, formula_down = formula_bytes(ms, variant, settings, k, dtype)
    return {
        "method": variant.method, "variant": variant.label, "proj_method": variant.proj_method if server_projections else None,
        "loop": settings.loop, "sync_exp_avg_every": settings.rounds.sync_exp_avg_every,
        "sync_exp_avg_sq_every": settings.rounds.sync_exp_avg_sq_every,
        "dense_sync_factor": settings.rounds.dense_sync_factor, "cycle_rounds": cycle,
        "up_bytes_per_round": up, "down_bytes_per_round": down,
        "up_bytes_per_step": up / k, "down_bytes_per_step": down / k,
        "total_bytes_per_step": (up + down) / k,
        "up_tensor_bytes_per_round": tensors_up, "down_tensor_bytes_per_round": tensors_down,
        "formula_up_bytes_per_round": formula_up, "formula_down_bytes_per_round": formula_down,
        "framing_overhead_fraction": (up + down) / (tensors_up + tensors_down) - 1.0,
    }


def formula_bytes(ms: ModelShapes, variant: Variant, settings, k: int, dtype: str) -> tuple[float, float]:
    """ALGORITHM.md's count of the tensors on the wire, per round (up, down), in bytes: written out
    independently of the messages as a check on them."""
    f = 2 if dtype == "bf16" else 4
    n = ms.num_params
    if settings.loop == "ddp":
        return float(k * n * f), float(k * n * f)
    lordo = settings.inner.name == "lordo"
    # moments averaged per round: each moment's floats / its period, low-rank and other parameters apart
    moments = sum(_moment_numel(ms, lordo, low_rank) * sum(1.0 / p for p in settings.rounds.periods(low_rank).values() if p)
                  for low_rank in (True, False))
    up = (n + moments) * f
    down = up
    if lordo and settings.inner.projection == "global":
        for name, r in ms.ranks.items():
            p, q = ms.shapes[name]
            # bases always travel in fp32 (lordo_fed.wire.encode: bf16 would break their orthonormality)
            down += 8 * r if variant.proj_method == "dct" else 4 * r * (q if projection_side((p, q)) == "right" else p)
    return float(up), float(down)


def table_reduction(ms: ModelShapes, k: int) -> dict[str, float]:
    """ALGORITHM.md's per-matrix table summed over the low-rank matrices only: DDP K·pq against
    LoRDO pq + 2pr (the table's rows), and the same with the model's other parameters (embedding,
    norms) added, which LoRDO-Global sends with full-size moments (Δ + u + v = 3 numel)."""
    lowrank_pq = sum(math.prod(ms.shapes[n]) for n in ms.ranks)
    lowrank_lordo = sum(math.prod(ms.shapes[n]) + 2 * math.prod(low_rank_shape(ms.shapes[n], r))
                        for n, r in ms.ranks.items())
    other = ms.num_params - lowrank_pq
    return {"lowrank_matrices_only": k * lowrank_pq / lowrank_lordo,
            "whole_model": k * ms.num_params / (lowrank_lordo + 3 * other)}


def run(presets: list[str], vocabs: list[int], ks: list[int], dtypes: list[str]) -> list[dict]:
    rows = []
    for preset in presets:
        for vocab in vocabs:
            ms = ModelShapes(preset, vocab, RANKS[preset])
            lowrank_share = sum(math.prod(ms.shapes[n]) for n in ms.ranks) / ms.num_params
            for dtype in dtypes:
                enc = Encoder(ms, dtype)
                for k in ks:
                    block = [measure_variant(enc, v, k) for v in VARIANTS]
                    ddp = next(r for r in block if r["method"] == "ddp")
                    table = table_reduction(ms, k)
                    for r in block:
                        r.update(preset=preset, vocab_size=vocab, rank=ms.rank, K=k, payload_dtype=dtype,
                                 num_params=ms.num_params, lowrank_param_share=lowrank_share,
                                 ratio_to_ddp=r["total_bytes_per_step"] / ddp["total_bytes_per_step"],
                                 up_ratio_to_ddp=r["up_bytes_per_step"] / ddp["up_bytes_per_step"],
                                 reduction_vs_ddp=ddp["total_bytes_per_step"] / r["total_bytes_per_step"])
                        if r["method"] == "lordo_global":
                            r["algorithm_table_reduction"] = table
                    rows.extend(block)
                print(f"  {preset} vocab {vocab} {dtype}: {enc.encoded} messages encoded in {enc.seconds:.1f} s",
                      flush=True)
                del enc
            del ms
            gc.collect()
    return rows


def check(rows: list[dict]) -> None:
    """Measured tensor bytes equal the analytic count; framing is a small overhead."""
    for r in rows:
        for side in ("up", "down"):
            measured, formula = r[f"{side}_tensor_bytes_per_round"], r[f"formula_{side}_bytes_per_round"]
            if not math.isclose(measured, formula, rel_tol=1e-12):
                raise AssertionError(f"{r['preset']}/{r['vocab_size']}/{r['variant']}/K={r['K']}/{r['payload_dtype']} "
                                     f"{side}: tensor bytes {measured} != formula {formula}")
        if not 0 <= r["framing_overhead_fraction"] < 0.01:
            raise AssertionError(f"{r['variant']}: framing overhead {r['framing_overhead_fraction']:.4f}")


def print_table(rows: list[dict]) -> None:
    print_rows(f"{'preset':6} {'vocab':>6} {'dtype':5} {'K':>4} {'method':20} {'up/round':>11} {'down/round':>11} "
               f"{'total/step':>11} {'vs DDP':>8} {'x less':>7}",
               (f"{r['preset']:6} {r['vocab_size']:>6} {r['payload_dtype']:5} {r['K']:>4} {r['variant']:20} "
                f"{human_bytes(r['up_bytes_per_round']):>11} {human_bytes(r['down_bytes_per_round']):>11} "
                f"{human_bytes(r['total_bytes_per_step']):>11} {r['ratio_to_ddp']:8.4f} {r['reduction_vs_ddp']:7.1f}"
                for r in rows))


def plot(rows: list[dict], out_png) -> None:
    """Grouped bars: bytes per step per worker (up + down) at each K, one bar per method, log
    scale, labelled with the reduction against DDP. fp32 when measured (bf16 halves every bar and
    leaves the ratios unchanged); one panel per (preset, vocabulary)."""
    panels = sorted({(r["preset"], r["vocab_size"]) for r in rows}, key=lambda pv: (RANKS[pv[0]], pv[1]))
    presets = sorted({p for p, _ in panels}, key=RANKS.get)
    vocabs = sorted({v for _, v in panels})
    dtype = "fp32" if any(r["payload_dtype"] == "fp32" for r in rows) else "bf16"
    ks = sorted({r["K"] for r in rows})
    fig = new_figure(max(5.5, 2.4 * len(ks)) * len(vocabs), 4.2 * len(presets))
    width = 0.8 / len(VARIANTS)
    for i, preset in enumerate(presets):
        for j, vocab in enumerate(vocabs):
            ax = fig.add_subplot(len(presets), len(vocabs), i * len(vocabs) + j + 1)
            sel = {(r["variant"], r["K"]): r for r in rows
                   if (r["preset"], r["vocab_size"], r["payload_dtype"]) == (preset, vocab, dtype)}
            if not sel:
                ax.set_visible(False)
                continue
            for m, variant in enumerate(VARIANTS):
                xs = [x + (m - (len(VARIANTS) - 1) / 2) * width for x in range(len(ks))]
                ys = [sel[(variant.label, k)]["total_bytes_per_step"] for k in ks]
                bars = ax.bar(xs, ys, width, color=f"C{m}", label=variant.label if i == 0 and j == 0 else None)
                for bar, k in zip(bars, ks):
                    red = sel[(variant.label, k)]["reduction_vs_ddp"]
                    ax.annotate(f"{red:.1f}x" if red < 99.5 else f"{red:.0f}x",
                                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=6, rotation=90, xytext=(0, 2),
                                textcoords="offset points")
            ax.set_yscale("log")
            ax.set_xticks(range(len(ks)), [f"K = {k}" for k in ks])
            ax.set_ylabel(f"bytes / step / worker, up + down ({dtype})")
            ax.margins(y=0.25)
            nparams = next(r["num_params"] for r in rows if (r["preset"], r["vocab_size"]) == (preset, vocab))
            ax.set_title(f"{preset}: vocab {vocab}, {nparams / 1e6:.1f}M params, r = {RANKS[preset]}", fontsize=9)
            ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle("Measured wire bytes (lordo_fed.wire.codec)\nlabels: x less than DDP; bf16 halves every bar (Global: all but its fp32 bases)", fontsize=8)
    ncol = len(VARIANTS) if len(vocabs) > 1 else 4
    bottom = 0.05 if ncol == len(VARIANTS) else 0.1
    fig.legend(loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 0.95))
    fig.savefig(out_png, format="png")


def main() -> None:
    parser = make_parser("communication", __doc__, "16m only, vocab 256, K = 32, fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)  # light on a shared machine; encoding is memory-bound anyway
    if args.quick:
        presets, vocabs, ks, dtypes = ["16m"], [BYTE_VOCAB], [32], ["fp32"]
    else:
        presets, vocabs, ks, dtypes = ["16m", "125m"], [BYTE_VOCAB, GPT2_VOCAB], [8, 32, 128], ["fp32", "bf16"]
    t0 = time.perf_counter()
    rows = run(presets, vocabs, ks, dtypes)
    check(rows)
    config = {"presets": presets, "vocab_sizes": vocabs, "K": ks, "payload_dtypes": dtypes,
              "ranks": {p: RANKS[p] for p in presets}, "variants": [v.label for v in VARIANTS],
              "header_values": {"opt_step_per_round": _HEADER_K, "tokens_per_step": _TOKENS_PER_STEP},
              "notes": ["sizes are len() of lordo_fed.wire.codec-encoded messages, per worker",
                        "ddp: a gradient each way per step (ring all-reduce moves ~2(M-1)/M of it each way)",
                        "round-based methods: steady state, averaged over one sync cycle (desloc: 6 rounds)",
                        "ratio_to_ddp = method / ddp total bytes per step, same preset, vocab and dtype"]}
    result = result_header("communication", args.quick, config)
    result["seconds"] = time.perf_counter() - t0
    result["rows"] = rows
    out = write_json(result, args.out)
    print_table(rows)
    plot(rows, png_path(out))
    print(f"written {out} and {png_path(out)}")


if __name__ == "__main__":
    main()
