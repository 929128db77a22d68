"""A worker: K ordinary local training steps between two synchronisations.

In the torchft spirit the round is a thin wrapper around a plain training loop: load the global
state, step the inner optimizer K times on this worker's data, report Δ = θ_ref − θ_local and the
optimizer states that are due. Everything in and out is plain tensors (`lordo_fed.wire.messages`), so the
same object runs inside the reference trainer and inside a Flower ClientApp.

Several workers may share one `nn.Module` when they run in turn (the reference trainer): θ is
loaded at the start of every round, and only the optimizer state is each worker's own.

On a node whose ranks shard the model (FSDP2; docs/algorithm.md, "Nodes of several ranks"), each
rank holds a chunk of θ and of the optimizer state: what comes in whole (θ, moments, E) is cut to
the rank's chunk, and what goes out (Δ, due moments, the saved state) is gathered whole, a
collective: every rank calls the same methods in the same order (`lordo_fed.rounds.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from lordo_fed.data import TokenShard
from lordo_fed.device import autocast
from lordo_fed.model import lm_loss
from lordo_fed.optim import LoRDO
from lordo_fed.optim.bias import restep
from lordo_fed.optim.ef_compress import ef_values
from lordo_fed.optim.config import InnerConfig, apply_phase, lr_at, set_lr
from lordo_fed.optim.rotation import rotate_moments
from lordo_fed.optim.projection import projection_side
from lordo_fed.wire.messages import MOMENT_KEYS, GlobalState, WorkerUpdate, moment_key
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.downlink import Downlink, ResyncNeeded
from lordo_fed.rounds import moments
from lordo_fed.rounds.ranks import NodeRanks
from lordo_fed.rounds.uplink import Uplink
from lordo_fed.rounds.sharding import (
    add_to_params, chunk_state, host_grads, host_params, optimizer_state_dict, set_params)
from lordo_fed.wire.compress import ErrorFeedback
from lordo_fed.wire.payload import PayloadCodecs

__all__ = ["ProgressFn", "ResyncNeeded", "Sent", "Worker"]  # ResyncNeeded: lordo_fed.rounds.downlink's

ProgressFn = Callable[[int, Tensor], None]
"""Called after every local step with its index and its loss, a device tensor (reading it is a
host sync: a progress bar should only count)."""


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


class Worker:
    """One data-parallel worker (a Flower client, or one of M workers run in turn)."""

    def __init__(
        self,
        worker_id: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        shard: TokenShard,
        inner: InnerConfig,
        rounds: RoundConfig,
        total_steps: int,
        batch_size: int,
        seq_len: int,
        data_seed: int = 0,
        payload: PayloadCodecs | None = None,
        ranks: NodeRanks | None = None,
    ):
        self.worker_id = worker_id
        self.model = model
        self.optimizer = optimizer
        self.shard = shard
        self.inner = inner
        self.rounds = rounds
        self.total_steps = total_steps
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.data_seed = data_seed
        self.cursor = 0  # index of the next batch of this shard: the whole data-loader state
        self.params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.ranks = ranks
        """A node of several ranks (`NodeRanks`): this rank trains its rows of the node's batch of
        N x `batch_size` windows, gradients averaged across the ranks every step."""
        self.forward_module = model if ranks is None else ranks.wrap(model)
        """What the local steps run forward through (the intra-node wrapper, or the model)."""
        self.payload = payload
        """Compressed payloads (lordo_fed.wire.payload): Δ sent with error feedback, moments quantised."""
        self.uplink = Uplink(payload)
        """What the worker sends, compressed per `payload` (Δ's residual kept for later rounds)."""
        self.downlink = Downlink(tracks=payload is not None and payload.down is not None)
        """θ of each round as the server sends it (with a compressed downlink, the clients' copy θ_c)."""
        self.sent: Sent | None = None
        """With `rounds.overlap_delay`: the round last sent, which the next round starts from."""

    @property
    def wire_ef(self) -> ErrorFeedback:
        """What compression left out of Δ so far, per parameter (`Uplink.ef`)."""
        return self.uplink.ef

    @property
    def client_params(self) -> dict[str, Tensor] | None:
        """With a compressed downlink: θ_c, the copy of θ the server's changes are added to (host fp32)."""
        return self.downlink.params

    @property
    def client_round(self) -> int:
        """The round whose state `client_params` is."""
        return self.downlink.round

    # ----------------------------------------------------------------------------- one round
    def train_round(self, state: GlobalState, progress: ProgressFn | None = None) -> WorkerUpdate:
        """Load `state`, run K local steps, return the update (Δ, due moments, tokens, metrics).

        With `rounds.overlap_delay` = τ > 0 and the previous round held (`sent`), the round is
        overlapped: its first τ steps start from the worker's own θ_send (`train_early`, which a
        node worker runs while the state is on its way), then `state` is merged in
        (`merge_global_state`) and the other K − τ steps follow. Δ is taken against `state`'s θ
        either way."""
        K = self.rounds.local_steps
        first_step = (state.round - 1) * K
        overlapped = self.overlapping(state.round) and (self.sent.early is not None or self.train_early(progress))
        if overlapped:
            early = self.sent.early
            start = self.merge_global_state(state)
        else:
            early = []
            # the hyperparameters the received moments were made with (the two-phase recipe)
            apply_phase(self.optimizer, self.inner, first_step - 1, reset=False)
            start = self.load_global_state(state)
        # θ at the start of the round, for Δ: the host tensors the parameters were loaded from
        # (no clone of the model on the device; the same values, p having been copied from them).
        theta_ref = {n: start[n].to(device="cpu", dtype=p.dtype) for n, p in self.params.items()}
        if isinstance(self.optimizer, LoRDO) and not overlapped:
            self.optimizer.update_split.clear()
        losses = early + self.local_steps(first_step + len(early), K - len(early),
                                          None if progress is None else lambda i, loss: progress(i + len(early), loss))
        if isinstance(self.optimizer, LoRDO):
            self.optimizer.sync_state()  # E whole before due_moments and the diagnostics read it
        # The update is what crosses the wire: plain fp32 CPU tensors.
        delta = self._host_params()  # θ after K steps, then Δ = θ_ref − θ in its memory: −θ + θ_ref
        theta_send = {n: d.clone() for n, d in delta.items()} if self.rounds.overlap_delay else None
        for n, d in delta.items():
            d.neg_().add_(theta_ref[n])
        due = self.due_moments(state.round)
        self.sent = None if theta_send is None else Sent(state.round, theta_send, dict(due), self._host_bases(),
                                                         self.opt_step())
        delta, due, coords = self.uplink.encode(delta, due, state.projections,
                                                lambda name: self.optimizer.basis(self.params[name]))
        return WorkerUpdate(
            worker_id=self.worker_id,
            round=state.round,
            delta=delta,
            moments=due,
            tokens=len(losses) * self.node_batch * self.seq_len,
            opt_step=self.opt_step(),
            metrics={"train_loss": sum(losses) / len(losses), "train_loss_last": losses[-1],
                     "lr": self.optimizer.param_groups[0]["lr"], **self.diagnostics(),
                     **({"overlap_steps": float(len(early))} if self.rounds.overlap_delay else {})},
            coords=coords,
        )

    # ----------------------------------------------------------------------------- overlap
    def overlapping(self, round_idx: int) -> bool:
        """Whether round `round_idx` is overlapped: τ > 0 and this worker holds round `round_idx`
        − 1 as it sent it (not after a restart without it, nor in round 1)."""
        return bool(self.rounds.overlap_delay) and self.sent is not None and self.sent.round == round_idx - 1

    def train_early(self, progress: ProgressFn | None = None) -> bool:
        """The next round's first τ local steps, from θ_send, before its global state is here
        (Streaming DiLoCo's overlap: a node worker runs them while the state is on its way).
        Returns whether it trained (not when nothing was sent, they are done, or the run's steps
        are all taken)."""
        sent, tau = self.sent, self.rounds.overlap_delay
        if not tau or sent is None or sent.early is not None:
            return False
        first = sent.round * self.rounds.local_steps
        if first + tau > self.total_steps:
            return False
        set_params(self.params, sent.theta)  # several workers may share one module (the reference trainer)
        if isinstance(self.optimizer, LoRDO):
            self.optimizer.update_split.clear()
        sent.early = self.local_steps(first, tau, progress)
        return True

    @torch.no_grad()
    def merge_global_state(self, state: GlobalState) -> dict[str, Tensor]:
        """Merge round r's global state into a worker τ steps into round r from its own θ_send
        (docs/algorithm.md, "Overlapping rounds"):

            θ ← θ_now + (θ_g − θ_send)
            u ← u_now + β1^τ (ū_g − u_send),   v ← max(v_now + β2^τ (v̄_g − v_send), 0)

        for the moments that came back averaged (each moment is an EMA, linear in where it
        started: this is the moment the τ steps would have produced from ū_g instead of u_send,
        up to the gradients). Under LoRDO-Global the new projections are set first: u_now, v_now
        rotate from the old basis to the new one with LDAdam's rule (`LoRDO.set_projection`),
        u_send, v_send are rotated by the same rule, and ū_g, v̄_g come in the new basis.
        Returns θ_g (host tensors, by name): Δ of the round is taken against it."""
        sent, tau = self.sent, len(self.sent.early or [])
        opt = self.optimizer
        if isinstance(opt, LoRDO):
            opt.sync_state()
        theta = self.downlink.theta(state, self.params)
        add_to_params(self.params, lambda name: theta[name].float() - sent.theta[name])
        moments.align_step_counts(opt, state.opt_step + tau)
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        moments.set_projections(opt, self.params, state)
        for name, kinds in moments.received(state).items():
            p, group = self.params[name], group_of[id(self.params[name])]
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
                st[kind].add_(chunk_state((value.float() - mine[kind]).mul_(decay).to(self.device), p, opt))
                if kind == "exp_avg_sq":
                    st[kind].clamp_min_(0.0)
        self.sent = None
        return theta

    def _host_bases(self) -> dict[str, Tensor]:
        """LoRDO: the current basis of each low-rank parameter that has one (host fp32)."""
        if not isinstance(self.optimizer, LoRDO):
            return {}
        out, low_rank = {}, {id(q) for q, _ in self.optimizer.low_rank_params()}
        for name, p in self.params.items():
            if id(p) in low_rank:
                basis = self.optimizer.basis(p)
                if basis is not None:
                    out[name] = basis.detach().to("cpu", torch.float32).clone()
        return out

    def diagnostics(self) -> dict[str, float]:
        """`lordo_fed.wire.messages.DIAGNOSTIC_METRICS` of the round just trained (empty unless the
        optimizer tracks them)."""
        opt = self.optimizer
        if not isinstance(opt, LoRDO) or not opt.track_update_split or not opt.update_split:
            return {}
        ratios = [float(out.sqrt() / inside.sqrt().clamp_min(1e-30)) for out, inside in opt.update_split]
        ef_sq = sum(float(ef_values(opt.state[p]).square().sum()) for p, _ in opt.low_rank_params()
                    if "ef" in opt.state[p] or "ef_val" in opt.state[p])
        return {"update_out_in_ratio": sum(ratios) / len(ratios), "update_out_in_ratio_last": ratios[-1],
                "ef_norm": ef_sq ** 0.5}

    def local_steps(self, first_step: int, num_steps: int, progress: ProgressFn | None = None) -> list[float]:
        """The ordinary training loop: `num_steps` steps from global step `first_step`."""
        self.model.train()
        losses: list[Tensor] = []  # device scalars, read once at the end: no host sync per step
        for i in range(num_steps):
            loss = self.forward_backward(self.cursor)
            self.cursor += 1
            self.clip_and_step(first_step + i)
            losses.append(loss)
            if progress is not None:
                progress(i, loss)
        if not losses:
            return []
        stacked = torch.stack(losses)
        return (stacked if self.ranks is None else self.ranks.mean(stacked)).tolist()  # the node's mean loss

    @property
    def node_batch(self) -> int:
        """Windows per step of the whole node: `batch_size` per rank times its ranks."""
        return self.batch_size * (1 if self.ranks is None else self.ranks.world)

    def gradient(self, state: GlobalState, names: list[str]) -> WorkerUpdate:
        """The gradient at the given θ of this worker's next batch (the cursor does not move: the
        batch is trained on in round 1), for `names`: what LoRDO-Global's round-1 projections are
        fitted to (Aggregator.init_projections)."""
        set_params(self.params, state.params)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(self.cursor)
        grads = host_grads(self.params, names)
        self.optimizer.zero_grad(set_to_none=True)
        return WorkerUpdate(worker_id=self.worker_id, round=0, delta=grads, moments={},
                            tokens=self.node_batch * self.seq_len, opt_step=0, metrics={"loss": float(loss)})

    def forward_backward(self, batch_index: int, scale: float = 1.0) -> Tensor:
        """Loss (a detached device scalar: not read here, so no host sync) and gradient (accumulated,
        times `scale`) of this shard's batch `batch_index`."""
        x, y = self.shard.batch(batch_index, self.node_batch, self.seq_len, seed=self.data_seed)
        if self.ranks is not None:
            x, y = self.ranks.rows((x, y))
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with autocast(self.device):
            loss = lm_loss(self.forward_module, x, y)
        (loss * scale).backward()
        return loss.detach().float()

    def clip_and_step(self, global_step: int) -> None:
        """Clip the global gradient norm, set the phase and the scheduled lr, step, clear the gradients."""
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
        apply_phase(self.optimizer, self.inner, global_step)
        set_lr(self.optimizer, lr_at(global_step, self.total_steps, self.inner))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------------------- state in
    @torch.no_grad()
    def load_global_state(self, state: GlobalState) -> dict[str, Tensor]:
        """θ ← global θ; step counts ← the shared one; new projections (rotating local moments);
        then the averaged moments (`lordo_fed.rounds.moments`: every moment this worker keeps is
        first moved to the server's count `state.opt_step`, which differs after a round the
        server skipped, or for a worker that joined late).

        With a compressed downlink (`state.params_delta`) the state carries the change of the
        clients' copy θ_c since the previous round: it is added to the copy this worker holds,
        which must be that round's (else `ResyncNeeded`: the server sends θ_c whole next time).
        Returns θ as loaded (host tensors, by name)."""
        theta = self.downlink.theta(state, self.params)
        set_params(self.params, theta)
        moments.align_step_counts(self.optimizer, state.opt_step)
        moments.set_projections(self.optimizer, self.params, state)
        moments.adopt(self.optimizer, self.params, state, self.device)
        return theta

    def _host_params(self) -> dict[str, Tensor]:
        """θ as whole fp32 host tensors that own their memory (gathered when sharded)."""
        return host_params(self.params)

    # ----------------------------------------------------------------------------- state out
    def due_moments(self, round_idx: int) -> dict[str, Tensor]:
        """The states this worker sends after round `round_idx` (`moments.due`)."""
        return moments.due(self.optimizer, self.params, self.rounds, round_idx)

    def opt_step(self) -> int:
        """This worker's step count (`moments.step_count`)."""
        return moments.step_count(self.optimizer)

    def state_dict(self) -> dict:
        """What stays on the worker between rounds: optimizer (EF buffer, moments not due), data
        cursor and, with a compressed payload, Δ's compression residual and the clients' copy θ_c."""
        return {"optimizer": optimizer_state_dict(self.optimizer, self.optimizer.state_dict(), cut=False),
                "cursor": torch.tensor(self.cursor),
                "wire_ef": self.wire_ef.state_dict(), **self.downlink.state_dict(), **self._sent_state()}

    def _sent_state(self) -> dict:
        """`sent` as flat tensors ('sent/theta/<param>', 'sent/m/<moment key>', 'sent/basis/<param>')
        and its counters (the early steps are not kept: a restarted worker trains them again)."""
        s = self.sent
        if s is None:
            return {}
        tensors = {f"sent/theta/{n}": t for n, t in s.theta.items()}
        tensors.update({f"sent/m/{k}": t for k, t in s.moments.items()})
        tensors.update({f"sent/basis/{n}": t for n, t in s.bases.items()})
        return {"sent": tensors, "sent_meta": {"round": s.round, "opt_step": s.opt_step}}

    def _load_sent(self, tensors: dict[str, Tensor], meta: dict | None) -> None:
        if not meta:
            self.sent = None
            return
        parts: dict[str, dict[str, Tensor]] = {"theta": {}, "m": {}, "basis": {}}
        for key, value in tensors.items():
            _, part, name = key.split("/", 2)
            parts[part][name] = value.float().clone()
        self.sent = Sent(int(meta["round"]), parts["theta"], parts["m"], parts["basis"], int(meta["opt_step"]))

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(optimizer_state_dict(self.optimizer, sd["optimizer"], cut=True))
        self.cursor = int(sd["cursor"])
        self.wire_ef.load_state_dict(sd.get("wire_ef", {}))
        self.downlink.load_state_dict(sd)
        self._load_sent(sd.get("sent", {}), sd.get("sent_meta"))

    def flat_state(self) -> tuple[dict[str, Tensor], dict]:
        """`state_dict()` as flat named tensors plus JSON-able metadata (safetensors, Flower records)."""
        sd = optimizer_state_dict(self.optimizer, self.optimizer.state_dict(), cut=False)
        tensors = {f"opt/{pid}/{key}": value for pid, st in sd["state"].items() for key, value in st.items()}
        tensors.update(self.wire_ef.state_dict())  # "wire_ef/<param>"
        tensors.update({f"client/{n}": t for n, t in (self.downlink.params or {}).items()})
        sent = self._sent_state()
        tensors.update(sent.get("sent", {}))
        return tensors, {"param_groups": sd["param_groups"], "cursor": self.cursor, "client_round": self.downlink.round,
                         "sent": sent.get("sent_meta")}

    def load_flat_state(self, tensors: dict[str, Tensor], meta: dict) -> None:
        state: dict[int, dict[str, Tensor]] = {}
        wire_ef, client, sent = {}, {}, {}
        for key, value in tensors.items():
            if key.startswith("sent/"):
                sent[key] = value
                continue
            if key.startswith("wire_ef/"):
                wire_ef[key] = value
                continue
            if key.startswith("client/"):
                client[key.removeprefix("client/")] = value
                continue
            _, pid, name = key.split("/", 2)
            state.setdefault(int(pid), {})[name] = value
        self.load_state_dict({"optimizer": {"state": state, "param_groups": meta["param_groups"]},
                              "cursor": meta["cursor"], "wire_ef": wire_ef, "client": client,
                              "client_round": meta.get("client_round", 0), "sent": sent,
                              "sent_meta": meta.get("sent")})
