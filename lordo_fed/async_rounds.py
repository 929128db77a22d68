"""Asynchronous rounds: each worker's pseudo-gradient is applied as it arrives (async DiLoCo,
momentum look-ahead, HeLoCo), and a virtual clock that makes the schedule reproducible.

In a synchronous round every worker waits for the slowest. Here a worker pulls the global model,
trains its K local steps and pushes Δ = θ_pulled − θ_K; the server applies that Δ at once with
one outer step (on θ, not on the point the worker pulled) and the worker pulls again. A reply
computed from a model `s` outer steps old has staleness s. The three server rules
(`AsyncRule`):

- async DiLoCo: G = ρΔ, the outer optimizer as configured (DiLoCo's Nesterov), workers pull θ;
- look-ahead: G = ρΔ, momentum look-ahead steps (`outer=mla`), workers pull θ̄ = θ − ημm;
- HeLoCo: as look-ahead, with Δ corrected against the momentum first (lordo_fed.heloco; Al Asif
  et al., arXiv 2606.00271).

ρ (`AsyncConfig.weight`) is HeLoCo's arrival weight, applied to every method alike: one outer
step per arrival moves θ M times per "round" where a synchronous round moves it once with the
mean of M pseudo-gradients, so unweighted arrivals at DiLoCo's outer lr overshoot (the paper
suggests ρ = 1/√K for K concurrent workers).

`VirtualClock` orders arrivals deterministically: worker w takes K · speeds[w] virtual seconds
per round, arrivals are processed in (virtual time, worker id) order. The reference trainer
uses it (`lordo_fed.trainer.run.run_async`) so that a Flower run on the same schedule can be
compared with it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import List

import torch
from torch import Tensor

from lordo_fed.heloco import HeLoCoConfig, correct, look_ahead
from lordo_fed.rounds import WorkerUpdate
from lordo_fed.outer import MomentumLookAhead, OuterOptimizer
from lordo_fed.aggregator import delta_problem


ASYNC_ORDERS = ("arrival", "virtual")


@dataclass
class AsyncConfig:
    """Asynchronous rounds: worker speeds on the virtual clock, per-worker local steps, the
    staleness bound, the order a Flower server applies replies in, HeLoCo."""

    speeds: List[float] = field(default_factory=list)
    """Virtual seconds per local step of each worker ([] = 1.0 for all); e.g. [1, 1, 1, 4]: one 4x slower."""
    local_steps: List[int] = field(default_factory=list)
    """Local steps per round of each worker ([] = rounds.local_steps for all): per-node work, GradSkip's idea."""
    weight: float = 1.0
    """ρ: every arriving Δ is scaled by it before its outer step (HeLoCo's; the paper suggests 1/√K for K workers)."""
    max_staleness: int = 0
    """Drop a reply made from a model more than this many outer steps old (0 = no bound, as HeLoCo's code)."""
    order: str = "arrival"
    """Flower server: apply replies as they arrive, or in the virtual clock's order ('virtual': reproducible, the reference trainer's)."""
    heloco: HeLoCoConfig = field(default_factory=HeLoCoConfig)
    """HeLoCo's correction settings (method `heloco`)."""

    def validate(self, workers: int | None = None) -> "AsyncConfig":
        """`workers`: how many there are (the reference trainer), or None where that is known
        only at run time (a Flower server: `check_workers` then)."""
        for s in self.speeds:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"async_rounds.speeds={list(self.speeds)!r}: expected virtual seconds per step > 0")
        for k in self.local_steps:
            if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
                raise ValueError(f"async_rounds.local_steps={list(self.local_steps)!r}: expected integers > 0 "
                                 "(local steps per round of each worker)")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not (
                math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"async_rounds.weight={self.weight!r}: expected a weight > 0")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"async_rounds.max_staleness={self.max_staleness!r}: expected an integer >= 0 "
                             "(0 = no bound)")
        if self.order not in ASYNC_ORDERS:
            raise ValueError(f"async_rounds.order={self.order!r}: expected one of {ASYNC_ORDERS}")
        self.heloco.validate()
        if workers is not None:
            self.check_workers(range(workers))
        return self

    def check_workers(self, workers) -> None:
        """Every worker id in `workers` has a speed and a local-step count (or the lists are empty)."""
        workers = list(workers)
        for name in ("speeds", "local_steps"):
            values = getattr(self, name)
            if values and len(values) != max(workers, default=-1) + 1:
                raise ValueError(f"async_rounds.{name}={list(values)!r}: expected {max(workers, default=-1) + 1} "
                                 f"values, one per worker (partition ids {sorted(workers)}), or [] for the default")

    def speed_of(self, worker: int) -> float:
        return float(self.speeds[worker]) if self.speeds else 1.0

    def local_steps_of(self, worker: int, default: int) -> int:
        """K of `worker`: its own entry of `local_steps`, or the run's K."""
        return int(self.local_steps[worker]) if self.local_steps else default

    def seconds(self, worker: int, default_steps: int) -> float:
        """Virtual seconds `worker` takes for one round: its local steps x its speed."""
        return self.local_steps_of(worker, default_steps) * self.speed_of(worker)


