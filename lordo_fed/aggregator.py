"""The aggregator: check, weight by tokens, average, apply the outer update, refresh projections.

One round on the server side (shared/docs/ALGORITHM.md, "One round", step 3):
    Δ̄ = Σ_m (n_m / Σ n) Δ_m                token-weighted average of the pseudo-gradients
    θ ← outer(θ, Δ̄)                         average / QHM / Nesterov (lordo_fed.outer)
    u, v averaged the same way when due      (DES-LOC periods, lordo_fed.rounds.RoundConfig)
    P ← top-r subspace of Δ̄ per low-rank W  (LoRDO-Global) and the averaged moments rotated
                                             into it with LDAdam's rule
Plain tensors in and out: the Flower strategy wraps this object unchanged, and the reference
trainer calls it directly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from lordo_fed.metrics import stable_rank
from lordo_fed.optim.bias import restep
from lordo_fed.optim.rotation import rotate_moments
from lordo_fed.outer import OuterOptimizer
from lordo_fed.projection import ProjectionMethod, project, projection_side
from lordo_fed.rounds import (DIAGNOSTIC_METRICS, MOMENT_KEYS, GlobalState, RoundConfig, WorkerUpdate, moment_key,
                              split_moment_key)

log = logging.getLogger(__name__)



@dataclass
class RoundResult:
    """The next global state plus what happened to each reply."""

    state: GlobalState
    accepted: list[int]
    rejected: dict[int, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def low_rank_shape(shape: tuple[int, int], rank: int) -> tuple[int, int]:
    """Shape of a low-rank moment of a p×q weight (GaLore's side rule)."""
    p, q = shape
    return (p, rank) if projection_side(shape) == "right" else (rank, q)


def fit_projections(deltas: dict[str, Tensor], ranks: dict[str, int], method: ProjectionMethod,
                    seed: int) -> dict[str, Tensor]:
    """Stored-form projections fitted to each low-rank parameter's pseudo-gradient."""
    return {
        name: method.fit(deltas[name], rank, projection_side(deltas[name].shape), seed=seed + i)
        for i, (name, rank) in enumerate(sorted(ranks.items()))
    }


def initial_projections(shapes: dict[str, tuple[int, int]], ranks: dict[str, int], method: ProjectionMethod,
                        seed: int) -> dict[str, Tensor]:
    """The projections of round 1, before any pseudo-gradient exists (seeded, same everywhere)."""
    return {
        name: method.initial(shapes[name], rank, projection_side(shapes[name]), seed=seed + i)
        for i, (name, rank) in enumerate(sorted(ranks.items()))
    }


class Aggregator:
    """Server side of a LoRDO round.

    Args:
        params: initial global θ by name (copied, kept fp32).
        ranks: low-rank parameter name -> rank (only parameters with rank < min(p, q)).
        rounds: local steps and DES-LOC sync periods.
        outer: the outer optimizer applied to θ with Δ̄.
        projection: the projection method when the server owns projections (LoRDO-Global),
            None when workers fit their own (LoRDO-Local) or there are none (AdamW baselines).
        seed: seeds the initial projections and randomized fits.
        outlier_factor: reject a reply whose ||Δ|| exceeds this multiple of the round's median
            (0 disables; needs at least 3 replies to have a meaningful median).
        betas, bias_correction: the inner optimizer's, needed to rotate the second moment and to
            move moments between step counts.
        switch_step, switch_betas: the two-phase recipe's (InnerConfig): the betas in force from
            global step `switch_step` on (0 = one phase).
        rotate: rotate the averaged moments into each new basis (the inner optimizer's `rotate`).
        init_projection: 'random' (seeded basis for round 1) or 'gradient' (round 1 waits for
            `init_projections` with the workers' gradients at θ0).
        diagnostics: also report, per round, the mean stable rank of Δ̄ over the low-rank
            matrices and the share of ||Δ̄||² inside the round's shared subspace (an SVD per
            matrix: the paper's stagnation diagnostic, off by default).
    """

    def __init__(self, params: dict[str, Tensor], ranks: dict[str, int], rounds: RoundConfig,
                 outer: OuterOptimizer, projection: ProjectionMethod | None, seed: int = 0,
                 outlier_factor: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 bias_correction: bool = True, rotate: bool = True, init_projection: str = "random",
                 diagnostics: bool = False, switch_step: int = 0,
                 switch_betas: tuple[float, float] = (0.999, 0.999)):
        self.params = {n: p.detach().float().clone() for n, p in params.items()}
        self.ranks = dict(ranks)
        self.rounds = rounds
        self.outer = outer
        self.projection = projection
        self.seed = seed
        self.outlier_factor = outlier_factor
        self.betas = tuple(betas)
        self.switch_step = switch_step
        self.switch_betas = tuple(switch_betas)
        self.bias_correction = bias_correction
        self.rotate = rotate
        self.diagnostics = diagnostics
        self.round = 1
        self.opt_step = 0
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.projections: dict[str, Tensor] = (
            initial_projections(shapes, self.ranks, projection, seed)
            if projection is not None and init_projection == "random" else {}
        )
        self.moments: dict[str, Tensor] = {}

    # ----------------------------------------------------------------------------- state out
    def global_state(self) -> GlobalState:
        """What every worker is sent for the current round."""
        return GlobalState(round=self.round, params=self.params, projections=self.projections,
                           moments=self.moments, opt_step=self.opt_step)

    @property
    def needs_gradient_init(self) -> bool:
        """LoRDO-Global with init_projection='gradient', before round 1's projections exist."""
        return self.projection is not None and bool(self.ranks) and not self.projections

    def gradient_request(self) -> GlobalState:
        """What workers get to compute the gradient the round-1 projections are fitted to."""
        return GlobalState(round=0, params=self.params)

    def screen_gradients(self, gradients: Sequence[WorkerUpdate]) -> list[str | None]:
        """Why each round-0 gradient reply must not be used (None: usable), in the order given:
        round 0, the low-rank parameters' names, shapes, dtypes and finite values, tokens, one
        reply per worker. Logs nothing and changes nothing (as `screen()` for round replies)."""
        reasons: list[str | None] = []
        for g in gradients:
            reason = None
            if g.round != 0 or set(g.delta) != set(self.ranks) or g.tokens <= 0:
                reason = f"not a gradient reply for round 0 over the low-rank parameters (round {g.round})"
            else:
                for name, t in g.delta.items():
                    reason = reason or _tensor_problem(f"grad/{name}", t, tuple(self.params[name].shape))
            reasons.append(reason)
        _refuse_repeated_workers(gradients, reasons)
        return reasons

    @torch.no_grad()
    def init_projections(self, gradients: Sequence[WorkerUpdate], screened: bool = False) -> RoundResult:
        """Round-1 projections: top-r subspaces of the token-weighted mean gradient at θ0 (the
        full-batch gradient GaLore starts from). Each reply carries `delta` = its gradient of the
        low-rank parameters, round 0. `screened=True`: the caller already dropped what
        `screen_gradients()` refuses."""
        rejected: dict[int, str] = {}
        good = []
        reasons = [None] * len(gradients) if screened else self.screen_gradients(gradients)
        for g, reason in zip(gradients, reasons):
            if reason:
                rejected[g.worker_id] = reason
                log.warning("initial projections: dropped gradient of worker %s: %s", g.worker_id, reason)
            else:
                good.append(g)
        if not good:
            raise RuntimeError(f"initial projections: no usable gradient ({rejected})")
        total = sum(g.tokens for g in good)
        weights = [g.tokens / total for g in good]
        mean = {n: _weighted_sum([g.delta[n] for g in good], weights) for n in self.ranks}
        self.projections = fit_projections(mean, self.ranks, self.projection, self.seed)
        return RoundResult(self.global_state(), [g.worker_id for g in good], rejected, {})

    def expected_moment_shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self.params[name].shape)
        return low_rank_shape(shape, self.ranks[name]) if name in self.ranks else shape

    # ----------------------------------------------------------------------------- checks
    def check(self, update: WorkerUpdate) -> str | None:
        """Why `update` must not be applied, or None if it is well-formed."""
        if update.round != self.round:
            return f"reply is for round {update.round}, the server is at round {self.round}"
        if not (isinstance(update.tokens, int) and update.tokens > 0):
            return f"tokens={update.tokens!r}: expected a positive integer"
        missing, extra = set(self.params) - set(update.delta), set(update.delta) - set(self.params)
        if missing or extra:
            return f"pseudo-gradient names differ: missing {sorted(missing)}, unexpected {sorted(extra)}"
        for name, d in update.delta.items():
            problem = _tensor_problem(f"delta/{name}", d, tuple(self.params[name].shape))
            if problem:
                return problem
        for key, value in update.moments.items():
            try:
                kind, name = split_moment_key(key)
            except ValueError as err:
                return str(err)
            due = self.rounds.due(self.round, name in self.ranks)
            if kind not in due or name not in self.params:
                return f"unexpected moment {key!r} (due this round for {name!r}: {list(due)})"
            shape = tuple(self.params[name].shape) if kind == "ef" else self.expected_moment_shape(name)
            problem = _tensor_problem(key, value, shape)
            if problem:
                return problem
        return None

    # ----------------------------------------------------------------------------- the round
    def screen(self, updates: Sequence[WorkerUpdate]) -> list[str | None]:
        """Why each update must not be applied (None: usable), in the order given: `check()`,
        then a second well-formed reply for a worker already answered, then, among the rest, the
        norm outliers (`outlier_factor`). Logs nothing and changes nothing, so a caller can report
        the reasons under its own client names."""
        reasons: list[str | None] = [self.check(u) for u in updates]
        _refuse_repeated_workers(updates, reasons)
        ok = [i for i, r in enumerate(reasons) if r is None]
        for k, reason in self._outliers([updates[i] for i in ok]).items():
            reasons[ok[k]] = reason
        return reasons

    @torch.no_grad()
    def aggregate(self, updates: Sequence[WorkerUpdate], screened: bool = False) -> RoundResult:
        """Apply one round of replies; bad replies are logged and dropped, never applied.

        `screened=True`: the caller already dropped what `screen()` refuses (the checks are not
        run a second time)."""
        rejected: dict[int, str] = {}
        good: list[WorkerUpdate] = []
        for u, reason in zip(updates, [None] * len(updates) if screened else self.screen(updates)):
            if reason is None:
                good.append(u)
            else:
                rejected[u.worker_id] = reason
                log.warning("round %d: dropped reply of worker %s: %s", self.round, u.worker_id, reason)
        if not good:
            log.warning("round %d: no usable reply; global state unchanged", self.round)
            return RoundResult(self.global_state(), [], rejected, {})

        total = sum(u.tokens for u in good)
        weights = [u.tokens / total for u in good]
        delta = {n: _weighted_sum([u.delta[n] for u in good], weights) for n in self.params}
        self.outer.step(self.params, delta)

        diagnostics = self._diagnostics(delta) if self.diagnostics else {}
        self.opt_step = max(u.opt_step for u in good)
        moments = self._average_moments(good, weights)
        if self.projection is not None:
            new = fit_projections(delta, self.ranks, self.projection, self.seed + 7919 * self.round)
            if self.rotate:
                moments = self._rotate(moments, self.projections, new)
            self.projections = new
        self.moments = moments

        metrics = {
            "train_loss": sum(w * u.metrics.get("train_loss", math.nan) for u, w in zip(good, weights)),
            "tokens": float(total),
            "delta_norm": math.sqrt(sum(float(d.float().square().sum()) for d in delta.values())),
            "clients_ok": float(len(good)),
            "clients_dropped": float(len(rejected)),
            **diagnostics,
            **{key: sum(w * u.metrics[key] for u, w in zip(good, weights)) for key in DIAGNOSTIC_METRICS
               if all(key in u.metrics for u in good)},
        }
        self.round += 1
        return RoundResult(self.global_state(), [u.worker_id for u in good], rejected, metrics)

    def _diagnostics(self, delta: dict[str, Tensor]) -> dict[str, float]:
        """Mean stable rank of Δ̄ over the low-rank matrices and, when the server owns the
        projections, the share of ||Δ̄||² that lies in this round's shared subspace.

        Without the QH term (ω = 1) every low-rank update is P·(something), so the share tends to
        1 and the refit P' = top-r(Δ̄) spans the same subspace: LoRDO's stagnation pathology.
        """
        if not self.ranks:
            return {}
        out = {"delta_stable_rank": sum(stable_rank(delta[n]) for n in self.ranks) / len(self.ranks)}
        if self.projection is not None and self.projections:
            inside = total = 0.0
            for n in self.ranks:
                shape = tuple(self.params[n].shape)
                side = projection_side(shape)
                basis = self.projection.basis(self.projections[n], shape, side).float()
                d = delta[n].float()
                inside += float(project(d, basis, side).square().sum())
                total += float(d.square().sum())
            out["delta_in_subspace"] = inside / total if total > 0 else 0.0
        return out

    def round_betas(self) -> tuple[float, float]:
        """The inner betas at the last local step of the current round (the two-phase recipe)."""
        last_step = self.round * self.rounds.local_steps - 1
        return self.switch_betas if 0 < self.switch_step <= last_step else self.betas

    def _outliers(self, good: Sequence[WorkerUpdate]) -> dict[int, str]:
        """Index in `good` -> reason, for replies whose ||Δ|| exceeds outlier_factor x the median."""
        if self.outlier_factor <= 0 or len(good) < 3:
            return {}
        norms = [math.sqrt(sum(float(d.square().sum()) for d in u.delta.values())) for u in good]
        median = sorted(norms)[len(norms) // 2]
        return {i: f"pseudo-gradient norm {n:.4g} > outlier_factor {self.outlier_factor:g} x round median {median:.4g}"
                for i, n in enumerate(norms) if median > 0 and n > self.outlier_factor * median}

    def _average_moments(self, good: list[WorkerUpdate], weights: list[float]) -> dict[str, Tensor]:
        """Token-weighted mean of each due moment over the replies that carry it, each reply's
        moments first moved from its own step count to the shared one, `self.opt_step` (the
        largest: a worker that joined late or lost its state has fewer steps; rescaling keeps
        its bias-corrected moments, `lordo_fed.optim.bias`)."""
        out = {}
        for key in sorted({k for u in good for k in u.moments}):
            kind = split_moment_key(key)[0]
            have = [(u.moments[key] if kind == "ef" else
                     restep(u.moments[key], kind, u.opt_step, self.opt_step, self.round_betas(), self.bias_correction), w)
                    for u, w in zip(good, weights) if key in u.moments]
            norm = sum(w for _, w in have)
            out[key] = _weighted_sum([t for t, _ in have], [w / norm for _, w in have])
        return out

    def _rotate(self, moments: dict[str, Tensor], old: dict[str, Tensor], new: dict[str, Tensor]) -> dict[str, Tensor]:
        """Move averaged low-rank moments from the old shared basis into the new one."""
        out = dict(moments)
        for name in self.ranks:
            u_key, v_key = (moment_key(k, name) for k in MOMENT_KEYS)
            if u_key not in moments and v_key not in moments:
                continue
            side = projection_side(self.params[name].shape)
            shape = tuple(self.params[name].shape)
            old_b = self.projection.basis(old[name], shape, side)
            new_b = self.projection.basis(new[name], shape, side)
            u, v = rotate_moments(moments.get(u_key), moments.get(v_key), old_b, new_b, side, self.opt_step,
                                  self.round_betas(), self.bias_correction)
            if u is not None:
                out[u_key] = u
            if v is not None:
                out[v_key] = v
        return out

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Tensor]:
        """Everything needed to resume: θ, outer state, projections, moments, counters (flat tensors)."""
        sd = {f"param/{k}": v for k, v in self.params.items()}
        sd.update({f"outer/{k}": v for k, v in self.outer.state_dict().items()})
        sd.update({f"proj/{k}": v for k, v in self.projections.items()})
        sd.update({f"moment/{k}": v for k, v in self.moments.items()})
        sd["counter/round"] = torch.tensor(self.round)
        sd["counter/opt_step"] = torch.tensor(self.opt_step)
        return sd

    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        def part(prefix: str) -> dict[str, Tensor]:
            return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}

        params = part("param/")
        if set(params) != set(self.params):
            raise ValueError(f"checkpoint parameters differ from the model: missing "
                             f"{sorted(set(self.params) - set(params))}, unexpected {sorted(set(params) - set(self.params))}")
        for n, p in params.items():
            if tuple(p.shape) != tuple(self.params[n].shape):
                raise ValueError(f"checkpoint parameter {n} has shape {tuple(p.shape)}, model has {tuple(self.params[n].shape)}")
        self.params = {n: p.float().clone() for n, p in params.items()}
        self.outer.load_state_dict(part("outer/"))
        self.projections = {k: v.clone() for k, v in part("proj/").items()}
        self.moments = {k: v.clone() for k, v in part("moment/").items()}
        self.round = int(sd["counter/round"])
        self.opt_step = int(sd["counter/opt_step"])


