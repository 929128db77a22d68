"""Asynchronous rounds: each worker's pseudo-gradient is applied as it arrives (async DiLoCo,
momentum look-ahead, HeLoCo), and a virtual clock that makes the schedule reproducible.

In a synchronous round every worker waits for the slowest. Here a worker pulls the global model,
trains its K local steps and pushes Δ = θ_pulled − θ_K; the server applies that Δ at once with
one outer step (on θ, not on the point the worker pulled) and the worker pulls again. A reply
computed from a model `s` outer steps old has staleness s. The three server rules
(`AsyncRule`):

- async DiLoCo: G = ρΔ, the outer optimizer as configured (DiLoCo's Nesterov), workers pull θ;
- look-ahead: G = ρΔ, momentum look-ahead steps (`outer=mla`), workers pull θ̄ = θ − ημm;
- HeLoCo: as look-ahead, with Δ corrected against the momentum first (lordo_fed.rounds.heloco; Al Asif
  et al., arXiv 2606.00271).

ρ (`AsyncConfig.weight`) is HeLoCo's arrival weight, applied to every method alike: one outer
step per arrival moves θ M times per "round" where a synchronous round moves it once with the
mean of M pseudo-gradients, so unweighted arrivals at DiLoCo's outer lr overshoot (the paper
suggests ρ = 1/√K for K concurrent workers). With `AsyncConfig.staleness_exponent` a > 0 the weight
also falls with the reply's staleness s: ρ_s = ρ·(1+s)^−a (the polynomial staleness function of
FedAsync, Xie et al., arXiv 1903.03934, eq. 2), so a reply made from an old model moves θ less.

With a grace window (`AsyncConfig.grace` > 0, the HeLoCo authors' option, off by default) the
server, once an arrival comes, waits `grace` seconds for more: every arrival within the window is
applied in turn (one outer step each, not averaged), and all of those workers are sent the same
next start point when the window closes, so none of them is stale against the others.

`VirtualClock` orders arrivals deterministically: worker w takes K · speeds[w] virtual seconds
per round, arrivals are processed in (virtual time, worker id) order. The reference trainer
uses it (`lordo_fed.trainer.run.run_async`) so that a Flower run on the same schedule can be
compared with it.

With the cache (`AsyncConfig.cache='ca2fl'`, off by default) the server keeps each worker's latest Δ, h_w
(zero until w's first reply), and an arrival's outer step acts on v = (1/M) Σ_j h_j + (Δ − h_w), with the
cache as it stood, then h_w ← Δ: the mean of every worker's latest Δ calibrated by the arrival's change
(CA²FL, Wang et al., ICLR 2024, arXiv 2405.10153, Algorithm 1 with one arrival a step), so that a slow
worker's data weighs in every step and not only in the few it arrives at (the "heterogeneity amplification"
of non-IID data under asynchrony). v takes Δ's place: ρ, HeLoCo's correction and the outer step apply to it
as to Δ. (The plain mean of the latest Δs, MIFA's, was measured worse and is not kept: docs/results.md,
section 19, part seven.)

With a compressed payload preset the downlink is compressed too (`NodeCopies`): the server keeps,
per worker, the copy θ_c[w] of θ that worker holds and sends each pull as the compressed change
from it, as synchronous rounds do with the one copy all workers share.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lordo_fed.rounds.config import AsyncConfig
from lordo_fed.rounds.heloco import correct, look_ahead
from lordo_fed.optim.bias import restep
from lordo_fed.wire.compress import decode, encode
from lordo_fed.wire.messages import GlobalState, WorkerUpdate, split_moment_key
from lordo_fed.wire.payload import PayloadCodecs
from lordo_fed.rounds.outer import MomentumLookAhead, OuterOptimizer
from lordo_fed.rounds.aggregator import Aggregator
from lordo_fed.rounds.bases import fit_projections
from lordo_fed.rounds.screening import delta_problem, tensor_problem


def arrival_weight(cfg: AsyncConfig, staleness: int) -> float:
    """ρ_s = ρ·(1+s)^−a: HeLoCo's arrival weight ρ (`weight`), lowered for a reply `staleness` outer
    steps old by FedAsync's polynomial staleness function (`staleness_exponent` a; a = 0: ρ)."""
    return cfg.weight * (1.0 + staleness) ** -cfg.staleness_exponent


