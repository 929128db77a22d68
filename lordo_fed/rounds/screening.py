"""Screening: why a worker's reply must not be used, decided before anything is averaged.

The aggregator (lordo_fed.rounds.aggregator) applies only replies that pass these rules; a bad
reply is dropped with its reason, never applied. Two stages, so that a server can screen each
reply as it arrives and drop its tensors (the server's memory stays flat in the number of
replies M):

- per reply (`reply_problem`, `gradient_problem`, and `delta_norm` for the outlier rule): the
  round it answers, positive integer tokens, a finite floating Δ of every parameter in its shape,
  exactly the low-rank coordinates the payload sends (lordo_fed.wire.lowrank), the optimizer
  states due this round (lordo_fed.rounds.config.RoundConfig.due) each in its expected shape;
- per round over the collected verdicts (`screen_round`, `screen_gradient_round`): one reply per
  worker (partition), then the norm outliers against the round's median.

What passed is kept as a `ReplyRef`: the few numbers aggregation weights by, and a `load` that
reads the reply's tensors again when the aggregator gets to it (`Aggregator.aggregate_refs`).

Every function here is over the aggregator's expectations (θ's shapes, the ranks, the round, the
moment shapes, the coordinates the payload sends), logs nothing and changes nothing, so a caller
can report the reasons under its own client names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from lordo_fed.rounds.config import RoundConfig
from lordo_fed.wire.compress import SparseValues
from lordo_fed.wire.values import all_finite
from lordo_fed.wire.messages import WorkerUpdate, split_moment_key


@dataclass(frozen=True)
class ReplyRef:
    """A reply the server has screened but does not hold: what aggregation needs to know before
    reading its tensors, and how to read them.

    Holding M decoded replies makes the server's memory grow with M (each carries a full-size Δ);
    a ref keeps only these few numbers, so the aggregator can weight every reply up front (tokens,
    opt_step, which moments it carries) and then load the replies one at a time
    (`Aggregator.aggregate_refs`). `load` must return the same reply every time: a decode of a
    spooled payload (file, mmap) or, for replies already in memory, the update itself
    (`ReplyRef.of`).
    """

    worker_id: int
    round: int
    tokens: int
    opt_step: int
    moment_keys: frozenset[str]
    """The `moment_key`s of the states it carries (each averaged over the replies that carry it)."""
    load: Callable[[], WorkerUpdate] = field(repr=False, compare=False)
    """Decodes the full `WorkerUpdate` on demand; the caller drops it before loading the next."""
    metrics: dict[str, float] = field(default_factory=dict, compare=False)
    norm: float = field(default=math.nan, compare=False)
    """||Δ|| (`delta_norm`), for median clipping (`RoundConfig.clip_median`)."""
    relayed: Callable[[], WorkerUpdate] | None = field(default=None, repr=False, compare=False)
    """The reply as received, its compressed tensors still `Encoded` (a relaying payload sends it on,
    lordo_fed.rounds.relay); None: not kept."""

    @classmethod
    def of(cls, update: WorkerUpdate, load: Callable[[], WorkerUpdate] | None = None,
           norm: float = math.nan, relayed: Callable[[], WorkerUpdate] | None = None) -> "ReplyRef":
        """The ref of a decoded `update`. With `load` (e.g. a decode of the payload spooled to a
        file) the ref does not keep `update`, so the caller can drop its tensors; without, it
        loads from memory (the list path, `Aggregator.aggregate`). `norm`: its ||Δ|| as screening
        computed it (`Aggregator.check_reply`); median clipping needs it. `relayed`: the reply as
        received (a relaying payload)."""
        if load is None:
            def load() -> WorkerUpdate:
                return update
        return cls(worker_id=update.worker_id, round=update.round, tokens=update.tokens,
                   opt_step=update.opt_step, moment_keys=frozenset(update.moments), load=load,
                   metrics=dict(update.metrics), norm=norm, relayed=relayed)

    def matches(self, update: WorkerUpdate) -> str | None:
        """Why `update` (what `load` returned) is not the reply this ref describes, or None: the
        weights were fixed from the ref, so a loader returning another reply must not be averaged."""
        for name in ("worker_id", "round", "tokens", "opt_step"):
            if getattr(update, name) != getattr(self, name):
                return f"{name}={getattr(update, name)!r}, the ref says {getattr(self, name)!r}"
        if frozenset(update.moments) != self.moment_keys:
            return f"moment keys {sorted(update.moments)}, the ref says {sorted(self.moment_keys)}"
        return None


# --------------------------------------------------------------------------------- one reply
def tensor_problem(label: str, t: Tensor | SparseValues, shape: tuple[int, ...]) -> str | None:
    """Why `t` is not a finite floating tensor of `shape` (a reply screened on arrival), or None. A
    top-k tensor kept sparse (`SparseValues`, its positions checked by the decoder) is judged by its values."""
    if not isinstance(t, (Tensor, SparseValues)):
        return f"{label}: expected a tensor, got {type(t).__name__}"
    if tuple(t.shape) != shape:
        return f"{label}: shape {tuple(t.shape)}, expected {shape}"
    if isinstance(t, SparseValues):
        t = t.values
    if not t.is_floating_point():
        return f"{label}: dtype {t.dtype}, expected a floating-point tensor"
    if not all_finite(t):
        return f"{label}: contains NaN or Inf"
    return None


def norm_of(tensors: Iterable[Tensor | SparseValues]) -> float:
    """The L2 norm of `tensors` taken together, in fp32 per tensor (`torch.linalg.vector_norm`:
    one pass, no squared copy; a `SparseValues` by its values, each at its own position)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.values if isinstance(t, SparseValues) else t,
                                                        dtype=torch.float32)) ** 2 for t in tensors))


