"""Overlapped rounds: Streaming DiLoCo's overlap of communication with the next round's first steps.

In a synchronous round a worker idles while its Δ goes up, the server aggregates and the next
state comes down. With `RoundConfig.overlap_delay` = τ > 0 a worker that has sent round r goes
straight on with round r+1's first τ local steps from its own θ_send, and merges round r+1's
global state when it is there (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication", its outer step with delay τ; docs/algorithm.md, "Overlapping rounds", has the
decisions). What a worker keeps of the round it sent is `Sent`, saved with its state, so a worker
restarted between rounds trains the early steps again and the run stays bit-identical. The early
steps themselves are ordinary local steps (`Worker.train_early`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lordo_fed.optim import LoRDO
from lordo_fed.optim.bias import restep
from lordo_fed.optim.projection import projection_side
from lordo_fed.optim.rotation import rotate_moments
from lordo_fed.rounds import moments
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.downlink import Downlink
from lordo_fed.rounds.sharding import add_to_params, chunk_state
from lordo_fed.wire.messages import MOMENT_KEYS, GlobalState, moment_key


@dataclass
class Sent:
    """What a worker keeps of the round it last sent, for an overlapped next round
    (`RoundConfig.overlap_delay`): the point its next round starts from and what the merge with
    the server's answer subtracts (docs/algorithm.md, "Overlapping rounds")."""

    round: int
    """The round sent."""
    theta: dict[str, Tensor]
    """θ_send: the worker's θ when it sent (host fp32)."""
    moments: dict[str, Tensor]
    """The moments it sent (`moment_key` -> host fp32, before compression), at step count `opt_step`."""
    bases: dict[str, Tensor]
    """LoRDO: the basis each low-rank parameter's moments were in (host fp32)."""
    opt_step: int
    """The worker's step count when it sent."""
    early: list[float] | None = None
    """The losses of the next round's first τ steps, once they are trained (None: not yet)."""