class SpeedMatch:
    """Per-node local steps from measured speed, so that every node's round takes about the same
    wall-clock (`AsyncConfig.match_speed`; GradSkip's per-client number of local steps,
    Maranjyan et al. 2022, with each node's speed measured instead of given).

    A node's round is modelled as a_p + b_p·k seconds for k local steps: b_p its measured training
    seconds per step (compute), a_p the rest of its last round (transfers, waiting, encoding). The
    target T is the mean over measured nodes of a_p + b_p·K, and no lower than the slowest fixed
    part plus one step (max a_p + b_p: a node on a slow link cannot be faster than its transfers);
    node p then trains k_p = (T − a_p) / b_p steps, rounded, within [1, `max_factor`·K]. Nodes not
    measured yet train K."""

    def __init__(self, local_steps: int, max_factor: float = 4.0):
        if local_steps < 1 or not max_factor >= 1:
            raise ValueError(f"SpeedMatch(local_steps={local_steps}, max_factor={max_factor}): expected K >= 1 "
                             "and a factor >= 1")
        self.K, self.max_steps = int(local_steps), max(1, int(max_factor * local_steps))
        self.fixed: dict[int, float] = {}
        """Node -> a_p: seconds of its last round not spent training."""
        self.per_step: dict[int, float] = {}
        """Node -> b_p: its last round's training seconds per step."""

    def observe(self, worker: int, round_seconds: float, train_seconds: float, steps: int) -> None:
        """Node `worker`'s last round: `round_seconds` from its start point's publication to its
        reply's arrival, `train_seconds` of it training `steps` local steps."""
        if steps < 1 or not train_seconds > 0:
            return  # nothing to learn a speed from
        self.per_step[worker] = train_seconds / steps
        self.fixed[worker] = max(0.0, round_seconds - train_seconds)

    def target(self) -> float | None:
        """T, the round time every node is given steps for (None before any node is measured)."""
        if not self.per_step:
            return None
        nodes = list(self.per_step)
        mean = sum(self.fixed[p] + self.per_step[p] * self.K for p in nodes) / len(nodes)
        return max(mean, max(self.fixed[p] + self.per_step[p] for p in nodes))

    def steps(self, worker: int) -> int:
        """Local steps for `worker`'s next round."""
        target = self.target()
        if target is None or worker not in self.per_step:
            return self.K
        k = round((target - self.fixed[worker]) / self.per_step[worker])
        return int(min(self.max_steps, max(1, k)))


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

    def window(self, grace: float) -> tuple[float, list[tuple[float, int]]]:
        """The next grace window: (when it closes, its arrivals in order): the earliest arrival
        and every other one within `grace` seconds of it (grace 0: the earliest alone, and the
        window closes at its time)."""
        first = self.next()
        close, batch = first[0] + grace, [first]
        while grace > 0 and self._heap and self._heap[0][0] <= close:
            batch.append(self.next())
        return close, batch

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

    def state(self) -> list[list]:
        """The scheduled arrivals as JSON values ([time, worker], in the heap's order): a checkpoint's."""
        return [[t, w] for t, w in self._heap]

    def load_state(self, state: list[list]) -> None:
        """The arrivals `state()` returned, scheduled again in the same order."""
        self._heap = [(float(t), int(w)) for t, w in state]
        heapq.heapify(self._heap)


@dataclass
class Arrival:
    """One processed push: who, when, from how old a model, and whether it was applied."""

    worker: int
    time: float
    staleness: int
    applied: bool
    reason: str = ""


@dataclass
class Pull:
    """What a worker starts a round from, and what the server needs to know of it at the push."""

    params: dict[str, Tensor]
    """θ̄ (look-ahead) or θ, as copies."""
    version: int
    """Outer steps applied when it was pulled (staleness = version at the push − this)."""
    projections: dict[str, Tensor] = field(default_factory=dict)
    """Async LoRDO: the shared projections of basis `basis`."""
    moments: dict[str, Tensor] = field(default_factory=dict)
    """Async LoRDO: the server's averaged moments, in that basis, at step count `opt_step`."""
    opt_step: int | None = None
    """Async LoRDO: the shared step count the worker aligns its moments to (None: its own)."""
    basis: int = 0
    """Async LoRDO: which basis (refits so far) the worker trains in."""