def delta_problem(update: WorkerUpdate, params: Mapping[str, Tensor]) -> str | None:
    """Why a reply's tokens and Δ are unusable against the global `params`, or None: positive
    integer tokens, a finite floating Δ of every parameter in its shape, no other name."""
    if isinstance(update.tokens, bool) or not isinstance(update.tokens, int) or update.tokens <= 0:
        return f"tokens={update.tokens!r}: expected a positive integer"
    missing, extra = set(params) - set(update.delta), set(update.delta) - set(params)
    if missing or extra:
        return f"pseudo-gradient names differ: missing {sorted(missing)}, unexpected {sorted(extra)}"
    for name, d in update.delta.items():
        problem = tensor_problem(f"delta/{name}", d, tuple(params[name].shape))
        if problem:
            return problem
    return None


def coords_problem(update: WorkerUpdate, expected: Sequence[str],
                   moment_shape: Callable[[str], tuple[int, ...]]) -> str | None:
    """Why a reply's low-rank coordinates are unusable: exactly the parameters `expected` (those
    with a shared basis under a `lowrank+` payload preset, lordo_fed.wire.lowrank), each finite
    and in its low-rank shape (the shape of its moments, `moment_shape`)."""
    missing, extra = set(expected) - set(update.coords), set(update.coords) - set(expected)
    if missing or extra:
        why = "" if expected else " (this run's payload sends no coordinates)"
        return f"low-rank coordinates differ: missing {sorted(missing)}, unexpected {sorted(extra)}{why}"
    for name, c in update.coords.items():
        problem = tensor_problem(f"coords/{name}", c, moment_shape(name))
        if problem:
            return problem
    return None


def reply_problem(update: WorkerUpdate, *, round_idx: int, params: Mapping[str, Tensor], ranks: Mapping[str, int],
                  rounds: RoundConfig, moment_shape: Callable[[str], tuple[int, ...]],
                  coords: Sequence[str]) -> str | None:
    """Why a round reply must not be applied, or None if it is well-formed: it answers round
    `round_idx`, its tokens and Δ pass `delta_problem`, its coordinates `coords_problem`, and it
    carries only the states due this round (`rounds.due`; E in θ's shape, the moments of a
    low-rank parameter in `moment_shape`)."""
    if update.round != round_idx:
        return f"reply is for round {update.round}, the server is at round {round_idx}"
    problem = delta_problem(update, params) or coords_problem(update, coords, moment_shape)
    if problem:
        return problem
    for key, value in update.moments.items():
        try:
            kind, name = split_moment_key(key)
        except ValueError as err:
            return str(err)
        due = rounds.due(round_idx, name in ranks)
        if kind not in due or name not in params:
            return f"unexpected moment {key!r} (due this round for {name!r}: {list(due)})"
        shape = tuple(params[name].shape) if kind == "ef" else moment_shape(name)
        problem = tensor_problem(key, value, shape)
        if problem:
            return problem
    return None


def gradient_problem(gradient: WorkerUpdate, params: Mapping[str, Tensor], ranks: Mapping[str, int]) -> str | None:
    """Why one round-0 gradient reply (the gradient at θ0 the round-1 projections are fitted to)
    must not be used, or None: round 0, the low-rank parameters' names, shapes, dtypes and finite
    values, tokens."""
    if gradient.round != 0 or set(gradient.delta) != set(ranks) or gradient.tokens <= 0:
        return f"not a gradient reply for round 0 over the low-rank parameters (round {gradient.round})"
    for name, t in gradient.delta.items():
        problem = tensor_problem(f"grad/{name}", t, tuple(params[name].shape))
        if problem:
            return problem
    return None


