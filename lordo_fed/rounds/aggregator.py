"""The aggregator: weight the screened replies by tokens, average, apply the outer update, refresh projections.

One round on the server side (docs/algorithm.md, "Where each equation lives"; Jovanović et al.,
LoRDO, arXiv 2602.04396):
    Δ̄ = Σ_m (n_m / Σ n) Δ_m                token-weighted average of the pseudo-gradients
                                             (top-k with `rounds.sparse_mean='contributors'`: at each
                                             index over the workers that sent it, `contributor_mean`)
    θ ← outer(θ, Δ̄)                         average / QHM / Nesterov (lordo_fed.rounds.outer)
    u, v averaged the same way when due      (DES-LOC periods, lordo_fed.rounds.config.RoundConfig)
    P ← top-r subspace of Δ̄ per low-rank W  (LoRDO-Global) and the averaged moments rotated
                                             into it with LDAdam's rule
Plain tensors in and out: the Flower strategy wraps this object unchanged, and the reference
trainer calls it directly. Why a reply is refused lives in lordo_fed.rounds.screening; the
`Aggregator` applies those rules against its own expectations (`check`, `screen`, ...).

Bounded memory (the server's peak is flat in M): a caller that spools each reply on arrival
screens it there (`check_reply`: `check()` and ||Δ||), keeps a `ReplyRef` (tokens, opt_step,
moment keys, and a `load` that decodes the reply again), drops the tensors, applies the round's
rules to the collected verdicts (`screen_round`) and hands the refs to `aggregate_refs`, which
loads each reply once, in worker_id order, and adds it into fp32 accumulators before loading the
next. `aggregate(list)` is that same path over in-memory refs, so both give bit-identical results.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from lordo_fed.optim.bias import restep
from lordo_fed.optim.projection import ProjectionMethod, projection_side
from lordo_fed.rounds import screening
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.bases import (
    fit_projections, initial_projections, low_rank_shape, rotate_into, subspace_diagnostics)
from lordo_fed.rounds.outer import Average, OuterOptimizer
from lordo_fed.rounds.relay import relay_checkpoint, relayed_form, relayed_from_checkpoint
from lordo_fed.rounds.sparse import add_sent, add_weighted, contributor_mean, support_overlap
from lordo_fed.rounds.screening import ReplyRef
from lordo_fed.wire import lowrank
from lordo_fed.wire.compress import Encoded, SparseValues, add_decoded, encode, plus_decoded
from lordo_fed.wire.messages import (
    DIAGNOSTIC_METRICS, GlobalState, WorkerUpdate, split_moment_key)
from lordo_fed.wire.payload import PayloadCodecs

log = logging.getLogger(__name__)


@dataclass
class RoundResult:
    """The next global state plus what happened to each reply."""

    state: GlobalState
    accepted: list[int]
    rejected: dict[int, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


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
        outlier_factor: refuse a reply whose ||Δ|| exceeds this multiple of the round's median (0: off; 3+ replies).
        betas, bias_correction: the inner optimizer's, to rotate the second moment and move moments
            between step counts.
        switch_step, switch_betas: the two-phase recipe (InnerConfig): betas from step `switch_step` on (0: one phase).
        rotate: rotate the averaged moments into each new basis (the inner optimizer's `rotate`).
        init_projection: 'random' (seeded basis for round 1) or 'gradient' (round 1 waits for
            `init_projections` with the workers' gradients at θ0).
        diagnostics: also report, per round, the mean stable rank of Δ̄ over the low-rank matrices and
            the share of ||Δ̄||² inside the round's shared subspace (an SVD per matrix: the paper's
            stagnation diagnostic, off by default), and ||Δ̄|| / Σ_m w_m ||Δ_m|| (`delta_retention`:
            1 when the replies agree, 1/√M for M orthogonal ones of one length).
        fit_device: where the projections are fitted (batched, `fit_projections`): the server's
            GPU when it has one; θ, the outer state and the sums stay on the host.
        late_lr: the outer lr of the late rounds (`rounds.first_late_round()` on; 0: the outer
            optimizer's own lr throughout; docs/algorithm.md, "The outer lr of the last rounds").
    """

    def __init__(self, params: dict[str, Tensor], ranks: dict[str, int], rounds: RoundConfig, outer: OuterOptimizer,
                 projection: ProjectionMethod | None, seed: int = 0, outlier_factor: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), bias_correction: bool = True, rotate: bool = True,
                 init_projection: str = "random", diagnostics: bool = False, switch_step: int = 0,
                 switch_betas: tuple[float, float] = (0.999, 0.999), fit_device: torch.device | str | None = None,
                 payload: PayloadCodecs | None = None, late_lr: float = 0.0):
        self.params = {n: p.detach().float().clone() for n, p in params.items()}
        self.ranks = dict(ranks)
        self.rounds = rounds
        self.outer = outer
        self._lrs = (outer.lr, late_lr or outer.lr)  # the outer lr before the late rounds and in them
        self.projection = projection
        self.seed = seed
        self.outlier_factor = outlier_factor
        self.betas = tuple(betas)
        self.switch_step = switch_step
        self.switch_betas = tuple(switch_betas)
        self.bias_correction = bias_correction
        self.rotate = rotate
        self.diagnostics = diagnostics
        self.fit_device = fit_device
        self.round = 1
        self.opt_step = 0
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.projections: dict[str, Tensor] = (
            initial_projections(shapes, self.ranks, projection, seed)
            if projection is not None and init_projection == "random" else {}
        )
        self.moments: dict[str, Tensor] = {}
        self.payload = payload
        """A compressed payload preset (lordo_fed.wire.payload): moments sent quantised and, with
        its `down` codec, θ as the compressed change of the clients' copy (with `relay`, as the
        replies the last round applied)."""
        if payload is not None and payload.relay and not isinstance(outer, Average):
            raise ValueError(f"outer={outer.name!r} with a relaying payload: every worker replays the server's outer "
                             "step from the relayed replies, which needs the plain average (outer.name='average', "
                             "any lr; its state is θ alone)")
        self.tracks_copy = payload is not None and payload.tracks_copy
        """A compressed downlink: every worker holds θ_c, and the state carries its change (or, with
        `relay`, the replies that change it)."""
        self.client_params: dict[str, Tensor] | None = (
            {n: p.clone(memory_format=torch.contiguous_format) for n, p in self.params.items()}
            if self.tracks_copy and not payload.relay else None)
        """θ_c, what every worker that applied every round's state holds (θ0 at first): the server
        keeps it exactly, so that both sides add the same decoded change to the same tensors. Not with a
        relay: each worker's replay gives θ itself, so θ is θ_c once the state is applied."""
        self._resync_all = False
        """θ_c unknown (resumed from a checkpoint without it): the next state carries θ whole."""
        self._relayed: list[WorkerUpdate] | None = None
        """A relaying payload: the replies the last round applied, as received (None: unknown, after a
        resume: the next state carries θ whole)."""
        self._encoded: tuple[int, GlobalState] | None = None
        """The compressed state of a round, encoded once (the round number changes with θ)."""
        self._spare: dict[str, Tensor] = {}
        """The last round's Δ sums, which nothing keeps: zeroed and reused, where fresh θ-sized sums pay their
        page faults every round (at 125m most of a relaying server's sums; docs/results.md, section 12)."""

    # ----------------------------------------------------------------------------- state out
    def global_state(self) -> GlobalState:
        """What every worker is sent for the current round: with a compressed downlink, from
        round 2 on, the change of the clients' copy (`params_delta`) instead of θ."""
        if self.payload is None:
            return GlobalState(round=self.round, params=self.params, projections=self.projections,
                               moments=self.moments, opt_step=self.opt_step)
        if self._encoded is None or self._encoded[0] != self.round:
            moments = self.payload.encode_moments(self.moments)
            params, delta = (self._downlink(), True) if self.downlink_due() else (self.params, False)
            # the replies of the round just applied, with that round's outer lr, for the workers to replay it
            relay = (dict(relay=self._relayed, outer_lr=self.outer_lr(self.round - 1))
                     if delta and self.payload.relay else {})
            self._encoded = (self.round, GlobalState(round=self.round, params=params, projections=self._bases_sent(delta),
                                                     moments=moments, opt_step=self.opt_step, params_delta=delta,
                                                     **relay))
        return self._encoded[1]

    def outer_lr(self, round_idx: int) -> float:
        """The outer step's lr in 1-based round `round_idx`: the late rounds' from the first that starts at
        or after `rounds.late_from_step` (a function of the round alone, so a resumed run needs no state)."""
        late = self.rounds.first_late_round()
        return self._lrs[late is not None and round_idx >= late]

    def _bases_sent(self, params_delta: bool) -> dict[str, Tensor]:
        """The shared bases a state carries: the server's every round, or with `bases_from='downlink'`
        (each worker fits its own to the change it applies) only with θ whole: round 1's."""
        return {} if params_delta and self.rounds.bases_from == "downlink" else self.projections

    def resync_state(self) -> GlobalState:
        """This round's state with θ_c whole (what a worker that missed a round is sent): the
        clients' copy as the other workers hold it once they applied `global_state()`."""
        return dataclasses.replace(self.global_state(), params=self.client_copy(), params_delta=False,
                                   projections=self._bases_sent(False), relay=[], outer_lr=0.0)

    def client_copy(self) -> dict[str, Tensor]:
        """θ_c after this round's state is applied (θ itself without a compressed downlink)."""
        if not self.tracks_copy:
            return self.params
        if not self.downlink_due() or self.payload.relay:  # a relay's replay gives θ itself
            return {n: p.clone(memory_format=torch.contiguous_format) for n, p in self.params.items()}
        change = self.global_state().params
        return {n: plus_decoded(self.client_params[n], e, n) for n, e in change.items()}

    def downlink_due(self) -> bool:
        """Whether this round's state carries θ as the compressed change of the clients' copy."""
        relay_known = not self.payload.relay or self._relayed is not None if self.payload is not None else True
        return self.tracks_copy and self.round > 1 and not self._resync_all and relay_known

    def _downlink(self) -> dict[str, Encoded]:
        """θ − θ_c per parameter, compressed (deterministic: the same bytes every call); nothing with a
        relay (the state carries the replies instead)."""
        if self.payload.relay:
            return {}
        return {n: encode(self.params[n] - self.client_params[n], self.payload.down) for n in self.params}

    def _commit_downlink(self) -> None:
        """The round's state went out: θ_c becomes what the workers hold now (with a relay, θ itself).
        A compressed change is added into θ_c in place, the same additions as `client_copy`'s, without a
        fresh θ-sized copy each round (at 125m its page faults were most of option A's commit)."""
        if self.tracks_copy:
            if self.client_params is not None and self.downlink_due():  # (a relay keeps no θ_c)
                for n, e in self.global_state().params.items():
                    add_decoded(self.client_params[n], e, n)
            elif self.client_params is not None:  # θ went whole: θ_c is θ
                self.client_params = self.client_copy()
            self._resync_all = False

    def skip_round(self) -> None:
        """The round is given up (too few usable replies): θ and the states stay, the round counter
        moves on, and the clients' copy keeps what this round's state told them."""
        self._commit_downlink()
        self._relayed = [] if self._relayed is not None else None  # θ did not move: nothing to replay
        self.round += 1

    def expected_moment_shape(self, name: str) -> tuple[int, ...]:
        """The shape of `name`'s moments on the wire (and of its low-rank coordinates): low-rank
        (`low_rank_shape`) for a parameter in `ranks`, θ's shape otherwise."""
        shape = tuple(self.params[name].shape)
        return low_rank_shape(shape, self.ranks[name]) if name in self.ranks else shape

    def coords_expected(self) -> list[str]:
        """The parameters whose Δ comes as coordinates in this round's shared basis plus a residual
        (a `lowrank+` payload preset, lordo_fed.wire.lowrank): every one with a shared basis."""
        if self.payload is None or self.payload.lowrank is None or self.projection is None:
            return []
        return sorted(self.projections)

    # ----------------------------------------------------------------------------- screening
    def check(self, update: WorkerUpdate) -> str | None:
        """Why `update` must not be applied, or None if it is well-formed: `screening.reply_problem`
        against this round, θ's shapes, the states due and the coordinates the payload sends."""
        return screening.reply_problem(update, round_idx=self.round, params=self.params, ranks=self.ranks,
                                       rounds=self.rounds, moment_shape=self.expected_moment_shape,
                                       coords=self.coords_expected())

    def check_reply(self, update: WorkerUpdate) -> tuple[str | None, float]:
        """`check()` and ||Δ|| of one reply: everything screening needs from its tensors, so a
        caller can screen each reply as it arrives and drop the tensors (keeping a `ReplyRef`).
        The norm is NaN for a refused reply (it takes no part in the outlier rule)."""
        reason = self.check(update)
        return reason, (math.nan if reason is not None else screening.delta_norm(update))

    def screen_round(self, worker_ids: Sequence[int], norms: Sequence[float],
                     reasons: Sequence[str | None]) -> list[str | None]:
        """The round's rules over the per-reply verdicts of `check_reply` (in arrival order, which
        decides which of two replies for one partition is kept): a second well-formed reply for a
        worker already answered is refused, then, among the rest, the norm outliers
        (`outlier_factor`): `screening.screen_round`. Returns the final reasons (None: usable);
        logs nothing."""
        return screening.screen_round(worker_ids, norms, reasons, self.outlier_factor)

    def screen(self, updates: Sequence[WorkerUpdate]) -> tuple[list[str | None], list[float]]:
        """Why each update must not be applied (None: usable), in the order given, and each
        one's ||Δ|| (NaN where refused by `check_reply`): `check_reply` per update, then
        `screen_round`. Logs nothing and changes nothing, so a caller can report the reasons
        under its own client names; `aggregate` keeps the norms for median clipping."""
        checked = [self.check_reply(u) for u in updates]
        norms = [n for _, n in checked]
        return self.screen_round([u.worker_id for u in updates], norms, [r for r, _ in checked]), norms

    def check_gradient(self, gradient: WorkerUpdate) -> str | None:
        """Why one round-0 gradient reply must not be used, or None: round 0, the low-rank
        parameters' names, shapes, dtypes and finite values, tokens (`screening.gradient_problem`)."""
        return screening.gradient_problem(gradient, self.params, self.ranks)

    def screen_gradient_round(self, worker_ids: Sequence[int], reasons: Sequence[str | None]) -> list[str | None]:
        """`screen_round` for round 0 over the verdicts of `check_gradient`: one reply per worker
        (no outlier rule: gradients at θ0 are not pseudo-gradients of a round)."""
        return screening.screen_gradient_round(worker_ids, reasons)

    def screen_gradients(self, gradients: Sequence[WorkerUpdate]) -> list[str | None]:
        """Why each round-0 gradient reply must not be used (None: usable), in the order given:
        `check_gradient`, then one reply per worker. Logs nothing and changes nothing (as
        `screen()` for round replies)."""
        return self.screen_gradient_round([g.worker_id for g in gradients], [self.check_gradient(g) for g in gradients])

    # ----------------------------------------------------------------------------- aggregation
    def aggregate(self, updates: Sequence[WorkerUpdate], screened: bool = False,
                  relay: Mapping[int, WorkerUpdate] | None = None) -> RoundResult:
        """Apply one round of decoded replies; bad replies are logged and dropped, never applied.

        `screened=True`: the caller already dropped what `screen()` refuses (the checks are not
        run a second time). The replies are averaged by `aggregate_refs` over in-memory refs, in
        worker_id order whatever the order given: one code path for the reference trainer and a
        deployment that streams its replies. `relay`: with a relaying payload, each reply as received
        (still compressed), by worker_id (`aggregate_refs`)."""
        rejected: dict[int, str] = {}
        refs: list[ReplyRef] = []
        if screened:
            reasons = [None] * len(updates)
            norms = [screening.delta_norm(u) if self.rounds.clip_median else math.nan for u in updates]
        else:
            reasons, norms = self.screen(updates)
        for u, reason, norm in zip(updates, reasons, norms):
            if reason is None:
                kept = relay.get(u.worker_id) if relay is not None else None
                refs.append(ReplyRef.of(u, norm=norm, relayed=None if kept is None else (lambda kept=kept: kept)))
            else:
                rejected[u.worker_id] = reason
                log.warning("round %d: dropped reply of worker %s: %s", self.round, u.worker_id, reason)
        return self.aggregate_refs(refs, rejected)

    @torch.no_grad()
    def aggregate_refs(self, refs: Sequence[ReplyRef], rejected: Mapping[int, str] | None = None) -> RoundResult:
        """Apply one round from screened replies that are loaded one at a time.

        Server memory is θ, the outer state, the fp32 accumulators (Δ̄ and the due moments) and
        one loaded reply, whatever the number of replies M. The weights come from the refs up
        front, w_m = n_m / Σ n, and the shared step count S = max opt_step, so each reply is
        loaded once, in worker_id (partition) order, and added into every accumulator
        (`_accumulate`) before the next is loaded: the same fp32 additions in the same order as
        averaging a list, so the result does not depend on M replies being in memory or on their
        arrival order. `rejected` (worker_id -> reason) is only passed on to the result.

        The refs must have passed screening (`check_reply` + `screen_round`): one per worker, all
        for the current round; anything else raises ValueError, as does a `load` that returns a
        reply other than the one its ref describes. The state changes only after every reply
        was loaded, so a failed load leaves the aggregator as it was.

        With a relaying payload (`PayloadCodecs.relay`) every ref must give its reply as received
        (`ReplyRef.relayed`, Δ still compressed): the next state relays their Δ, without moments or
        metrics, for the workers to replay this round (lordo_fed.rounds.relay)."""
        rejected = dict(rejected or {})
        if not refs:
            log.warning("round %d: no usable reply; global state unchanged", self.round)
            return RoundResult(self.global_state(), [], rejected, {})
        refs = sorted(refs, key=lambda r: r.worker_id)
        screening.check_refs(refs, self.round)
        relayed = self._relay_of(refs)

        total = sum(r.tokens for r in refs)
        weights = [r.tokens / total for r in refs]
        # SparseLoCo's production server clips each peer to the median norm (`rounds.clip_median`)
        clip = screening.clip_factors([r.norm for r in refs], self.round) if self.rounds.clip_median else [1.0] * len(refs)
        opt_step = max(r.opt_step for r in refs)
        # each moment is the mean over the replies that carry it: its own normaliser
        moment_norms = {key: sum(w for r, w in zip(refs, weights) if key in r.moment_keys)
                        for key in sorted({k for r in refs for k in r.moment_keys})}
        delta_sums: dict[str, Tensor] = {n: t.zero_() for n, t in self._spare.items()}  # add_weighted adds into them
        self._spare = {}
        moment_sums: dict[str, Tensor] = {}
        bases = self._bases()
        topk = self._topk_names(bases)
        # contributor mean: Σ w of the senders per index; any top-k Δ: how many sent it (0, 1, 2 = more)
        support = {n: None for n in topk} if self.rounds.sparse_mean == "contributors" else {}
        senders: dict[str, Tensor | None] = {n: None for n in topk}
        lengths: list[float] | None = [] if self.diagnostics else None  # each reply's ||Δ_m|| (delta_retention)
        for ref, w, c in zip(refs, weights, clip):
            self._accumulate(ref, w, self.params, delta_sums, moment_sums, moment_norms, opt_step, bases, support,
                             senders, clip=c, lengths=lengths)
        overlap = support_overlap({n: s for n, s in senders.items() if s is not None})
        delta = {n: contributor_mean(delta_sums[n], support[n]) if n in support else delta_sums[n]
                 for n in self.params}
        moments = {k: moment_sums[k] for k in moment_norms}

        self._commit_downlink()  # before θ moves: the change the workers applied this round
        self.outer.lr = self.outer_lr(self.round)
        self.outer.step(self.params, delta)
        diagnostics = (subspace_diagnostics(delta, self.ranks, self.projection, self.projections)
                       if self.diagnostics else {})
        delta_norm = screening.norm_of(delta.values())
        if lengths:  # the length of Δ̄ against the replies'
            diagnostics["delta_retention"] = delta_norm / max(sum(w * n for w, n in zip(weights, lengths)), 1e-30)
        self.opt_step = opt_step
        if self.projection is not None and self.rounds.bases_from == "server":
            new = fit_projections(delta, self.ranks, self.projection, self.seed + 7919 * self.round, self.fit_device)
            if self.rotate:
                moments = self.rotated_moments(moments, self.projections, new)
            self.projections = new
        self.moments = moments
        self._relayed = relayed
        self._spare = delta_sums  # the outer step, the refit and the diagnostics keep none of them

        metrics = {
            "train_loss": sum(w * r.metrics.get("train_loss", math.nan) for r, w in zip(refs, weights)),
            "tokens": float(total),
            "delta_norm": delta_norm,
            "clients_ok": float(len(refs)),
            "clients_dropped": float(len(rejected)),
            **({"clients_clipped": float(sum(c < 1.0 for c in clip))} if self.rounds.clip_median else {}),
            **({"outer_lr": self.outer.lr} if self._lrs[0] != self._lrs[1] else {}),  # a late lr: the round's
            **diagnostics, **overlap,
            **{key: sum(w * r.metrics[key] for r, w in zip(refs, weights)) for key in DIAGNOSTIC_METRICS
               if all(key in r.metrics for r in refs)},
        }
        self.round += 1
        return RoundResult(self.global_state(), [r.worker_id for r in refs], rejected, metrics)

    def _relay_of(self, refs: Sequence[ReplyRef]) -> list[WorkerUpdate] | None:
        """The replies the next state relays (a relaying payload; None otherwise): each ref's reply
        as received (`ReplyRef.relayed`), its Δ only; ValueError if a ref has none, or another reply."""
        if self.payload is None or not self.payload.relay:
            return None
        missing = [r.worker_id for r in refs if r.relayed is None]
        if missing:
            raise ValueError(f"round {self.round}: a relaying payload needs every applied reply as received; "
                             f"none given for worker(s) {missing}")
        out = []
        for ref in refs:
            reply = ref.relayed()
            problem = ref.matches(reply)
            if problem is not None:
                raise ValueError(f"round {self.round}: the reply relayed for worker {ref.worker_id} is not the one "
                                 f"screened: {problem}")
            out.append(relayed_form(reply))
        return out

    def _accumulate(self, ref: ReplyRef, weight: float, names: Iterable[str], delta_sums: dict[str, Tensor],
                    moment_sums: dict[str, Tensor] | None = None, moment_norms: Mapping[str, float] | None = None,
                    opt_step: int = 0, bases: Mapping[str, tuple[Tensor, str]] | None = None,
                    support: dict[str, Tensor | None] | None = None, senders: dict[str, Tensor | None] | None = None,
                    clip: float = 1.0, lengths: list[float] | None = None) -> None:
        """Load one reply and add it into the accumulators: Δ of each of `names` with weight w_m
        (times `clip`, its median-clipping factor; the contributor mean's weights stay w_m; its
        clipped `screening.delta_norm` to `lengths` when given);
        each moment it carries with w_m / (Σ w of the replies carrying it), first moved from the
        reply's step count to the shared one S (a worker that joined late or lost its state has
        fewer steps; rescaling keeps its bias-corrected moments, `lordo_fed.optim.bias`); E as
        it is. A Δ sent as coordinates in this round's shared basis plus a residual (`bases`, a
        `lowrank+` preset) is first rebuilt, P·Ĉ + R̂ (lordo_fed.wire.lowrank.join).

        Its own function so that the loaded reply, and every tensor of it, is released when it
        returns, before the caller loads the next one."""
        update = ref.load()
        problem = ref.matches(update)
        if problem is not None:
            raise ValueError(f"round {self.round}: the reply loaded for worker {ref.worker_id} is not the one "
                             f"screened: {problem}")
        for name in names:
            d = update.delta[name]
            if bases and name in update.coords:
                d = lowrank.join(d.dense() if isinstance(d, SparseValues) else d, update.coords[name], *bases[name])
            add_weighted(delta_sums, name, d, weight * clip)
            if senders is not None and name in senders:  # the indices this reply sent (top-k: its non-zeros)
                add_sent(senders, support, name, d, weight)
        if lengths is not None:
            lengths.append(clip * screening.delta_norm(update))
        if moment_sums is None:  # round-0 gradients: Δ only
            return
        betas = self.round_betas()
        for key, value in update.moments.items():
            kind = split_moment_key(key)[0]
            if kind != "ef":
                value = restep(value, kind, update.opt_step, opt_step, betas, self.bias_correction)
            add_weighted(moment_sums, key, value, weight / moment_norms[key])

    def _topk_names(self, bases: Mapping[str, tuple[Tensor, str]]) -> list[str]:
        """The parameters whose Δ travels top-k alone (not rebuilt from coordinates in a shared basis,
        which is dense): their Δ̄ is a contributor mean with `rounds.sparse_mean='contributors'`, and
        their supports give `sparse_support_shared` whatever the mean."""
        if self.payload is None:
            return []
        return [n for n, p in self.params.items()
                if self.payload.delta_spec(n, tuple(p.shape)).kind == "topk" and n not in bases]

    def round_betas(self) -> tuple[float, float]:
        """The inner betas at the last local step of the current round (the two-phase recipe)."""
        last_step = self.rounds.steps_before(self.round + 1) - 1
        return self.switch_betas if 0 < self.switch_step <= last_step else self.betas

    # ----------------------------------------------------------------------------- projections
    @property
    def needs_gradient_init(self) -> bool:
        """LoRDO-Global with init_projection='gradient', before round 1's projections exist."""
        return self.projection is not None and bool(self.ranks) and not self.projections

    def gradient_request(self) -> GlobalState:
        """What workers get to compute the gradient the round-1 projections are fitted to."""
        return GlobalState(round=0, params=self.params)

    def init_projections(self, gradients: Sequence[WorkerUpdate], screened: bool = False) -> RoundResult:
        """Round-1 projections from decoded gradient replies (`init_projections_refs` over
        in-memory refs). `screened=True`: the caller already dropped what `screen_gradients()`
        refuses."""
        rejected: dict[int, str] = {}
        refs: list[ReplyRef] = []
        reasons = [None] * len(gradients) if screened else self.screen_gradients(gradients)
        for g, reason in zip(gradients, reasons):
            if reason:
                rejected[g.worker_id] = reason
                log.warning("initial projections: dropped gradient of worker %s: %s", g.worker_id, reason)
            else:
                refs.append(ReplyRef.of(g))
        return self.init_projections_refs(refs, rejected)

    @torch.no_grad()
    def init_projections_refs(self, refs: Sequence[ReplyRef], rejected: Mapping[int, str] | None = None) -> RoundResult:
        """Round-1 projections: top-r subspaces of the token-weighted mean gradient at θ0 (the
        full-batch gradient GaLore starts from). Each reply carries `delta` = its gradient of the
        low-rank parameters, round 0. As `aggregate_refs`: screened refs (`check_gradient`,
        `screen_gradient_round`), loaded one at a time in worker_id order."""
        rejected = dict(rejected or {})
        if not refs:
            raise RuntimeError(f"initial projections: no usable gradient ({rejected})")
        refs = sorted(refs, key=lambda r: r.worker_id)
        screening.check_refs(refs, 0)
        total = sum(g.tokens for g in refs)
        sums: dict[str, Tensor] = {}
        for ref in refs:
            self._accumulate(ref, ref.tokens / total, self.ranks, sums)
        mean = {n: sums[n] for n in self.ranks}
        self.projections = fit_projections(mean, self.ranks, self.projection, self.seed, self.fit_device)
        return RoundResult(self.global_state(), [g.worker_id for g in refs], rejected, {})

    def _basis(self, name: str) -> tuple[Tensor, str]:
        """This round's shared basis of `name` (fp32, CPU) and its side."""
        shape = tuple(self.params[name].shape)
        side = projection_side(shape)
        return self.projection.basis(self.projections[name], shape, side).float().cpu(), side

    def _bases(self) -> dict[str, tuple[Tensor, str]]:
        """The bases of `coords_expected()`, to rebuild Δ."""
        return {name: self._basis(name) for name in self.coords_expected()}

    def rotated_moments(self, moments: dict[str, Tensor], old: dict[str, Tensor],
                        new: dict[str, Tensor]) -> dict[str, Tensor]:
        """Averaged low-rank moments moved from the shared bases `old` into `new` at the current step
        count and betas (`bases.rotate_into`)."""
        return rotate_into(moments, {n: tuple(self.params[n].shape) for n in new}, self.projection, old, new,
                           self.opt_step, self.round_betas(), self.bias_correction)

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Tensor]:
        """Everything needed to resume: θ, outer state, projections, moments, counters (flat tensors)."""
        sd = {f"param/{k}": v for k, v in self.params.items()}
        sd.update({f"outer/{k}": v for k, v in self.outer.state_dict().items()})
        sd.update({f"proj/{k}": v for k, v in self.projections.items()})
        sd.update({f"moment/{k}": v for k, v in self.moments.items()})
        if self.client_params is not None:
            sd.update({f"client/{k}": v for k, v in self.client_params.items()})
        if self._relayed is not None:  # the replies the next state relays: the run resumes relaying
            sd.update(relay_checkpoint(self._relayed))
        sd["counter/round"] = torch.tensor(self.round)
        sd["counter/opt_step"] = torch.tensor(self.opt_step)
        return sd

    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Resume from `state_dict()`; θ's names and shapes must be the model's (ValueError)."""
        def part(prefix: str) -> dict[str, Tensor]:
            return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}

        params = part("param/")
        if set(params) != set(self.params):
            raise ValueError(f"checkpoint parameters differ from the model: missing "
                             f"{sorted(set(self.params) - set(params))}, unexpected {sorted(set(params) - set(self.params))}")
        for n, p in params.items():
            if tuple(p.shape) != tuple(self.params[n].shape):
                raise ValueError(f"checkpoint parameter {n} has shape {tuple(p.shape)}, model has {tuple(self.params[n].shape)}")
        # in the model's order, not the file's (safetensors sorts its names): sums over θ's tensors (Δ̄'s norm)
        # add in the order an uninterrupted run adds them, so a resumed run's records are its records to the bit
        self.params = {n: params[n].float().clone() for n in self.params}
        self.outer.load_state_dict(part("outer/"))
        saved = part("proj/")  # in the ranks' order too, as fit_projections makes them
        self.projections = {k: saved[k].clone() for k in [*(n for n in self.ranks if n in saved),
                                                          *(n for n in saved if n not in self.ranks)]}
        self.moments = {k: v.clone() for k, v in part("moment/").items()}
        self.round = int(sd["counter/round"])
        self.opt_step = int(sd["counter/opt_step"])
        self._encoded = None
        if self.client_params is not None:
            client = part("client/")
            if set(client) == set(self.params):
                self.client_params = {n: t.float().clone(memory_format=torch.contiguous_format) for n, t in client.items()}
            else:  # a checkpoint of a run without the compressed downlink: every worker gets θ whole once
                self.client_params = {n: p.clone(memory_format=torch.contiguous_format) for n, p in self.params.items()}
                self._resync_all = True
        if self.tracks_copy and self.payload.relay:  # without them (an older checkpoint) θ goes whole once
            self._relayed = relayed_from_checkpoint(sd, self.round, self.payload)

