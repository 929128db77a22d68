"""The LoRDO local (inner) optimizer step, one matrix at a time: the readable reference.

The step that runs by default is `batched.py` (`BatchedLoRDO`): the same step on stacks of
same-shaped matrices, one batched op per stack (`InnerConfig.batched`, on by default). This
module is its test oracle (tests/unit/test_batched.py: equal to fp32 rounding for every option)
and the place to read the method (docs/algorithm.md, "The local (inner) step").

For a low-rank weight W (p×q) with projection basis P on GaLore's side:

    V = G + E                     error-fed gradient (E: error-feedback buffer, starts at 0)
    g = proj(V);  E = V − back(g) what the projection dropped is fed back next step
    u = β1 u + (1−β1) g ;  v = β2 v + (1−β2) g²                   low-rank Adam moments
    û = u / (1−β1^k) ;  d = sqrt(v / (1−β2^k)) + ε ;  s = mean(d)
    U = (1−ω) V / (s + ε) + ω back(û / d)      QH term "outside" the projection (the paper's)
    U = back(((1−ω) g + ω û) / d)               QH term "inside" (a variant)
    W ← W − η (U + λ W)                          decoupled weight decay on the pre-update W

Error-feedback options (docs/algorithm.md, "Error feedback inside a round"). With the basis fixed
for a round, E_t = E_0 + Σ_τ (I−Π) G_τ is never consumed, and the full-rank term re-applies all of
it at every step, so the out-of-subspace share of U grows over the round. The paper's behaviour is
the default; the options:
    full_rank_term="gradient":  U = (1−ω) G / (s + ε) + ω back(û / d)   (E only feeds the projection)
    ef_decay=γ < 1:             V = G + γ E                              (E forgets geometrically)
    ef_reset=True:              E ← 0 whenever the basis changes          (every round under Global)
and, across workers, `RoundConfig.sync_ef` averages E at every sync (its bytes are counted).
`track_update_split` records ‖U_out‖² and ‖U_in‖² per step (U_out = (1−ω)(I−Π)X/(s+ε), X the
full-rank term's input; U_in = U − U_out), the diagnostic of the build-up.

The full-rank quasi-hyperbolic share (1−ω)·V/s keeps each step full rank, so the pseudo-gradient
the server computes the next shared projection from can find new directions. Every other
parameter (embeddings, norms, biases, anything not given a `rank`, or a rank ≥ min(p, q)) takes
the QHAdam step ((1−ω) G + ω û) / d with full-size moments (Ma & Yarats 2019); ω = 1 makes it
exactly Adam/AdamW (torch's formula and ε placement), and ω = 1 without error feedback and
rotation makes the low-rank step GaLore-Adam.

Projection sources: "global" (LoRDO-Global: the basis is handed in through `set_projection`,
e.g. by the round aggregator from the averaged pseudo-gradient) and "local" (LoRDO-Local: the
worker refits it every `proj_interval` steps from its own error-fed gradient, GaLore-style).
On every change of basis the moments are rotated with LDAdam's rule (`rotation.py`).

Weight decay is applied to the pre-update weight as in torch.optim.AdamW (Loshchilov & Hutter);
GaLore's reference applies it after the update, which differs by η²λ·U per step.
Gradient clipping is the training loop's job (one global norm across all parameters).

Parameters sharded by FSDP2 inside a node (DTensors, cut along the dimension their coordinates
keep: `sharded.shard_placement`) take the same step on each rank's chunk; the QH normaliser's mean
and LoRDO-Local's refits see the whole matrix through the node's group (`sharded.py`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from lordo_fed.optim.ef_compress import EF_KEYS, add_decompressed, compress, empty_compressed
from lordo_fed.optim.rotation import rotate_moments
from lordo_fed.optim.sharded import check_placement, coords_mean, gather, is_sharded, local
from lordo_fed.optim.projection import (
    PROJECTION_METHODS,
    ProjectionMethod,
    get_projection_method,
    project,
    project_back,
    projection_side,
)

EF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QH_PLACEMENTS = ("outside", "inside")
FULL_RANK_TERMS = ("error_fed", "gradient")
PROJECTION_SOURCES = ("global", "local")
# Keys of a param group besides the hyperparameters (torch adds "param_names" for named params).
_GROUP_BOOKKEEPING = {"params", "param_names", "name"}


class LoRDO(torch.optim.Optimizer):
    """LoRDO's local step; a param group with an integer `rank` gets the low-rank treatment.

    Args (all can be overridden per param group):
        lr: step size η.
        betas: (β1, β2) of the moments.
        eps: ε added to the denominator (and to the QH normaliser s).
        weight_decay: decoupled weight decay λ.
        omega: quasi-hyperbolic weight ω in [0, 1]; 1 drops the full-rank term.
        rank: None for full-rank QHAdam, else the rank r of the moments' subspace.
        error_feedback: keep the full-size buffer E of what the projection dropped.
        ef_dtype: "fp32" or "bf16" storage of E (bf16 halves its memory).
        ef_density: 1 keeps E whole; ρ < 1 keeps only its top ⌈ρ·pq⌉ entries, int8-quantised
            (`ef_compress`, after MicroAdam; ef_dtype then does not apply).
        ef_decay: γ in V = G + γ E (1 = the paper).
        ef_reset: zero E whenever the projection changes (False = the paper).
        full_rank_term: "error_fed" (the QH term on V = G + E, the paper) or "gradient" (on G).
        qh_placement: "outside" (the paper) or "inside" the projection.
        projection_source: "global" (set from outside) or "local" (refit every proj_interval).
        proj_method: "svd", "rsvd" or "dct" (see lordo_fed.optim.projection).
        proj_interval: T_proj, steps between local refits.
        rotate: rotate the moments into the new basis when the projection changes.
        bias_correction: divide the moments by (1 − β^k).
        seed: seeds the randomized SVD of local refits.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        omega: float = 1.0,
        rank: int | None = None,
        error_feedback: bool = True,
        ef_dtype: str = "fp32",
        ef_density: float = 1.0,
        ef_decay: float = 1.0,
        ef_reset: bool = False,
        full_rank_term: str = "error_fed",
        qh_placement: str = "outside",
        projection_source: str = "global",
        proj_method: str = "svd",
        proj_interval: int = 32,
        rotate: bool = True,
        bias_correction: bool = True,
        seed: int = 0,
    ):
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, omega=omega, rank=rank,
            error_feedback=error_feedback, ef_dtype=ef_dtype, ef_density=ef_density, ef_decay=ef_decay,
            ef_reset=ef_reset,
            full_rank_term=full_rank_term, qh_placement=qh_placement,
            projection_source=projection_source, proj_method=proj_method,
            proj_interval=proj_interval, rotate=rotate, bias_correction=bias_correction, seed=seed,
        )
        self._methods: dict[str, ProjectionMethod] = {}
        self.track_update_split = False
        """Record, per step, ‖U_out‖² and ‖U_in‖² summed over the low-rank matrices (`update_split`)."""
        self.update_split: list[tuple[Tensor, Tensor]] = []
        """(‖U_out‖², ‖U_in‖²) of every step since it was last cleared (tensors: no host sync)."""
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------- set-up
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        unknown = set(param_group) - set(self.defaults) - _GROUP_BOOKKEEPING
        if unknown:
            raise ValueError(
                f"unknown LoRDO option(s) {sorted(unknown)}: expected a subset of {sorted(self.defaults)}"
            )
        super().add_param_group(param_group)
        _validate_group(self.param_groups[-1])

    def _method(self, name: str) -> ProjectionMethod:
        if name not in self._methods:
            self._methods[name] = get_projection_method(name)
        return self._methods[name]

    @staticmethod
    def is_low_rank(p: Tensor, group: dict[str, Any]) -> bool:
        """True when `p` takes the low-rank step: a 2-D weight with rank < min(p, q)."""
        return group["rank"] is not None and p.ndim == 2 and group["rank"] < min(p.shape)

    def low_rank_params(self) -> list[tuple[Tensor, dict[str, Any]]]:
        """(parameter, group) for every parameter on the low-rank path, in optimizer order."""
        return [(p, g) for g in self.param_groups for p in g["params"] if self.is_low_rank(p, g)]

    def group_of(self, param: Tensor) -> dict[str, Any]:
        """The param group that holds `param`."""
        for g in self.param_groups:
            if any(param is p for p in g["params"]):
                return g
        raise KeyError("parameter is not managed by this optimizer")

    # ----------------------------------------------------------------------------- projections
    def basis(self, param: Tensor) -> Tensor | None:
        """The orthonormal basis currently used for `param` (None before the first one)."""
        state, group = self.state[param], self.group_of(param)
        if "proj" not in state:
            return None
        return self._method(group["proj_method"]).basis(state["proj"], param.shape, projection_side(param.shape))

    @torch.no_grad()
    def set_projection(self, param: Tensor, stored: Tensor) -> None:
        """Hand in a new projection (stored form, see lordo_fed.optim.projection) for a low-rank param.

        The moments are rotated from the old basis into the new one (LDAdam) when `rotate` is on;
        the error-feedback buffer is full size and does not change, unless `ef_reset` zeroes it.
        """
        group = self.group_of(param)
        if not self.is_low_rank(param, group):
            raise ValueError(f"set_projection: parameter of shape {tuple(param.shape)} is not low-rank in its group")
        side = projection_side(param.shape)
        method = self._method(group["proj_method"])
        new_basis = method.basis(stored.to(param.device), param.shape, side)
        rank = group["rank"]
        expected = (rank, param.shape[1]) if side == "right" else (param.shape[0], rank)
        if tuple(new_basis.shape) != expected:
            raise ValueError(
                f"set_projection: basis of shape {tuple(new_basis.shape)} for a parameter of shape "
                f"{tuple(param.shape)}: expected {expected} (rank {rank}, {side} projection)"
            )
        state = self.state[param]
        if "proj" in state and "exp_avg" in state and group["rotate"]:
            old_basis = method.basis(state["proj"], param.shape, side)
            state["exp_avg"], state["exp_avg_sq"] = rotate_moments(
                state["exp_avg"], state["exp_avg_sq"], old_basis, new_basis, side,
                int(state["step"].item()), group["betas"], group["bias_correction"],
            )
        if "proj" in state and group["ef_reset"]:
            if "ef" in state:
                state["ef"].zero_()
            if "ef_val" in state:
                state["ef_val"].zero_()  # a compressed E = 0
        state["proj"] = stored.to(param.device).clone()

    # ----------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer.step)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        split: list[Tensor | None] | None = [None, None] if self.track_update_split else None
        for group, index, p in self._params_with_grads():
            if self.is_low_rank(p, group):
                self._low_rank_step(p, group, index, split)
            else:
                self._full_rank_step(p, group)
        if split is not None and split[1] is not None:
            self.update_split.append((split[0] if split[0] is not None else torch.zeros_like(split[1]), split[1]))
        return loss

    def _params_with_grads(self) -> Iterator[tuple[dict[str, Any], int, Tensor]]:
        """(group, index, parameter) of every parameter with a gradient, in optimizer order; the
        1-based index counts every parameter (it seeds LoRDO-Local's refits). Sparse gradients
        are refused."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LoRDO does not support sparse gradients")
                if is_sharded(p):
                    self._check_sharded(p, group)
                yield group, index, p

    def _check_sharded(self, p: Tensor, group: dict[str, Any]) -> None:
        """Refuse what the chunked step does not do (see `sharded.py`)."""
        low_rank = self.is_low_rank(p, group)
        check_placement(p, low_rank)
        if low_rank and group["error_feedback"] and group["ef_density"] < 1.0:
            raise ValueError(f"LoRDO option ef_density={group['ef_density']!r} on a sharded parameter: expected 1 "
                             "(a top-k of E is taken over the whole matrix, not per chunk)")
        if self.track_update_split:
            raise ValueError("LoRDO track_update_split on sharded parameters: expected False (its sums are per matrix)")

    def _init_step(self, state: dict[str, Tensor], p: Tensor) -> None:
        if "step" not in state:
            # A float tensor like torch.optim.Adam's, so state_dict() holds tensors only.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)

    def _full_rank_step(self, p: Tensor, group: dict[str, Any]) -> None:
        """QHAdam: ((1−ω) G + ω û) / d; ω = 1 is torch.optim.Adam(W)'s exact formula."""
        state = self.state[p]
        self._init_step(state, p)
        p, grad = local(p), local(p.grad).float()  # a sharded parameter: this rank's chunk (elementwise)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        lr, omega, eps = group["lr"], group["omega"], group["eps"]
        state["step"] += 1
        k = int(state["step"].item())
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bc1, bc2 = bias_corrections(group, k)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        if omega == 1.0 and p.dtype == torch.float32:
            p.addcdiv_(exp_avg, denom, value=-lr / bc1)  # torch.optim.Adam's exact expression
            return
        update = grad.mul(1 - omega).add_(exp_avg, alpha=omega / bc1).div_(denom)
        p.add_(update.to(p.dtype), alpha=-lr)

    def _low_rank_step(self, p: Tensor, group: dict[str, Any], index: int,
                       split: list[Tensor | None] | None) -> None:
        state = self.state[p]
        self._init_step(state, p)
        side = projection_side(p.shape)
        method = self._method(group["proj_method"])
        beta1, beta2 = group["betas"]
        lr, omega, eps, rank = group["lr"], group["omega"], group["eps"], group["rank"]

        param, p, grad = p, local(p), local(p.grad).float()  # `param` whole (shape, basis), p its chunk
        k_before = int(state["step"].item())
        refit = group["projection_source"] == "local" and ("proj" not in state or k_before % group["proj_interval"] == 0)
        compressed = group["error_feedback"] and group["ef_density"] < 1.0
        if compressed:
            if "ef_val" not in state:
                state.update(empty_compressed(p.shape, group["ef_density"], p.device))
            if refit and group["ef_reset"]:
                state["ef_val"].zero_()
            v_full = add_decompressed(grad.clone(), state, group["ef_decay"])  # V = G + γ C(E)
        elif group["error_feedback"]:
            if "ef" not in state:
                state["ef"] = torch.zeros_like(p, dtype=EF_DTYPES[group["ef_dtype"]])
            if refit and group["ef_reset"]:
                state["ef"].zero_()  # LoRDO-Local's change of basis: drop E before it is fed back
            v_full = grad.add(state["ef"].float(), alpha=group["ef_decay"])  # V = G + γE, one pass
        else:
            v_full = grad

        if refit:
            seed = group["seed"] * 1_000_003 + index * 7_919 + k_before
            # fitted to the whole V (gathered when sharded): the same basis on every rank
            self.set_projection(param, method.fit(gather(v_full, param), rank, side, seed=seed))
        if "proj" not in state:
            raise RuntimeError(
                f"LoRDO: low-rank parameter #{index} of shape {tuple(param.shape)} has no projection; with "
                "projection_source='global' call set_projection() before the first step"
            )
        basis = method.basis(state["proj"], param.shape, side)

        g = project(v_full, basis, side)
        if compressed:
            for key, value in compress(v_full - project_back(g, basis, side), group["ef_density"]).items():
                state[key].copy_(value)
        elif group["error_feedback"]:
            state["ef"].copy_(v_full - project_back(g, basis, side))

        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(g)
            state["exp_avg_sq"] = torch.zeros_like(g)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        k = k_before + 1
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1, bc2 = bias_corrections(group, k)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)

        if group["qh_placement"] == "outside":
            update = project_back(exp_avg / denom, basis, side).mul_(omega / bc1)
            if omega != 1.0:
                s = coords_mean(denom, param)  # one scalar per matrix; a tensor, so no host sync on CUDA
                full = v_full if group["full_rank_term"] == "error_fed" else grad
                update.add_(full * ((1 - omega) / (s + eps)))
                if split is not None:
                    out = (full - project_back(project(full, basis, side), basis, side)) * ((1 - omega) / (s + eps))
                    _accumulate(split, 0, out.square().sum())
                    _accumulate(split, 1, (update - out).square().sum())
            elif split is not None:
                _accumulate(split, 1, update.square().sum())
        else:
            low = g.mul(1 - omega).add_(exp_avg, alpha=omega / bc1).div_(denom)
            update = project_back(low, basis, side)
            if split is not None:
                _accumulate(split, 1, update.square().sum())

        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-lr)

    # ----------------------------------------------------------------------------- state
    def sync_state(self) -> None:
        """Bring every state tensor up to date before reading `self.state` directly: a no-op here;
        `BatchedLoRDO` keeps E lazily within a basis (`state_dict()` always calls it)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then our dtypes back: torch casts every floating state tensor to the
        parameter's dtype (and would turn DCT indices into floats); moments stay fp32, the
        error-feedback buffer keeps its ef_dtype and projections their stored dtype."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        # Our options only: torch's __setstate__ adds `differentiable` to self.defaults, and a
        # group that gained it would make a resumed state differ from an uninterrupted one.
        options = dict(self.defaults)
        super().load_state_dict(state_dict)
        id_to_param = {
            pid: p
            for saved, group in zip(saved_groups, self.param_groups)
            for pid, p in zip(saved["params"], group["params"])
        }
        for pid, saved in saved_state.items():
            p = id_to_param[pid]
            for key in ("exp_avg", "exp_avg_sq", "ef", "proj", *EF_KEYS):
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=saved[key].dtype, copy=True)
        for group in self.param_groups:
            for key, value in options.items():
                group.setdefault(key, value)  # a state saved before an option existed
            _validate_group(group)


def _accumulate(split: list[Tensor | None], i: int, value: Tensor) -> None:
    """split[i] += value, on the value's device (a diagnostic: no host sync in the step)."""
    split[i] = value if split[i] is None else split[i] + value


