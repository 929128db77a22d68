"""A worker: K ordinary local training steps between two synchronisations.

In the torchft spirit the round is a thin wrapper around a plain training loop: load the global
state, step the inner optimizer K times on this worker's data, report Δ = θ_ref − θ_local and the
optimizer states that are due (Jovanović et al., "LoRDO"; docs/algorithm.md). Everything in and
out is plain tensors (`lordo_fed.wire.messages`), so the same object runs inside the reference
trainer and inside a Flower ClientApp.

Several workers may share one `nn.Module` when they run in turn (the reference trainer): θ is
loaded at the start of every round, and only the optimizer state is each worker's own.

What is not the loop lives beside it, each in its own module of `lordo_fed.rounds`:
- `moments`: the optimizer state exchanged with the server (projections, moments, step counts);
- `downlink`: θ as the server sends it, with a compressed downlink the clients' copy θ_c;
- `uplink`: what the worker sends, compressed with error feedback;
- `overlap`: overlapped rounds (`rounds.overlap_delay`), the round sent and the merge;
- `sharding`: whole tensors in and out of a node whose ranks shard the model (FSDP2), where
  every rank calls the same methods in the same order (the gathers are collectives);
- `ranks`: what the worker needs of a node of several ranks (`NodeRanks`);
- `worker_state`: the saved state as flat named tensors plus metadata.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lordo_fed.data import TokenShard
from lordo_fed.device import autocast
from lordo_fed.model import lm_loss
from lordo_fed.optim import LoRDO
from lordo_fed.optim.config import InnerConfig, apply_phase, lr_at, set_lr
from lordo_fed.optim.ef_compress import ef_values
from lordo_fed.rounds import moments, worker_state
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.downlink import Downlink, ResyncNeeded
from lordo_fed.rounds.overlap import Overlap, Sent
from lordo_fed.rounds.ranks import NodeRanks
from lordo_fed.rounds.sharding import host_grads, host_params, optimizer_state_dict, set_params
from lordo_fed.rounds.uplink import Uplink
from lordo_fed.wire.compress import ErrorFeedback
from lordo_fed.wire.messages import GlobalState, WorkerUpdate
from lordo_fed.wire.payload import PayloadCodecs

__all__ = ["ProgressFn", "ResyncNeeded", "Sent", "Worker"]  # ResyncNeeded, Sent: re-exported

ProgressFn = Callable[[int, Tensor], None]
"""Called after every local step with its index and its loss, a device tensor (reading it is a
host sync: a progress bar should only count)."""


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
        self.uplink = Uplink(payload, rounds.wire_ef_decay)
        """What the worker sends, compressed per `payload` (Δ's residual kept for later rounds)."""
        self.downlink = Downlink(payload, rounds)
        """θ of each round as the server sends it (with a compressed downlink, the clients' copy θ_c)."""
        if rounds.bases_from == "downlink" and isinstance(optimizer, LoRDO):  # keeps the change the bases fit
            low_rank = {id(p) for p, _ in optimizer.low_rank_params()}
            self.downlink.keep = frozenset(n for n, p in self.params.items() if id(p) in low_rank)
        self.overlap = Overlap(rounds, total_steps)
        """With `rounds.overlap_delay`: the round last sent, which the next round starts from."""

    @property
    def sent(self) -> Sent | None:
        """With `rounds.overlap_delay`: the round last sent (`Overlap.sent`)."""
        return self.overlap.sent

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
        K = self.rounds.steps_of(state.round)
        first_step = self.rounds.steps_before(state.round)
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
        self.overlap.keep(state.round, theta_send, due, self.optimizer, self.params)
        ef_scale = (self.rounds.lr_fall(state.round, lambda step: lr_at(step, self.total_steps, self.inner))
                    if self.rounds.wire_ef_lr_scale else 1.0)
        delta, due, coords = self.uplink.encode(delta, due, state.projections,
                                                lambda name: self.optimizer.basis(self.params[name]), ef_scale)
        update = WorkerUpdate(
            worker_id=self.worker_id,
            round=state.round,
            delta=delta,
            moments=due,
            tokens=len(losses) * self.node_batch * self.seq_len,
            opt_step=self.opt_step(),
            metrics={"train_loss": sum(losses) / len(losses), "train_loss_last": losses[-1],
                     "lr": self.optimizer.param_groups[0]["lr"], **self.diagnostics(),
                     **({"overlap_steps": float(len(early))} if self.rounds.overlap_delay else {}),
                     **({"wire_ef_ratio": self.uplink.ef_ratio} if self.uplink.ef_ratio is not None else {}),
                     **({"sparse_reselected": self.uplink.reselected} if self.uplink.reselected is not None else {})},
            coords=coords,
        )
        self.downlink.keep_reply(update)  # a relaying payload: the next state leaves it out
        return update

    @torch.no_grad()
    def load_global_state(self, state: GlobalState) -> dict[str, Tensor]:
        """θ ← global θ; step counts ← the shared one; new projections (rotating local moments; with
        `rounds.bases_from='downlink'` fitted here to the change of θ_c the state carried);
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
        change = self.downlink.take_change()  # empty unless the workers fit the bases (bases_from='downlink')
        if change:
            moments.fit_bases(self.optimizer, self.params, change, state.round - 1)
        moments.adopt(self.optimizer, self.params, state, self.device)
        return theta

    def overlapping(self, round_idx: int) -> bool:
        """Whether round `round_idx` is overlapped (`Overlap.overlapping`)."""
        return self.overlap.overlapping(round_idx)

    def train_early(self, progress: ProgressFn | None = None) -> bool:
        """The next round's first τ local steps, from θ_send, before its global state is here
        (Streaming DiLoCo's overlap: a node worker runs them while the state is on its way).
        Returns whether it trained (not when nothing was sent, they are done, or the run's steps
        are all taken)."""
        first = self.overlap.early_start()
        if first is None:
            return False
        set_params(self.params, self.sent.theta)  # several workers may share one module (the reference trainer)
        if isinstance(self.optimizer, LoRDO):
            self.optimizer.update_split.clear()
        self.sent.early = self.local_steps(first, self.rounds.overlap_delay, progress)
        return True

    def merge_global_state(self, state: GlobalState) -> dict[str, Tensor]:
        """Merge round r's global state into this worker, τ steps into round r from its own θ_send
        (`Overlap.merge`: θ ← θ_now + (θ_g − θ_send), the averaged moments likewise). Returns θ_g
        (host tensors, by name): Δ of the round is taken against it."""
        return self.overlap.merge(state, self.downlink, self.optimizer, self.params, self.device)

    # ----------------------------------------------------------------------------- the local steps
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

    @property
    def node_batch(self) -> int:
        """Windows per step of the whole node: `batch_size` per rank times its ranks."""
        return self.batch_size * (1 if self.ranks is None else self.ranks.world)

    # ----------------------------------------------------------------------------- what goes out
    def _host_params(self) -> dict[str, Tensor]:
        """θ as whole fp32 host tensors that own their memory (gathered when sharded)."""
        return host_params(self.params)

    def due_moments(self, round_idx: int) -> dict[str, Tensor]:
        """The states this worker sends after round `round_idx` (`moments.due`)."""
        return moments.due(self.optimizer, self.params, self.rounds, round_idx)

    def opt_step(self) -> int:
        """This worker's step count (`moments.step_count`)."""
        return moments.step_count(self.optimizer)

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

    # ----------------------------------------------------------------------------- saved state
    def state_dict(self) -> dict:
        """What stays on the worker between rounds: optimizer (EF buffer, moments not due), data
        cursor and, with a compressed payload, Δ's compression residual and the clients' copy θ_c;
        with overlapped rounds, the round sent."""
        return {"optimizer": optimizer_state_dict(self.optimizer, self.optimizer.state_dict(), cut=False),
                "cursor": torch.tensor(self.cursor),
                "wire_ef": self.wire_ef.state_dict(), **self.downlink.state_dict(), **self.overlap.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(optimizer_state_dict(self.optimizer, sd["optimizer"], cut=True))
        self.cursor = int(sd["cursor"])
        self.wire_ef.load_state_dict(sd.get("wire_ef", {}))
        self.downlink.load_state_dict(sd)
        self.overlap.load_state_dict(sd)

    def flat_state(self) -> tuple[dict[str, Tensor], dict]:
        """`state_dict()` as flat named tensors plus JSON-able metadata (safetensors, Flower records:
        `lordo_fed.rounds.worker_state`)."""
        return worker_state.flatten(self.state_dict())

    def load_flat_state(self, tensors: dict[str, Tensor], meta: dict) -> None:
        self.load_state_dict(worker_state.unflatten(tensors, meta))
