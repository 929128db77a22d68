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
from lordo_fed.outer import MomentumLookAhead, OuterOptimizer


@dataclass
class AsyncConfig:
    """Asynchronous rounds: worker speeds on the virtual clock, the staleness bound, HeLoCo."""

    speeds: List[float] = field(default_factory=list)
    """Virtual seconds per local step of each worker ([] = 1.0 for all); e.g. [1, 1, 1, 4]: one 4x slower."""
    weight: float = 1.0
    """ρ: every arriving Δ is scaled by it before its outer step (HeLoCo's; the paper suggests 1/√K for K workers)."""
    max_staleness: int = 0
    """Drop a reply made from a model more than this many outer steps old (0 = no bound, as HeLoCo's code)."""
    heloco: HeLoCoConfig = field(default_factory=HeLoCoConfig)
    """HeLoCo's correction settings (method `heloco`)."""

    def validate(self, workers: int) -> "AsyncConfig":
        if self.speeds and len(self.speeds) != workers:
            raise ValueError(f"async_rounds.speeds={list(self.speeds)!r}: expected {workers} values (one per worker) "
                             "or [] (all 1.0)")
        for s in self.speeds:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"async_rounds.speeds={list(self.speeds)!r}: expected virtual seconds per step > 0")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not (
                math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"async_rounds.weight={self.weight!r}: expected a weight > 0")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"async_rounds.max_staleness={self.max_staleness!r}: expected an integer >= 0 "
                             "(0 = no bound)")
        self.heloco.validate()
        return self

    def speed_of(self, worker: int) -> float:
        return float(self.speeds[worker]) if self.speeds else 1.0


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