def bias_corrections(group: dict[str, Any], k: int) -> tuple[float, float]:
    """The Adam bias corrections (1 − β1^k, 1 − β2^k) of a param group at step k (1, 1 when it has none)."""
    if not group["bias_correction"]:
        return 1.0, 1.0
    beta1, beta2 = group["betas"]
    return 1.0 - beta1**k, 1.0 - beta2**k


def _validate_group(group: dict[str, Any]) -> None:
    """Raise a ValueError naming the option, its value and what is allowed."""

    def bad(name: str, allowed: str) -> None:
        raise ValueError(f"LoRDO option {name}={group[name]!r}: expected {allowed}")

    if not (isinstance(group["lr"], (int, float)) and group["lr"] >= 0):
        bad("lr", "a number >= 0")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        bad("betas", "two numbers in [0, 1)")
    if not group["eps"] > 0:
        bad("eps", "a number > 0")
    if not group["weight_decay"] >= 0:
        bad("weight_decay", "a number >= 0")
    if not (isinstance(group["omega"], (int, float)) and 0.0 <= group["omega"] <= 1.0):
        bad("omega", "a number in [0, 1]")
    rank = group["rank"]
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
        bad("rank", "None (full rank) or an integer > 0")
    if group["ef_dtype"] not in EF_DTYPES:
        bad("ef_dtype", f"one of {sorted(EF_DTYPES)}")
    density = group["ef_density"]
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        bad("ef_density", "a number in (0, 1] (1 = E kept whole)")
    decay = group["ef_decay"]
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
        bad("ef_decay", "a number in [0, 1] (1 = the paper: E is fed back whole)")
    if group["full_rank_term"] not in FULL_RANK_TERMS:
        bad("full_rank_term", f"one of {FULL_RANK_TERMS}")
    if group["qh_placement"] not in QH_PLACEMENTS:
        bad("qh_placement", f"one of {QH_PLACEMENTS}")
    if group["projection_source"] not in PROJECTION_SOURCES:
        bad("projection_source", f"one of {PROJECTION_SOURCES}")
    if group["proj_method"] not in PROJECTION_METHODS:
        bad("proj_method", f"one of {PROJECTION_METHODS}")
    interval = group["proj_interval"]
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        bad("proj_interval", "an integer > 0")
    for flag in ("error_feedback", "ef_reset", "rotate", "bias_correction"):
        if not isinstance(group[flag], bool):
            bad(flag, "True or False")
