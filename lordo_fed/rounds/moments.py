"""The optimizer state a worker exchanges with the server: projections, moments, step counts.

At the start of a round the worker takes the round's shared projections (LoRDO-Global; setting
one rotates the local moments into the new basis with LDAdam's rule, `LoRDO.set_projection`) and
the averaged moments that are due (DES-LOC's periods, `RoundConfig.due`); after its K steps it
reports its own due moments. Step counts and moments stay consistent throughout
(`lordo_fed.optim.bias`, docs/algorithm.md "Decisions"): a moment is always moved to the step
count it is read at, m·(1−β^S)/(1−β^k), so its bias-corrected value does not change. The
overlapped rounds' merge (`lordo_fed.rounds.overlap`) uses the same pieces.

On a sharded node what comes in is cut to this rank's chunk and what goes out is gathered whole
(`lordo_fed.rounds.sharding`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lordo_fed.device import to_host
from lordo_fed.optim import LoRDO
from lordo_fed.optim.bias import restep, restep_state
from lordo_fed.optim.lordo import EF_DTYPES
from lordo_fed.optim.projection import get_projection_method
from lordo_fed.optim.sharded import gather
from lordo_fed.rounds.bases import fit_projections
from lordo_fed.rounds.config import RoundConfig
from lordo_fed.rounds.sharding import chunk_state
from lordo_fed.wire.compress import decoded
from lordo_fed.wire.messages import MOMENT_KEYS, GlobalState, moment_key, split_moment_key


def received(state: GlobalState) -> dict[str, dict[str, Tensor]]:
    """The averaged states `state` carries, by parameter name then kind (exp_avg, exp_avg_sq, ef)."""
    out: dict[str, dict[str, Tensor]] = {}
    for key, value in decoded(state.moments).items():
        kind, name = split_moment_key(key)
        out.setdefault(name, {})[kind] = value
    return out


def set_projections(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], state: GlobalState) -> None:
    """The round's shared projections into the optimizer (LoRDO-Global; rotating its moments)."""
    if state.projections and not isinstance(optimizer, LoRDO):
        raise ValueError("global state carries projections but the inner optimizer is not LoRDO")
    for name, stored in state.projections.items():
        optimizer.set_projection(params[name], stored)


def fit_bases(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], change: Mapping[str, Tensor],
              round_idx: int) -> None:
    """`RoundConfig.bases_from='downlink'`: LoRDO-Global's bases for round `round_idx` fitted here, as the
    server would fit them (`fit_projections`: the parameter's group's method and rank, seeded by the
    round), to the decoded change of θ_c the round's state carried, which every worker holds bit for
    bit: the same bases everywhere with nothing on the wire (docs/algorithm.md, "Compressed payloads")."""
    if not isinstance(optimizer, LoRDO):
        raise ValueError("bases_from='downlink' needs the LoRDO inner optimizer")
    names = {id(p): n for n, p in params.items()}
    by_method: dict[str, dict[str, int]] = {}
    for p, group in optimizer.low_rank_params():
        by_method.setdefault(group["proj_method"], {})[names[id(p)]] = group["rank"]
    for method, ranks in by_method.items():
        fitted = fit_projections({n: change[n] for n in ranks}, ranks, get_projection_method(method),
                                 seed=7919 * round_idx, device=params[next(iter(ranks))].device)
        for name, stored in fitted.items():
            optimizer.set_projection(params[name], stored)


def align_step_counts(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Bring every parameter's optimizer state to `step` steps, its moments rescaled so their
    bias-corrected values do not change (a no-op when the counts already agree)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st and "step" in st and "exp_avg" in st:
                restep_state(st, step, group["betas"], group.get("bias_correction", True))


def adopt(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], state: GlobalState,
          device: torch.device) -> None:
    """The averaged moments (and E) `state` carries into the optimizer, after `align_step_counts`
    to `state.opt_step` and `set_projections`.

    A parameter without state of its own adopts received moments only when both of them came: a
    first moment without its second would be used with v = 0 under the shared count, and its
    first update would explode. Such a parameter starts afresh (u = v = 0, step 0), as a new
    optimizer would, and its moments are rescaled when it reports them (`due`)."""
    for name, kinds in received(state).items():
        p = params[name]
        st = optimizer.state[p]
        if "ef" in kinds:  # E has no step count: always adopted, in this worker's storage dtype
            dtype = st["ef"].dtype if "ef" in st else EF_DTYPES[optimizer.group_of(p)["ef_dtype"]]
            st["ef"] = chunk_state(kinds.pop("ef").to(device=device, dtype=dtype), p, optimizer).clone()
        if not kinds:
            continue
        if "exp_avg" not in st:
            if not all(k in kinds for k in MOMENT_KEYS):
                continue  # joined when only one moment was due: start this parameter afresh
            st["step"] = torch.tensor(float(state.opt_step))
        for kind, value in kinds.items():
            st[kind] = chunk_state(value.to(device=device, dtype=torch.float32), p, optimizer).clone()


def due(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], rounds: RoundConfig,
        round_idx: int) -> dict[str, Tensor]:
    """The states a worker sends after round `round_idx` (`RoundConfig.due`: low-rank and other
    parameters may have different periods; E with `sync_ef`), by `moment_key`, as whole fp32 host
    tensors, each moment expressed at the worker's step count `step_count` (a parameter that
    started afresh has fewer steps)."""
    low_rank = {id(p) for p, _ in optimizer.low_rank_params()} if isinstance(optimizer, LoRDO) else set()
    count = step_count(optimizer)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, Tensor] = {}
    for name, p in params.items():
        st, group = optimizer.state.get(p, {}), group_of[id(p)]
        for kind in rounds.due(round_idx, id(p) in low_rank):
            if kind not in st:
                continue
            value = gather(st[kind].detach(), p).float()
            if kind != "ef":  # E has no step count
                value = restep(value, kind, int(st["step"]), count, group["betas"],
                               group.get("bias_correction", True))
            out[moment_key(kind, name)] = value
    return to_host(out)


def step_count(optimizer: torch.optim.Optimizer) -> int:
    """The worker's step count: the most steps any parameter's state has taken."""
    steps = [int(st["step"]) for st in optimizer.state.values() if "step" in st]
    return max(steps, default=0)