@dataclass(frozen=True)
class AsyncRule:
    """What the server does with an arrival (module docstring)."""

    look_ahead: bool
    """Workers pull θ̄ = θ − ημm instead of θ (needs the momentum look-ahead outer step)."""
    correct: bool
    """Correct Δ against the outer momentum and weight it by ρ (HeLoCo)."""


class VirtualClock:
    """Arrivals in (virtual time, worker id) order: `start(w, t, seconds)` schedules worker w's
    push `seconds` after t; `next()` pops the earliest one as (time, worker)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def start(self, worker: int, now: float, seconds: float) -> None:
        heapq.heappush(self._heap, (now + seconds, worker))

    def next(self) -> tuple[float, int]:
        return heapq.heappop(self._heap)

    def peek(self) -> tuple[float, int] | None:
        """The earliest arrival without taking it (None when nothing is scheduled)."""
        return self._heap[0] if self._heap else None

    def remove(self, worker: int) -> float | None:
        """Take worker's scheduled arrival out of the clock (it was applied out of order, or failed);
        returns its time, or None if it had none."""
        for i, (t, w) in enumerate(self._heap):
            if w == worker:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return t
        return None

    def __len__(self) -> int:
        return len(self._heap)


@dataclass
class Arrival:
    """One processed push: who, when, from how old a model, and whether it was applied."""

    worker: int
    time: float
    staleness: int
    applied: bool
    reason: str = ""


class AsyncServer:
    """The global model under asynchronous pushes: θ (fp32), the outer optimizer, a version
    counter (outer steps applied), and the rule. Flower-free; the reference trainer drives it."""

    def __init__(self, params: dict[str, Tensor], outer: OuterOptimizer, rule: AsyncRule, cfg: AsyncConfig):
        if rule.look_ahead and not isinstance(outer, MomentumLookAhead):
            raise ValueError(f"look-ahead pulls need the momentum look-ahead outer step (outer name 'mla'), not "
                             f"{outer.name!r}")
        self.params = params
        self.outer, self.rule, self.cfg = outer, rule, cfg
        self.version = 0
        """Outer steps applied so far."""

    def _momentum(self) -> dict[str, Tensor] | None:
        return self.outer.momentum_buffers() if isinstance(self.outer, MomentumLookAhead) else None

    def pull(self) -> tuple[dict[str, Tensor], int]:
        """(the model a worker starts from: θ̄ or θ, as copies; the version it is)."""
        if self.rule.look_ahead:
            outer = self.outer
            return look_ahead(self.params, self._momentum(), outer.lr, outer.momentum), self.version
        return {n: p.clone() for n, p in self.params.items()}, self.version

    def check(self, update: WorkerUpdate, worker: int, round_idx: int) -> str | None:
        """Why a reply must not be applied, or None: it must be the round `round_idx` of `worker`
        it answers, carry positive tokens and a finite Δ of every parameter in its shape, and no
        optimizer states (asynchronous methods average none)."""
        if update.worker_id != worker or update.round != round_idx:
            return (f"reply is for partition {update.worker_id} round {update.round}, the server sent partition "
                    f"{worker} round {round_idx}")
        problem = delta_problem(update, self.params)
        if problem:
            return problem
        if update.moments:
            return f"unexpected optimizer states {sorted(update.moments)[:3]}: asynchronous methods average none"
        return None

    def push(self, delta: dict[str, Tensor], pulled_version: int, worker: int, time: float) -> Arrival:
        """Apply one worker's Δ (or drop it past the staleness bound); one outer step."""
        staleness = self.version - pulled_version
        bound = self.cfg.max_staleness
        if bound and staleness > bound:
            return Arrival(worker, time, staleness, False, f"staleness {staleness} > max_staleness {bound}")
        rho = self.cfg.weight
        if self.rule.correct:
            g = correct(delta, self._momentum(), self.cfg.heloco, rho)
        else:
            g = delta if rho == 1.0 else {n: d * rho for n, d in delta.items()}
        with torch.no_grad():
            self.outer.step(self.params, g)
        self.version += 1
        return Arrival(worker, time, staleness, True)


def async_record(window: list[tuple[Arrival, float | None]], workers: int, round_idx: int, tokens: int, step: int,
                 virtual_time: float, pushes: int, outer_steps: int) -> dict:
    """The record of the pushes since the last one (`window`: each arrival with its train loss),
    as the reference trainer and the Flower server both write it: mean train loss, the
    staleness histogram, pushes per worker, replies dropped."""
    staleness = [a.staleness for a, _ in window]
    losses = [loss for a, loss in window if loss is not None and a.applied]
    return {
        "round": round_idx, "step": step, "tokens": tokens,
        "train_loss": sum(losses) / len(losses) if losses else None, "virtual_time": virtual_time, "pushes": pushes,
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
        "staleness": {str(s): staleness.count(s) for s in sorted(set(staleness))},
        "pushes_by_worker": [sum(a.worker == m for a, _ in window) for m in range(workers)],
        "dropped": sum(not a.applied for a, _ in window), "outer_steps": outer_steps,
    }