def _weighted_sum(tensors: list[Tensor], weights: list[float]) -> Tensor:
    acc = torch.zeros_like(tensors[0], dtype=torch.float32)
    for t, w in zip(tensors, weights):
        acc.add_(t.float(), alpha=w)
    return acc


def _refuse_repeated_workers(updates: Sequence[WorkerUpdate], reasons: list[str | None]) -> None:
    """Give a reason to every usable reply after the first from the same worker (partition).

    Each partition's shard counts once per round; a second reply for it (two nodes started with
    the same partition-id, or a replayed message) would weight that shard twice. The first one
    given is kept, so a caller that orders replies reproducibly keeps the same one every time."""
    seen: set[int] = set()
    for i, u in enumerate(updates):
        if reasons[i] is not None:
            continue
        if u.worker_id in seen:
            reasons[i] = (f"worker (partition) {u.worker_id} already answered this round; a second reply for "
                          "it is refused (two nodes with the same partition-id?)")
        seen.add(u.worker_id)


def _tensor_problem(label: str, t: Tensor, shape: tuple[int, ...]) -> str | None:
    if not isinstance(t, Tensor):
        return f"{label}: expected a tensor, got {type(t).__name__}"
    if tuple(t.shape) != shape:
        return f"{label}: shape {tuple(t.shape)}, expected {shape}"
    if not t.is_floating_point():
        return f"{label}: dtype {t.dtype}, expected a floating-point tensor"
    if not torch.isfinite(t).all():
        return f"{label}: contains NaN or Inf"
    return None