def delta_norm(update: WorkerUpdate) -> float:
    """||Δ|| of a reply over all its parameters: what the outlier rule compares (with low-rank
    coordinates, ||C||² counts for ||P·C||², the basis being orthonormal)."""
    return norm_of(d for group in (update.delta, update.coords) for d in group.values())


# --------------------------------------------------------------------------------- one round
def screen_round(worker_ids: Sequence[int], norms: Sequence[float], reasons: Sequence[str | None],
                 outlier_factor: float) -> list[str | None]:
    """The round's rules over the per-reply verdicts (in arrival order, which decides which of
    two replies for one partition is kept): a second well-formed reply for a worker already
    answered is refused, then, among the rest, the norm outliers (`refuse_outliers`). Returns the
    final reasons (None: usable)."""
    reasons = list(reasons)
    refuse_repeated_workers(worker_ids, reasons)
    refuse_outliers(norms, reasons, outlier_factor)
    return reasons


def screen_gradient_round(worker_ids: Sequence[int], reasons: Sequence[str | None]) -> list[str | None]:
    """`screen_round` for round 0 over the verdicts of `gradient_problem`: one reply per worker
    (no outlier rule: gradients at θ0 are not pseudo-gradients of a round)."""
    reasons = list(reasons)
    refuse_repeated_workers(worker_ids, reasons)
    return reasons


def refuse_repeated_workers(worker_ids: Sequence[int], reasons: list[str | None]) -> None:
    """Give a reason to every usable reply after the first from the same worker (partition).

    Each partition's shard counts once per round; a second reply for it (two nodes started with
    the same partition-id, or a replayed message) would weight that shard twice. The first one
    given is kept, so a caller that orders replies reproducibly keeps the same one every time."""
    seen: set[int] = set()
    for i, worker_id in enumerate(worker_ids):
        if reasons[i] is not None:
            continue
        if worker_id in seen:
            reasons[i] = (f"worker (partition) {worker_id} already answered this round; a second reply for "
                          "it is refused (two nodes with the same partition-id?)")
        seen.add(worker_id)


def refuse_outliers(norms: Sequence[float], reasons: list[str | None], factor: float) -> None:
    """Give a reason to every still-usable reply whose ||Δ|| exceeds `factor` x the median over the
    still-usable replies (0 disables; needs at least 3 of them to have a meaningful median)."""
    ok = [i for i, r in enumerate(reasons) if r is None]
    if factor <= 0 or len(ok) < 3:
        return
    median = round_median([norms[i] for i in ok])
    for i in ok:
        if median > 0 and norms[i] > factor * median:
            reasons[i] = (f"pseudo-gradient norm {norms[i]:.4g} > outlier_factor {factor:g} x round median "
                          f"{median:.4g}")


def round_median(norms: Sequence[float]) -> float:
    """The round's median ||Δ|| over usable replies, as the outlier rule and median clipping
    (`RoundConfig.clip_median`) take it: the upper middle value of an even count."""
    return sorted(norms)[len(norms) // 2]


def clip_factors(norms: Sequence[float], round_idx: int) -> list[float]:
    """Median clipping (`RoundConfig.clip_median`): each reply's factor min(1, m / ||Δ_m||), m the
    `round_median` of the usable replies' norms, so that no reply's Δ counts with more than m."""
    if any(not math.isfinite(n) for n in norms):
        raise ValueError(f"round {round_idx}: median clipping needs every reply's ||Δ||, got {list(norms)}; build "
                         "the refs with ReplyRef.of(update, norm=...) from check_reply")
    median = round_median(norms)
    return [1.0 if n <= median else median / n for n in norms]


def check_refs(refs: Sequence[ReplyRef], round_idx: int) -> None:
    """Refuse refs that cannot have passed screening (a caller's mistake, not a bad client): more
    than one per worker, or one for another round than `round_idx`. Raises ValueError."""
    ids = [r.worker_id for r in refs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"round {round_idx}: more than one ref per worker {ids}; screen the replies before "
                         "aggregating them")
    stale = [r.worker_id for r in refs if r.round != round_idx]
    if stale:
        raise ValueError(f"round {round_idx}: refs of workers {stale} are for another round; screen the replies "
                         "before aggregating them")