def host_bases(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """LoRDO: the current basis of each low-rank parameter that has one (host fp32)."""
    if not isinstance(optimizer, LoRDO):
        return {}
    out, low_rank = {}, {id(q) for q, _ in optimizer.low_rank_params()}
    for name, p in params.items():
        if id(p) in low_rank:
            basis = optimizer.basis(p)
            if basis is not None:
                out[name] = basis.detach().to("cpu", torch.float32).clone()
    return out


class Overlap:
    """A worker's overlapped rounds: the round it last sent (`sent`), when the early steps are due,
    and the merge of the global state into a worker τ steps on."""

    def __init__(self, rounds: RoundConfig, total_steps: int) -> None:
        self.rounds = rounds
        """τ (`overlap_delay`) and K (`local_steps`)."""
        self.total_steps = total_steps
        """The run's local steps: early steps never run past them."""
        self.sent: Sent | None = None
        """With τ > 0: the round last sent, which the next round starts from."""

    def overlapping(self, round_idx: int) -> bool:
        """Whether round `round_idx` is overlapped: τ > 0 and this worker holds round `round_idx`
        − 1 as it sent it (not after a restart without it, nor in round 1)."""
        return bool(self.rounds.overlap_delay) and self.sent is not None and self.sent.round == round_idx - 1

    def early_start(self) -> int | None:
        """The global step the next round's τ early steps start at, if they are due: None when
        nothing was sent, they are trained, or they would run past the run's steps."""
        sent, tau = self.sent, self.rounds.overlap_delay
        if not tau or sent is None or sent.early is not None:
            return None
        first = self.rounds.steps_before(sent.round + 1)
        if first + tau > self.total_steps:
            return None
        return first

    def keep(self, round_idx: int, theta: dict[str, Tensor] | None, due: dict[str, Tensor],
             optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor]) -> None:
        """Remember round `round_idx` as sent: θ_send `theta` (None: τ = 0, nothing is kept), the
        moments `due` (before compression), their bases and the step count."""
        self.sent = None if theta is None else Sent(round_idx, theta, dict(due), host_bases(optimizer, params),
                                                    moments.step_count(optimizer))

    @torch.no_grad()
    def merge(self, state: GlobalState, downlink: Downlink, optimizer: torch.optim.Optimizer,
              params: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
        """Merge round r's global state into a worker τ steps into round r from its own θ_send
        (docs/algorithm.md, "Overlapping rounds"):

            θ ← θ_now + (θ_g − θ_send)
            u ← u_now + β1^τ (ū_g − u_send),   v ← max(v_now + β2^τ (v̄_g − v_send), 0)

        for the moments that came back averaged (each moment is an EMA, linear in where it
        started: this is the moment the τ steps would have produced from ū_g instead of u_send,
        up to the gradients). Streaming DiLoCo mixes θ ← α θ_now + (1−α) θ_g instead; the delta
        rule keeps every early step. Under LoRDO-Global the new projections are set first: u_now,
        v_now rotate from the old basis to the new one with LDAdam's rule (Robert et al. 2024,
        "LDAdam", Alg. 1; `LoRDO.set_projection`), u_send, v_send are rotated by the same rule,
        and ū_g, v̄_g come in the new basis. θ_g is what `downlink` makes of `state`.
        Returns θ_g (host tensors, by name): Δ of the round is taken against it."""
        sent, tau = self.sent, len(self.sent.early or [])
        opt = optimizer
        if isinstance(opt, LoRDO):
            opt.sync_state()
        theta = downlink.theta(state, params)
        add_to_params(params, lambda name: theta[name].float() - sent.theta[name])
        moments.align_step_counts(opt, state.opt_step + tau)
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        moments.set_projections(opt, params, state)
        change = downlink.take_change()  # empty unless the workers fit the bases (bases_from='downlink')
        if change:
            moments.fit_bases(opt, params, change, state.round - 1)
        for name, kinds in moments.received(state).items():
            p, group = params[name], group_of[id(params[name])]
            st = opt.state.get(p, {})
            mine = {k: sent.moments[moment_key(k, name)] for k in MOMENT_KEYS if moment_key(k, name) in sent.moments}
            if "ef" in kinds or not mine or not all(k in st for k in kinds):
                continue  # nothing of its own was sent (it started afresh): it keeps its own moments
            betas, bias = group["betas"], group.get("bias_correction", True)
            mine = {k: restep(v, k, sent.opt_step, state.opt_step, betas, bias) for k, v in mine.items()}
            if name in state.projections and name in sent.bases and group.get("rotate", True):
                new_basis = opt.basis(p).detach().to("cpu", torch.float32)
                u, v = rotate_moments(mine.get("exp_avg"), mine.get("exp_avg_sq"), sent.bases[name], new_basis,
                                      projection_side(p.shape), state.opt_step, betas, bias)
                mine = {k: t for k, t in (("exp_avg", u), ("exp_avg_sq", v)) if t is not None}
            for kind, value in kinds.items():
                if kind not in mine:
                    continue
                decay = betas[0 if kind == "exp_avg" else 1] ** tau
                st[kind].add_(chunk_state((value.float() - mine[kind]).mul_(decay).to(device), p, opt))
                if kind == "exp_avg_sq":
                    st[kind].clamp_min_(0.0)
        self.sent = None
        return theta

    def state_dict(self) -> dict:
        """`sent` as flat tensors ('sent/theta/<param>', 'sent/m/<moment key>', 'sent/basis/<param>')
        under 'sent' and its counters under 'sent_meta' (empty when nothing is held; the early
        steps are not kept: a restarted worker trains them again)."""
        s = self.sent
        if s is None:
            return {}
        tensors = {f"sent/theta/{n}": t for n, t in s.theta.items()}
        tensors.update({f"sent/m/{k}": t for k, t in s.moments.items()})
        tensors.update({f"sent/basis/{n}": t for n, t in s.bases.items()})
        return {"sent": tensors, "sent_meta": {"round": s.round, "opt_step": s.opt_step}}

    def load_state_dict(self, sd: Mapping) -> None:
        """`sent` from a worker's state dict (`state_dict`; none when its 'sent_meta' is absent)."""
        tensors, meta = sd.get("sent", {}), sd.get("sent_meta")
        if not meta:
            self.sent = None
            return
        parts: dict[str, dict[str, Tensor]] = {"theta": {}, "m": {}, "basis": {}}
        for key, value in tensors.items():
            _, part, name = key.split("/", 2)
            parts[part][name] = value.float().clone()
        self.sent = Sent(int(meta["round"]), parts["theta"], parts["m"], parts["basis"], int(meta["opt_step"]))