class NodeCopies:
    """The compressed downlink of asynchronous rounds: each worker's own copy θ_c[w].

    A synchronous round sends every worker the same change θ − θ_c of the one copy they all hold
    (lordo_fed.rounds.aggregator). Asynchronous workers pull at different versions, so the server
    keeps one copy per worker, what that worker last started from, and sends its pull θ̄ (θ, or the
    look-ahead point) as the compressed change θ̄ − θ_c[w] with the preset's `down` codec. Both ends
    add the same decoded change to the same tensors (the worker's `Downlink`), so they agree on
    θ_c[w] bit for bit, and the worker trains from it; what the change leaves out stays in
    θ̄ − θ_c[w] and goes with that worker's next pull (error feedback, as in the synchronous
    downlink). The moments a pull carries (async LoRDO) go with the preset's moment codecs.

    A worker whose copy the server does not know (its first pull, a message that failed, a server
    resumed from a checkpoint) is sent θ̄ whole, which becomes its copy. Server memory: one θ per
    worker that holds a copy (docs/algorithm.md, "Asynchronous rounds")."""

    def __init__(self, payload: PayloadCodecs | None):
        self.payload = payload
        """The run's compressed preset (None: fp32 both ways, nothing kept)."""
        self.copies: dict[int, dict[str, Tensor]] = {}
        """Worker -> θ_c[w], the θ it holds (fp32, host)."""

    def start_point(self, worker: int, state: GlobalState, pull: Pull) -> GlobalState:
        """`state` (θ̄ of `pull` whole, its moments raw) as `worker` is sent it: with a compressed
        downlink the change from the worker's copy (`params_delta`), and `pull.params` becomes the
        copy the worker trains from; moments quantised with a compressed preset."""
        codecs = self.payload
        if codecs is None:
            return state
        if state.moments:
            state = dataclasses.replace(state, moments=codecs.encode_moments(state.moments))
        if codecs.down is None:
            return state
        held = self.copies.get(worker)
        if held is None:
            self.copies[worker] = {n: t.detach().float().clone() for n, t in pull.params.items()}
            return state
        change = {n: encode(pull.params[n] - held[n], codecs.down) for n in pull.params}
        for n, e in change.items():
            held[n] += decode(e, n).view(e.shape)
        pull.params = {n: t.clone() for n, t in held.items()}
        return dataclasses.replace(state, params=change, params_delta=True)

    def forget(self, worker: int) -> None:
        """The worker may not hold its copy (its round's message failed): θ̄ whole next time."""
        self.copies.pop(worker, None)


