"""LoRDO's step with same-shaped matrices stacked (the stacking idea of DASH / Distributed Shampoo).

`lordo_fed.optim.lordo.LoRDO` is the readable reference: a Python loop of ~15 kernels per
parameter (about 2,000 launches per step at 125M on a GPU). This class does the same mathematics
on stacks: every low-rank weight of one shape (hence one projection side) in a param group keeps
its error-feedback buffer E, its moments and its basis in one [n, ...] tensor, so projection,
moments, back-projection and the QH term are a handful of batched kernels per shape, and every
parameter that is not low-rank takes torch's foreach kernels. Arithmetic is in place where the
reference allocates, and the update goes straight into the parameters with no full-size
temporary. The two full-size passes of a matrix run one matrix at a time, so that each reads what
the previous kernel just wrote while it is still in cache (a 16m matrix is 0.25-0.7 MB; the
stacks are 13 MB): V = G + γE then g = proj(V); and back(û/d) as an `addmm_` into the parameter
(its beta applies the weight decay) then the full-rank term c·V as an `addcmul_`. On the
16m CPU benchmark that ordering took the step from 5.8 to 5.4 ms against 3 stacked `bmm`s.

E in fp32 is kept lazily while the basis B stays fixed: its memory holds W and a small h with
E = W − back(h). A step then forms V = G + γE as W ← γW + G, h ← γh (V = W − back(h)); projects
g = proj(V) = proj(W) − h (B is orthonormal); applies the full-rank term as c·W and folds −c·h into
the back-projected low-rank update; and records E ← V − back(g) as h ← h + g: two rank-r products
per matrix instead of the reference's three (the third is what E's back-projection costs), and
about as many full-size passes as AdamW. E is written out whole (W ← W − back(h)) before the basis
changes (`set_projection`), before the reference path or a rebuilt stack reads it, and by
`sync_state()`, which `state_dict()`, pickling and the worker (after its local steps) call:
code that reads `optimizer.state` directly mid-round calls it first.
A compressed E (`ef_density` < 1) is expanded into one temporary V per stack and compressed again
one matrix at a time.

State stays per parameter, with the reference's keys, shapes and dtypes (checkpoints, the wire
and `LoRDO` itself read it unchanged): each entry is a view into its stack. An entry that is not
a view of the current stack (the first step, after `load_state_dict`, after `set_projection`
rotated the moments, after the worker adopted averaged moments) is copied into a new stack at the
next step; that is a round-boundary cost, not a per-step one.

A bf16 or compressed E is whole after every step (E ← V − back(g) in V's memory, then stored).
Falls back to the reference, per parameter: LoRDO-Local at its refit steps (an SVD per matrix;
the steps in between are batched) and the `track_update_split` diagnostic. Equality with the
reference to fp32 rounding, for every option, is tests/unit/test_batched.py; on CUDA,
tests/gpu/test_cuda.py. Parameters sharded by FSDP2 step on their chunks (`sharded.py`): the stacks hold
chunks, and s is one all-reduce per stack. No host sync: step counts are CPU scalars (stacked like the rest: one add per
stack, not one per parameter), the QH normaliser s stays a tensor.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from lordo_fed.optim.ef_compress import EF_KEYS, add_decompressed, compress, empty_compressed
from lordo_fed.optim.lordo import EF_DTYPES, LoRDO, bias_corrections
from lordo_fed.optim.sharded import coords_mean, local
from lordo_fed.optim.projection import Side, projection_side


def _project(v: Tensor, basis: Tensor, side: Side) -> Tensor:
    """`projection.project` on stacks: [n, p, q] -> [n, p, r] (right) or [n, r, q] (left)."""
    return torch.bmm(v, basis.mT) if side == "right" else torch.bmm(basis.mT, v)


def _project_back(low: Tensor, basis: Tensor, side: Side) -> Tensor:
    """`projection.project_back` on stacks: low-rank coordinates -> [n, p, q]."""
    return torch.bmm(low, basis) if side == "right" else torch.bmm(basis, low)


class _Stack:
    """A [n, ...] tensor and the per-parameter views handed out as state entries."""

    __slots__ = ("tensor", "views", "sources")

    def __init__(self, tensor: Tensor, sources: list[tuple[Tensor, int]] | None = None):
        self.tensor = tensor
        self.views = list(tensor.unbind(0))
        self.sources = sources  # for derived stacks (bases): (tensor, version) they were built from


class BatchedLoRDO(LoRDO):
    """`LoRDO` with a batched step: same arguments, state, checkpoints and results (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._stacks: dict[tuple, _Stack] = {}
        self._pending: dict[tuple, tuple[Tensor, Tensor, Side]] = {}
        """E of a stack held lazily as W − back(h): stack ident -> (h, the basis h is in, side)."""
        super().__init__(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle see E whole
        self.sync_state()
        return super().__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:  # deepcopy / pickle / load: stacks are rebuilt
        super().__setstate__(state)
        self._stacks = {}
        self._pending = {}

    # ----------------------------------------------------------------------------- lazy E
    def sync_state(self) -> None:
        """Write every error-feedback buffer out whole (E = W − back(h), see `_low_rank_batched`)."""
        for ident in list(self._pending):
            self._materialize(ident)

    def _materialize(self, ident: tuple) -> None:
        h, basis, side = self._pending.pop(ident)
        w = self._stacks[ident].tensor
        if side == "right":
            w.baddbmm_(h, basis, alpha=-1)
        else:
            w.baddbmm_(basis, h, alpha=-1)

    def _materialize_holding(self, param: Tensor) -> None:
        """Materialise the lazy E of every stack `param` belongs to."""
        for ident in [k for k in self._pending if id(param) in k[1]]:
            self._materialize(ident)

    def state_dict(self) -> dict[str, Any]:  # noqa: D102 (E written out whole first)
        self.sync_state()
        return super().state_dict()

    def set_projection(self, param: Tensor, stored: Tensor) -> None:  # noqa: D102 (E whole in the old basis first)
        self._materialize_holding(param)
        super().set_projection(param, stored)

    # ----------------------------------------------------------------------------- stacks
    def _stacked(self, params: list[Tensor], key: str, make: Callable[[Tensor], Tensor]) -> Tensor:
        """The stack behind `state[p][key]` for `params`, each entry a view of it; (re)built, copying
        the entries in, when an entry is missing or is not the view this stack handed out."""
        ident = (key, tuple(id(p) for p in params))
        stack = self._stacks.get(ident)
        states = [self.state[p] for p in params]
        if stack is not None and all(st.get(key) is v for st, v in zip(states, stack.views)):
            return stack.tensor
        for other in [k for k in self._pending if k[0] == key and set(k[1]) & set(ident[1])]:
            self._materialize(other)  # the entries copied below must hold E, not W
        stack = _Stack(torch.stack([st[key] if key in st else make(p) for st, p in zip(states, params)]))
        for st, view in zip(states, stack.views):
            st[key] = view
        self._forget_overlapping(ident)
        self._stacks[ident] = stack
        return stack.tensor

    def _forget_overlapping(self, ident: tuple) -> None:
        """Drop cached stacks of the same key that share a parameter with `ident` (the set of
        parameters with gradients changed): their memory is not held past the state's use of it."""
        key, members = ident[0], set(ident[1])
        for other in [k for k in self._stacks if k[0] == key and k != ident and members.intersection(k[1])]:
            del self._stacks[other]

    def _bases(self, params: list[Tensor], group: dict[str, Any], side: Side) -> Tensor:
        """Stacked orthonormal bases of `params`, rebuilt only when a stored projection changed
        (`set_projection` replaces the tensor; an in-place edit bumps its version)."""
        ident = ("basis", tuple(id(p) for p in params))
        stack = self._stacks.get(ident)
        stored = [self.state[p]["proj"] for p in params]
        if stack is not None and all(s is t and s._version == v for s, (t, v) in zip(stored, stack.sources)):
            return stack.tensor
        method = self._method(group["proj_method"])
        shape = params[0].shape
        stack = _Stack(torch.stack([method.basis(s, shape, side) for s in stored]), [(s, s._version) for s in stored])
        self._forget_overlapping(ident)
        self._stacks[ident] = stack
        return stack.tensor

    # ----------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer.step)
        if self.track_update_split:
            self.sync_state()
            return super().step(closure)  # the diagnostic's per-matrix sums: the reference path
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # parameters that step together: same group and step count (and shape, for low-rank ones)
        full: dict[tuple, list[Tensor]] = {}
        low: dict[tuple, list[Tensor]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for group, index, p in self._params_with_grads():
            groups[id(group)] = group
            state = self.state[p]
            self._init_step(state, p)
            k = int(state["step"].item())  # a CPU scalar: no device sync
            if not self.is_low_rank(p, group):
                full.setdefault((id(group), k, p.device, p.dtype), []).append(p)
                continue
            if group["projection_source"] == "local" and ("proj" not in state or k % group["proj_interval"] == 0):
                self._materialize_holding(p)
                self._low_rank_step(p, group, index, None)  # a refit: per matrix, the reference
                continue
            if "proj" not in state:
                raise RuntimeError(
                    f"LoRDO: low-rank parameter #{index} of shape {tuple(p.shape)} has no projection; with "
                    "projection_source='global' call set_projection() before the first step")
            low.setdefault((id(group), k, tuple(p.shape), p.device, p.dtype), []).append(p)
        for (g, k, *_), params in full.items():
            self._full_rank_foreach(params, groups[g], k)
        for (g, k, *_), params in low.items():
            self._low_rank_batched(params, groups[g], k)
        return loss

    def _full_rank_foreach(self, params: list[Tensor], group: dict[str, Any], k_before: int) -> None:
        """`LoRDO._full_rank_step` for many parameters at once (QHAdam; ω = 1 is Adam(W))."""
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(local(p), dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(local(p), dtype=torch.float32, memory_format=torch.preserve_format)
        grads = _fp32_grads(params)
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        beta1, beta2 = group["betas"]
        lr, omega, eps = group["lr"], group["omega"], group["eps"]
        self._stacked(params, "step", _zero_step).add_(1)
        params = [local(p) for p in params]  # a sharded parameter: this rank's chunk (elementwise)
        bc1, bc2 = bias_corrections(group, k_before + 1)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, math.sqrt(bc2))
        torch._foreach_add_(denoms, eps)
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        if omega == 1.0 and params[0].dtype == torch.float32:
            torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-lr / bc1)  # Adam's exact expression
            return
        updates = torch._foreach_mul(grads, 1 - omega)
        torch._foreach_add_(updates, exp_avgs, alpha=omega / bc1)
        torch._foreach_div_(updates, denoms)
        if params[0].dtype != torch.float32:
            updates = [u.to(params[0].dtype) for u in updates]
        torch._foreach_add_(params, updates, alpha=-lr)

    def _low_rank_batched(self, params: list[Tensor], group: dict[str, Any], k_before: int) -> None:
        """`LoRDO._low_rank_step` (basis fixed for this step) for same-shaped matrices at once."""
        whole = params[0]  # the shape, and (sharded) the group the QH mean is taken over
        side = projection_side(whole.shape)
        beta1, beta2 = group["betas"]
        lr, omega, eps = group["lr"], group["omega"], group["eps"]
        grads = _fp32_grads(params)
        basis = self._bases(params, group, side)

        ef, packed = None, None
        density = group["ef_density"]
        if group["error_feedback"] and density < 1.0:  # compressed E: top-k indices, int8 values, a scale
            packed = {key: self._stacked(params, key, lambda p, key=key: empty_compressed(p.shape, density, p.device)[key])
                      for key in EF_KEYS}
        elif group["error_feedback"]:
            ef_dtype = EF_DTYPES[group["ef_dtype"]]
            ef = self._stacked(params, "ef", lambda p: torch.zeros_like(local(p), dtype=ef_dtype))
        if packed is not None:
            v_full = add_decompressed(torch.stack(grads), packed, group["ef_decay"])  # V = G + γ C(E)
        elif ef is not None and ef.dtype == torch.float32:
            # V = G + γE computed in E's own memory: E is rewritten as V − back(g) below anyway.
            ident = ("ef", tuple(id(p) for p in params))
            h = self._pending[ident][0] if ident in self._pending else None
            # One matrix at a time, so that g = proj(V) reads V while it is still in cache.
            n, rows, cols = ef.shape
            g = ef.new_empty((n, rows, basis.shape[1]) if side == "right" else (n, basis.shape[2], cols))
            decay = group["ef_decay"]
            for e, grad, b, out in zip(self._stacks[ident].views, grads, basis.unbind(0), g.unbind(0)):
                torch.add(grad, e, alpha=decay, out=e)  # V = G + γE, one pass
                torch.mm(e, b.T, out=out) if side == "right" else torch.mm(b.T, e, out=out)
            if h is not None and decay != 1.0:
                h.mul_(decay)
            v_full = ef
        else:
            v_full = torch.stack(grads)
            if ef is not None:  # bf16 E: V in fp32 beside it
                v_full.add_(ef, alpha=group["ef_decay"])

        lazy = ef is not None and v_full is ef
        if not lazy:
            g = _project(v_full, basis, side)
        if not lazy:
            h = None
        if h is not None:
            g.sub_(h)  # proj(W − back(h)) = proj(W) − h
        exp_avg = self._stacked(params, "exp_avg", lambda p: g.new_zeros(g.shape[1:]))
        exp_avg_sq = self._stacked(params, "exp_avg_sq", lambda p: g.new_zeros(g.shape[1:]))
        self._stacked(params, "step", _zero_step).add_(1)
        bc1, bc2 = bias_corrections(group, k_before + 1)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = exp_avg_sq.sqrt().div_(math.sqrt(bc2)).add_(eps)

        # W ← W(1 − ηλ) − η·U, applied without a full-size U: back(low) is an addmm_ into each
        # parameter that also applies the decay (its beta), then the full-rank term c·X
        # (c = (1−ω)/(s+ε) per matrix) is one foreach pass over the parameters.
        full, scale = None, None
        if group["qh_placement"] == "outside":
            low = (exp_avg / denom).mul_(omega / bc1)
            if omega != 1.0:
                scale = (1 - omega) / (coords_mean(denom, whole) + eps)
                full = list(v_full.unbind(0)) if group["full_rank_term"] == "error_fed" else grads
                if h is not None and full is not grads:
                    low.sub_(scale * h)  # c·V = c·W − c·back(h)
        else:
            low = g.mul(1 - omega).add_(exp_avg, alpha=omega / bc1).div_(denom)
        _apply_update([local(p) for p in params], low, basis, side, lr, 1 - lr * group["weight_decay"], full, scale)
        if lazy:  # E ← V − back(g) = W − back(h + g): kept as that sum, one rank-r product fewer per step
            self._pending[ident] = (g if h is None else h.add_(g), basis, side)
            return

        if ef is None and packed is None:
            return
        # E ← V − back(g), after the last use of V: in V's memory (E's own when E is fp32)
        if side == "right":
            v_full.baddbmm_(g, basis, alpha=-1)
        else:
            v_full.baddbmm_(basis, g, alpha=-1)
        if packed is not None:  # compressed one matrix at a time: a temporary the size of one matrix
            for i, residual in enumerate(v_full.unbind(0)):
                for key, value in compress(residual, density).items():
                    packed[key][i].copy_(value)
        elif v_full is not ef:  # bf16 E
            ef.copy_(v_full)


def _fp32_grads(params: list[Tensor]) -> list[Tensor]:
    """The gradients in fp32 (the tensors themselves when they are: no dispatch per parameter)."""
    grads = [local(p.grad) for p in params]
    return [g if g.dtype == torch.float32 else g.float() for g in grads]


def _zero_step(p: Tensor) -> Tensor:
    """A step count as `LoRDO._init_step` makes it (the entry exists by then; this is `_stacked`'s rule)."""
    return torch.tensor(0.0, dtype=torch.float32)


def _apply_update(params: list[Tensor], low: Tensor, basis: Tensor, side: Side, lr: float, decay: float,
                  full: list[Tensor] | None, scale: Tensor | None) -> None:
    """params[i] ← decay · params[i] − lr · back(low[i]) − lr · scale[i] · full[i] (scale[i] a
    one-element tensor: no host sync; `full` None: no full-rank term).

    fp32 parameters: one matrix at a time, an addmm_ into the parameter whose beta applies the
    decay, then the full-rank term while the parameter is still in cache; no full-size temporary.
    Other dtypes: the update in fp32, then one rounding into the parameter."""
    if params[0].dtype != torch.float32:
        update = _project_back(low, basis, side)
        if full is not None:
            update.add_(torch.stack(full) * scale)
        if decay != 1.0:
            torch._foreach_mul_(params, decay)
        torch._foreach_add_(params, list(update.to(params[0].dtype).unbind(0)), alpha=-lr)
        return
    for i, (p, x, b) in enumerate(zip(params, low.unbind(0), basis.unbind(0))):
        if side == "right":
            p.addmm_(x, b, beta=decay, alpha=-lr)
        else:
            p.addmm_(b, x, beta=decay, alpha=-lr)
        if full is not None:
            p.addcmul_(full[i], scale[i], value=-lr)