class AsyncServer:
    """The global model under asynchronous pushes: θ (fp32), the outer optimizer, a version
    counter (outer steps applied), the rule and, for async LoRDO, the shared projections and
    averaged moments (`lowrank`). Flower-free; the reference trainer and the Flower strategy
    drive it.

    Async LoRDO (docs/algorithm.md, "Asynchronous LoRDO"): a pull carries the current basis P_b
    and the averaged moments in it; a push's moments, made in the basis its worker pulled, are
    rotated into the current one with LDAdam's rule (the bases a pending pull still uses are
    kept), moved to the shared step count, and blended into the averaged moments with weight
    1/M (an average over arrivals standing in for the mean over M workers, with server memory
    flat in M); the applied updates G of the low-rank matrices are summed and P is refitted to
    their top-r subspace every M arrivals (one synchronous round's worth), the averaged moments
    rotated into the new basis. HeLoCo's correction acts on the full-size Δ only and composes.
    """

    def __init__(self, params: dict[str, Tensor], outer: OuterOptimizer, rule: AsyncRule, cfg: AsyncConfig,
                 lowrank: Aggregator | None = None, workers: int = 1):
        if rule.look_ahead and not isinstance(outer, MomentumLookAhead):
            raise ValueError(f"look-ahead pulls need the momentum look-ahead outer step (outer name 'mla'), not "
                             f"{outer.name!r}")
        if lowrank is not None and (lowrank.params is not params or lowrank.projection is None):
            raise ValueError("async LoRDO: the low-rank state must be an Aggregator that owns the projections over "
                             "these very parameters")
        self.params = params
        self.outer, self.rule, self.cfg = outer, rule, cfg
        self.lowrank, self.workers = lowrank, int(workers)
        self.version = 0
        """Outer steps applied so far."""
        self.basis = 0
        """Async LoRDO: refits of the shared projections so far."""
        self.accumulated: dict[str, Tensor] = {}
        """Async LoRDO: Σ G of the low-rank matrices since the last refit."""
        self.since_refit = 0
        self._bases: dict[int, dict[str, Tensor]] = {}  # older bases a pending pull still trains in
        self._held: dict[int, int] = {}  # basis -> pulls not pushed (or released) yet
        self.cache: dict[int, dict[str, Tensor]] = {}
        """`cfg.cache`: each worker's latest applied Δ (fp32), h_w."""
        self._cache_sum: dict[str, Tensor] = {}  # Σ_w h_w, kept so that an arrival costs O(1) adds, not O(M)

    def _momentum(self) -> dict[str, Tensor] | None:
        return self.outer.momentum_buffers() if isinstance(self.outer, MomentumLookAhead) else None

    def pull(self) -> Pull:
        """The model a worker starts from (θ̄ or θ, as copies), its version and, for async LoRDO,
        the shared basis and averaged moments (a pull must end in `push` or `release`)."""
        if self.rule.look_ahead:
            outer = self.outer
            theta = look_ahead(self.params, self._momentum(), outer.lr, outer.momentum)
        else:
            theta = {n: p.clone() for n, p in self.params.items()}
        agg = self.lowrank
        if agg is None:
            return Pull(theta, self.version)
        self._held[self.basis] = self._held.get(self.basis, 0) + 1
        return Pull(theta, self.version, dict(agg.projections), dict(agg.moments), agg.opt_step, self.basis)

    def release(self, pull: Pull) -> None:
        """A pull that will not be pushed (its message failed): its basis need not be kept for it."""
        if self.lowrank is None or pull.basis not in self._held:
            return
        self._held[pull.basis] -= 1
        if not self._held[pull.basis]:
            del self._held[pull.basis]
            self._bases.pop(pull.basis, None)

    def check(self, update: WorkerUpdate, worker: int, round_idx: int) -> str | None:
        """Why a reply must not be applied, or None: it must be the round `round_idx` of `worker`
        it answers, carry positive tokens and a finite Δ of every parameter in its shape, and
        optimizer moments only under async LoRDO, each in its low-rank (or full) shape."""
        if update.worker_id != worker or update.round != round_idx:
            return (f"reply is for partition {update.worker_id} round {update.round}, the server sent partition "
                    f"{worker} round {round_idx}")
        problem = delta_problem(update, self.params)
        if problem:
            return problem
        if update.moments and self.lowrank is None:
            return f"unexpected optimizer states {sorted(update.moments)[:3]}: this method averages none"
        for key, value in update.moments.items():
            try:
                kind, name = split_moment_key(key)
            except ValueError as err:
                return str(err)
            if kind == "ef" or name not in self.params:
                return f"unexpected optimizer state {key!r}"
            problem = tensor_problem(key, value, self.lowrank.expected_moment_shape(name))
            if problem:
                return problem
        return None

    def push(self, update: WorkerUpdate, pull: Pull, time: float) -> Arrival:
        """Apply one worker's reply to the round it pulled (or drop it past the staleness bound):
        one outer step on Δ and, for async LoRDO, its moments into the averaged ones."""
        staleness = self.version - pull.version
        bound = self.cfg.max_staleness
        try:
            if bound and staleness > bound:
                return Arrival(update.worker_id, time, staleness, False,
                               f"staleness {staleness} > max_staleness {bound}")
            rho = arrival_weight(self.cfg, staleness)
            delta = self._cached(update.worker_id, update.delta) if self.cfg.cache != "none" else update.delta
            if self.rule.correct:
                g = correct(delta, self._momentum(), self.cfg.heloco, rho)
            else:
                g = delta if rho == 1.0 else {n: d * rho for n, d in delta.items()}
            with torch.no_grad():
                self.outer.step(self.params, g)
                if self.lowrank is not None:
                    self._merge_lowrank(update, pull, g)
            self.version += 1
            return Arrival(update.worker_id, time, staleness, True)
        finally:
            self.release(pull)

    def _cached(self, worker: int, delta: dict[str, Tensor]) -> dict[str, Tensor]:
        """The direction of an arrival from `worker` under `cfg.cache` (module docstring: CA²FL's mean of the
        latest Δ of every worker calibrated by this arrival), in Δ's dtypes; the cache then holds this Δ for
        the worker."""
        m = self.workers
        old = self.cache.get(worker)
        new = {n: d.detach().float().clone() for n, d in delta.items()}
        out = {}
        with torch.no_grad():
            for n, d in new.items():
                total = self._cache_sum.get(n)
                prior = old[n] if old is not None else None  # h_w: zero before w's first reply
                v = d.clone() if prior is None else d - prior  # the mean as it stood + (Δ − h_w)
                if total is None:  # the first reply of any worker: the mean was zero
                    self._cache_sum[n] = d.clone()
                else:
                    v.add_(total, alpha=1.0 / m)
                    total.add_(d)
                    if prior is not None:
                        total.sub_(prior)
                out[n] = v.to(delta[n].dtype)
        self.cache[worker] = new
        return out

    def _merge_lowrank(self, update: WorkerUpdate, pull: Pull, g: dict[str, Tensor]) -> None:
        agg = self.lowrank
        betas, bias = agg.round_betas(), agg.bias_correction
        count = max(agg.opt_step, update.opt_step)  # the shared step count from now on
        mine = {k: restep(v, split_moment_key(k)[0], agg.opt_step, count, betas, bias) for k, v in agg.moments.items()}
        agg.opt_step = count
        theirs = {k: restep(v.float(), split_moment_key(k)[0], update.opt_step, count, betas, bias)
                  for k, v in update.moments.items()}
        if pull.basis != self.basis and agg.rotate:
            theirs = agg.rotated_moments(theirs, self._bases[pull.basis], agg.projections)
        a = 1.0 / self.workers
        for k, v in theirs.items():
            mine[k] = v.clone() if k not in mine else mine[k] * (1.0 - a) + v * a
        agg.moments = mine
        for n in agg.ranks:
            acc = self.accumulated.get(n)
            self.accumulated[n] = g[n].float().clone() if acc is None else acc.add_(g[n])
        self.since_refit += 1
        if self.since_refit >= self.workers:
            self._refit()

    def _refit(self) -> None:
        """P ← top-r subspace of the summed updates; the averaged moments rotated into it."""
        agg = self.lowrank
        new = fit_projections(self.accumulated, agg.ranks, agg.projection, agg.seed + 7919 * (self.basis + 1),
                              agg.fit_device)
        if agg.rotate:
            agg.moments = agg.rotated_moments(agg.moments, agg.projections, new)
        if self._held.get(self.basis):
            self._bases[self.basis] = agg.projections
        agg.projections = new
        self.basis += 1
        self.accumulated, self.since_refit = {}, 0

    def state_dict(self) -> tuple[dict[str, Tensor], dict]:
        """What a checkpoint needs beyond the aggregator's (θ, outer state, projections, moments,
        step count): the async LoRDO accumulator as tensors, the counters as JSON values."""
        cached = {f"async_cache/{w}/{n}": t.clone() for w, h in self.cache.items() for n, t in h.items()}
        cached.update({f"async_cache_sum/{n}": t.clone() for n, t in self._cache_sum.items()})
        return ({**{f"async_acc/{n}": t.clone() for n, t in self.accumulated.items()}, **cached},
                {"version": self.version, "basis": self.basis, "since_refit": self.since_refit})

    def load_state_dict(self, tensors: dict[str, Tensor], meta: dict) -> None:
        self.version = int(meta.get("version", 0))
        self.basis = int(meta.get("basis", 0))
        self.since_refit = int(meta.get("since_refit", 0))
        self.accumulated = {k.removeprefix("async_acc/"): v.float().clone() for k, v in tensors.items()
                            if k.startswith("async_acc/")}
        self.cache = {}
        for key, value in tensors.items():
            if key.startswith("async_cache/"):
                worker, _, name = key.removeprefix("async_cache/").partition("/")
                if not worker.isdigit() or not 0 <= int(worker) < self.workers or not name:
                    raise ValueError(f"checkpoint key {key!r}: expected async_cache/<worker 0..{self.workers - 1}>/"
                                     "<parameter name> (CA²FL's cache of one worker's last Δ)")
                self.cache.setdefault(int(worker), {})[name] = value.float().clone()
        # the running sum as saved: summed again it would differ from the run's in the last bits
        self._cache_sum = {k.removeprefix("async_cache_sum/"): v.float().clone() for k, v in tensors.items()
                           if k.startswith("async_cache_sum/")}

    def pulls_state(self) -> tuple[dict[str, Tensor], dict]:
        """The pulls not pushed yet (the reference trainer's checkpoints hold its rounds in flight, which the
        Flower app's do not: its nodes pull again): the older bases they train in and how many hold each."""
        tensors = {f"basis{b}/{n}": t for b, bases in self._bases.items() for n, t in bases.items()}
        return tensors, {"held": {str(b): c for b, c in self._held.items()}, "bases": sorted(self._bases)}

    def load_pulls_state(self, tensors: dict[str, Tensor], meta: dict) -> None:
        self._held = {int(b): int(c) for b, c in meta["held"].items()}
        self._bases = {}
        for b in meta["bases"]:
            prefix = f"basis{b}/"
            saved = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            order = [*(n for n in self.lowrank.ranks if n in saved), *(n for n in saved if n not in self.lowrank.ranks)]
            self._bases[int(b)] = {n: saved[n].clone() for n in order}  # in the ranks' order, as a fit makes them


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
