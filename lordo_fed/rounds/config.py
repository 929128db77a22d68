"""Settings of the rounds, and the settings every way of running LoRDO shares (reference trainer,
Flower app): `RoundConfig` (K and the sync periods), `AsyncConfig` (asynchronous rounds) and
`CommonConfig`, the tree the entry points extend (docs/architecture.md, "Where each setting lives").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from lordo_fed.config import section, setting
from lordo_fed.data import DataConfig
from lordo_fed.device import DEVICE_CHOICES
from lordo_fed.model import ModelConfig, resolve_model_config
from lordo_fed.optim.config import InnerConfig
from lordo_fed.rounds.heloco import HeLoCoConfig
from lordo_fed.rounds.outer import OuterConfig, build_outer_optimizer
from lordo_fed.wire.messages import MOMENT_KEYS
from lordo_fed.wire.payload import resolve_payload


SPARSE_MEANS = ("all", "contributors")
"""`RoundConfig.sparse_mean`: how a top-k Δ is averaged."""
BASES_FROM = ("server", "downlink")
"""`RoundConfig.bases_from`: who fits LoRDO-Global's shared bases."""
EVERY_ROUND = (1, 1)
"""(K_u, K_v) of a method that has no periods of its own (LoRDO-Global, as the paper: both moments averaged
at every round's end); what `RoundConfig`'s None periods mean."""


@dataclass
class RoundConfig:
    """How often workers synchronise what (DES-LOC periods, in rounds of K local steps)."""

    local_steps: int = setting("local-steps", 32)
    """K: local optimizer steps per round."""
    sync_exp_avg_every: Optional[int] = setting("sync-exp-avg-every", None)
    """K_u: rounds between first-moment averages (0 = never: the moments stay local; None = the method's own)."""
    sync_exp_avg_sq_every: Optional[int] = setting("sync-exp-avg-sq-every", None)
    """K_v: rounds between second-moment averages (0 = never; None = the method's own)."""
    dense_sync_factor: int = setting("dense-sync-factor", 1)
    """F: moments of parameters that are not low-rank (embeddings, norms; every AdamW parameter) are
    averaged every F·K_u and F·K_v rounds (1 = with the rest, the paper; 0 = never)."""
    sync_ef: bool = setting("sync-ef", False)
    """Also average LoRDO's error-feedback buffers E of the low-rank matrices every round (full size:
    as many bytes again as Δ, each way; the authors' code appears to all-reduce E with the moments)."""
    overlap_delay: int = setting("overlap-delay", 0)
    """τ: a worker starts round r+1 from its own θ as soon as it has sent round r, and merges round r+1's
    global state after τ local steps (Streaming DiLoCo's overlap, docs/algorithm.md; 0 = synchronous rounds)."""
    wire_ef_decay: float = setting("wire-ef-decay", 1.0)
    """β of a compressed payload's error feedback on the worker, e ← β·e + Δ (SparseLoCo: 0.95, in
    place of outer momentum; 1 = nothing a round leaves out is ever dropped)."""
    wire_ef_lr_scale: bool = setting("wire-ef-lr-scale", False)
    """Also scale the residual by the inner lr's fall since the last round, e ← β·min(1, η_r/η_{r−1})·e + Δ
    (η the mean lr over a round's steps): what the wire held back is applied at the lr of the round that
    sends it, so the schedule's decay reaches it too."""
    sparse_mean: str = setting("sparse-mean", "all")
    """How the server averages a top-k Δ: 'all' (Σ_m w_m Δ_m, an index one worker sent gets its w_m)
    or 'contributors' (at each index, the token-weighted mean over the workers that sent it; SparseLoCo)."""

    clip_median: bool = setting("clip-median", False)
    """Scale each reply's Δ down to the round's median ||Δ|| before averaging (SparseLoCo's production
    server; the median as the outlier rule takes it, `screening.round_median`): one worker's large
    step moves θ no more than a typical one's. Moments and the contributor mean's weights are unchanged."""

    bases_from: str = setting("bases-from", "server")
    """LoRDO-Global's bases from round 2 on: 'server' (fitted to Δ̄ by the server and sent, fp32) or
    'downlink' (each worker fits them to the round's decoded change of θ_c with the server's method:
    nothing on the wire, no refit on the server; needs a compressed downlink and no averaged moments)."""

    local_steps_ramp: List[int] = setting("local-steps-ramp", default_factory=list)
    """K of the first rounds, in order, before every later round runs K (e.g. 8,8,16 with K = 32: the
    first K steps in three rounds); their sum a multiple of K, so the later rounds keep K's grid
    ([] = every round K; a run may end inside it, where one of its rounds ends; DDP ignores it: no
    rounds; docs/algorithm.md, "The first rounds")."""

    late_local_steps: int = setting("late-local-steps", 0)
    """K of every round that starts at or after global step `late_from_step` (e.g. 8 with K = 32 from the
    learning rate's decay on: more exchanges where LoRDO loses ground to low-rank DDP; 0 = K throughout;
    docs/algorithm.md, "The last rounds")."""

    late_from_step: int = setting("late-from-step", 0)
    """The global step the late rounds start at: the first round starting at or after it is the first
    that runs `late_local_steps` and takes `outer.late_lr` (with WSD's decay over the last 20% of T steps:
    0.8·T; 0 = no late rounds)."""

    def validate(self) -> "RoundConfig":
        if self.local_steps <= 0:
            raise ValueError(f"rounds.local_steps={self.local_steps!r}: expected an integer > 0")
        ramp = list(self.local_steps_ramp)
        if any(isinstance(k, bool) or not isinstance(k, int) or k <= 0 for k in ramp) or sum(ramp) % self.local_steps:
            raise ValueError(f"rounds.local_steps_ramp={ramp!r}: expected integers > 0 whose sum is a multiple of "
                             f"rounds.local_steps={self.local_steps} (the first rounds' K; [] = every round K)")
        for name in ("late_local_steps", "late_from_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"rounds.{name}={value!r}: expected an integer >= 0 (late_local_steps: the K of the "
                                 "rounds from global step late_from_step on; 0 = K throughout)")
        if self.late_local_steps and not self.late_from_step:
            raise ValueError(f"rounds.late_local_steps={self.late_local_steps} with rounds.late_from_step=0: expected "
                             "the global step the short rounds start at (> 0; for K throughout late_local_steps=0)")
        for name in ("sync_exp_avg_every", "sync_exp_avg_sq_every", "dense_sync_factor"):
            value = getattr(self, name)
            if value is None and name != "dense_sync_factor":
                continue  # the method's own periods (`methods.resolve_method`)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"rounds.{name}={value!r}: expected an integer >= 0 (0 = never)")
        beta = self.wire_ef_decay
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"rounds.wire_ef_decay={beta!r}: expected a number in [0, 1] (β of the compressed "
                             "payload's error feedback; 1 keeps all of it)")
        if not isinstance(self.wire_ef_lr_scale, bool):
            raise ValueError(f"rounds.wire_ef_lr_scale={self.wire_ef_lr_scale!r}: expected true or false")
        if not isinstance(self.clip_median, bool):
            raise ValueError(f"rounds.clip_median={self.clip_median!r}: expected true or false")
        if self.sparse_mean not in SPARSE_MEANS:
            raise ValueError(f"rounds.sparse_mean={self.sparse_mean!r}: expected one of {SPARSE_MEANS}")
        if self.bases_from not in BASES_FROM:
            raise ValueError(f"rounds.bases_from={self.bases_from!r}: expected one of {BASES_FROM}")
        tau = self.overlap_delay
        if tau and ramp:
            raise ValueError(f"rounds.overlap_delay={tau!r} with rounds.local_steps_ramp={ramp!r}: overlapped rounds "
                             "start the next round's steps before the global state, on a fixed K; expected "
                             "overlap_delay=0 or local_steps_ramp=[]")
        if tau and self.late_local_steps:
            raise ValueError(f"rounds.overlap_delay={tau!r} with rounds.late_local_steps={self.late_local_steps}: "
                             "overlapped rounds run a fixed K; expected overlap_delay=0 or late_local_steps=0")
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < self.local_steps:
            raise ValueError(f"rounds.overlap_delay={tau!r}: expected an integer from 0 (synchronous rounds) to "
                             f"local_steps - 1 = {self.local_steps - 1} (local steps of a round trained before the "
                             "previous round's global state is merged)")
        if tau and self.sync_ef:
            raise ValueError(f"rounds.overlap_delay={tau} with rounds.sync_ef=True: an averaged error-feedback buffer "
                             "cannot be merged into one that moved on; expected overlap_delay=0 or sync_ef=False")
        return self

    def steps_of(self, round_idx: int) -> int:
        """K_r: the local steps of 1-based round `round_idx` (`local_steps_ramp`, then K, then
        `late_local_steps` from the first round that starts at or after `late_from_step`)."""
        late = self._first_short_round()
        if late is not None and round_idx >= late:
            return self.late_local_steps
        ramp = self.local_steps_ramp
        return int(ramp[round_idx - 1]) if round_idx <= len(ramp) else self.local_steps

    def lr_fall(self, round_idx: int, lr: Callable[[int], float]) -> float:
        """min(1, η_r / η_{r−1}), η_r the mean of `lr` (the inner lr of a 0-based global step) over round
        `round_idx`'s steps: how far the lr fell since the round before (1 for the first round and where
        it rose, in the warm-up: a residual is never scaled up). `wire_ef_lr_scale`'s factor; a function
        of the round alone, so a resumed worker scales as the uninterrupted one."""
        def mean_lr(r: int) -> float:
            first, k = self.steps_before(r), self.steps_of(r)
            return sum(lr(first + i) for i in range(k)) / k
        if round_idx <= 1:
            return 1.0
        before = mean_lr(round_idx - 1)
        return min(1.0, mean_lr(round_idx) / before) if before > 0 else 1.0

    def steps_before(self, round_idx: int) -> int:
        """The local steps of the rounds before 1-based round `round_idx`: the global step its first
        local step takes (the learning-rate schedule's position)."""
        late = self._first_short_round()
        if late is not None and round_idx > late:
            return self._steps_before_unlate(late) + (round_idx - late) * self.late_local_steps
        return self._steps_before_unlate(round_idx)

    def rounds_in(self, total_steps: int) -> int:
        """The whole rounds that `total_steps` local steps make (the ramp's first, the late ones last)."""
        late = self._first_short_round()
        if late is not None and total_steps > self._steps_before_unlate(late):
            return late - 1 + (total_steps - self._steps_before_unlate(late)) // self.late_local_steps
        ramp = self.local_steps_ramp
        if total_steps < sum(ramp):
            return sum(1 for r in range(1, len(ramp) + 1) if self._steps_before_unlate(r + 1) <= total_steps)
        return len(ramp) + (total_steps - int(sum(ramp))) // self.local_steps

    def _steps_before_unlate(self, round_idx: int) -> int:
        """`steps_before` of the ramp and K alone."""
        ramp = self.local_steps_ramp
        done = min(round_idx - 1, len(ramp))
        return int(sum(ramp[:done])) + (round_idx - 1 - done) * self.local_steps

    def first_late_round(self) -> int | None:
        """The first round that starts at or after `late_from_step` (None: no late rounds)."""
        if not self.late_from_step:
            return None
        done = 0
        for r, k in enumerate(self.local_steps_ramp, start=1):
            if done >= self.late_from_step:
                return r
            done += int(k)
        return len(self.local_steps_ramp) + 1 + max(0, -(-(self.late_from_step - done) // self.local_steps))

    def _first_short_round(self) -> int | None:
        """The first round of `late_local_steps` (None: the late rounds, if any, keep K)."""
        return self.first_late_round() if self.late_local_steps else None

    def periods(self, low_rank: bool = True) -> dict[str, int]:
        """Rounds between averages of each moment kind (0 = never) for a low-rank parameter, or
        for one that is not (DES-LOC's periods times `dense_sync_factor`)."""
        factor = 1 if low_rank else self.dense_sync_factor
        u = EVERY_ROUND[0] if self.sync_exp_avg_every is None else self.sync_exp_avg_every
        v = EVERY_ROUND[1] if self.sync_exp_avg_sq_every is None else self.sync_exp_avg_sq_every
        return {"exp_avg": u * factor, "exp_avg_sq": v * factor}

    def due(self, round_idx: int, low_rank: bool = True) -> tuple[str, ...]:
        """States averaged at the end of 1-based round `round_idx`, for a low-rank parameter or
        for one that is not (E only for low-rank ones, every round, with `sync_ef`)."""
        periods = self.periods(low_rank)
        due = tuple(k for k in MOMENT_KEYS if periods[k] and round_idx % periods[k] == 0)
        return (*due, "ef") if self.sync_ef and low_rank else due


ASYNC_ORDERS = ("arrival", "virtual")
ASYNC_CACHES = ("none", "ca2fl")


@dataclass
class AsyncConfig:
    """Asynchronous rounds: worker speeds on the virtual clock, per-worker local steps, the
    staleness bound, the order a Flower server applies replies in, HeLoCo."""

    speeds: List[float] = setting("async-speeds", default_factory=list)
    """Virtual seconds per local step of each worker ([] = 1.0 for all); e.g. [1, 1, 1, 4]: one 4x slower."""
    local_steps: List[int] = setting("async-local-steps", default_factory=list)
    """Local steps per round of each worker ([] = rounds.local_steps for all): per-node work, GradSkip's idea."""
    match_speed: bool = setting("async-match-speed", False)
    """Arrival order: each node's local steps chosen from its measured speed, so that rounds take about equal wall-clock."""
    weight: float = setting("async-weight", 1.0)
    """ρ: every arriving Δ is scaled by it before its outer step (HeLoCo's; the paper suggests 1/√K for K workers)."""
    staleness_exponent: float = setting("async-staleness-exponent", 0.0)
    """a: a reply s outer steps stale is scaled by ρ·(1+s)^−a instead of ρ (FedAsync's polynomial weight; 0 = constant ρ)."""
    grace: float = setting("async-grace", 0.0)
    """Seconds the server waits after an arrival for more (virtual seconds in virtual order): each is applied, one outer step, and all get the same next start point (HeLoCo's grace window; 0 = off)."""
    cache: str = setting("async-cache", "none")
    """'ca2fl': the server keeps each node's latest Δ and steps on their mean plus the arrival's change against its kept Δ (CA²FL; 'none': on the arrival's Δ)."""
    max_staleness: int = setting("async-max-staleness", 0)
    """Drop a reply made from a model more than this many outer steps old (0 = no bound, as HeLoCo's code)."""
    order: str = setting("async-order", "arrival")
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
        if isinstance(self.staleness_exponent, bool) or not isinstance(self.staleness_exponent, (int, float)) or not (
                math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0):
            raise ValueError(f"async_rounds.staleness_exponent={self.staleness_exponent!r}: expected an exponent >= 0 "
                             "(0 = the constant weight ρ)")
        if isinstance(self.grace, bool) or not isinstance(self.grace, (int, float)) or not (
                math.isfinite(self.grace) and self.grace >= 0):
            raise ValueError(f"async_rounds.grace={self.grace!r}: expected seconds >= 0 (0 = no grace window)")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"async_rounds.max_staleness={self.max_staleness!r}: expected an integer >= 0 "
                             "(0 = no bound)")
        if self.cache not in ASYNC_CACHES:
            raise ValueError(f"async_rounds.cache={self.cache!r}: expected one of {ASYNC_CACHES}")
        if self.order not in ASYNC_ORDERS:
            raise ValueError(f"async_rounds.order={self.order!r}: expected one of {ASYNC_ORDERS}")
        if not isinstance(self.match_speed, bool):
            raise ValueError(f"async_rounds.match_speed={self.match_speed!r}: expected true or false")
        if self.match_speed and (self.order != "arrival" or self.local_steps):
            raise ValueError(f"async_rounds.match_speed=True with order={self.order!r} and local_steps="
                             f"{list(self.local_steps)!r}: expected order='arrival' and local_steps=[] (steps from measured "
                             "speed need real arrivals; the virtual clock takes its steps from async-local-steps)")
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


@dataclass
class CommonConfig:
    """Model, data, optimizers and bookkeeping: the same fields in every entry point."""

    seed: int = setting("seed", 0)
    """Seeds model init, data sampling and projections; identical for every method."""
    device: str = setting("device", "auto")
    """'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'."""
    threads: int = setting("threads", 0)
    """torch CPU threads (0 = torch's default)."""
    out_dir: str = "outputs/reference"
    """Where JSONL metrics, TensorBoard logs, plots, summaries (and checkpoints) go."""
    tensorboard: bool = setting("tensorboard", False)
    """Also write TensorBoard scalars under out_dir/tb."""
    eval_every: int = setting("eval-every", 1)
    """Rounds (K steps each) between validation passes."""
    eval_batches: int = setting("eval-batches", 8)
    """Validation batches per pass (fixed, sequential windows of the held-out split)."""
    model: ModelConfig = section(lambda: ModelConfig(preset="small"))
    """The model (preset name or explicit sizes, or a local HF config.json)."""
    data: DataConfig = section(DataConfig)
    """Corpus, tokenizer, split, partition, batch and sequence length."""
    inner: InnerConfig = section(InnerConfig)
    """The workers' local optimizer."""
    rounds: RoundConfig = section(RoundConfig)
    """K local steps per round and the moment-sync periods."""
    outer: OuterConfig = section(OuterConfig)
    """Outer optimizer of the round-based methods (LoRDO, Local Adam, DES-LOC)."""
    diloco_outer: OuterConfig = field(default_factory=lambda: OuterConfig(name="nesterov", lr=0.7, momentum=0.9))
    """Outer optimizer of DiLoCo (Nesterov, lr 0.7, momentum 0.9 as in the DiLoCo paper)."""
    payload_dtype: str = setting("payload-dtype", "fp32")
    """How tensors cross the wire: 'fp32', 'bf16' (bit-viewed), or a compressed preset 'int8', 'int4', 'topk2bit', 'topk2bit-both', 'topk2bit-lut', 'lowrank+topk2bit', 'lowrank+topk2bit+rows' (lordo_fed.wire.payload)."""
    async_rounds: AsyncConfig = section(AsyncConfig)
    """Asynchronous methods: worker speeds and local steps, staleness bound, reply order, HeLoCo's settings."""

    def validate(self) -> "CommonConfig":
        """Raise ValueError naming the key, the value and what is allowed."""
        for name in ("eval_every",):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer > 0")
        for name in ("eval_batches", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer >= 0")
        if not isinstance(self.device, str) or not (
                self.device in DEVICE_CHOICES or re.fullmatch(r"cuda:\d+", self.device)):
            raise ValueError(f"device={self.device!r}: expected one of {DEVICE_CHOICES} or 'cuda:N'")
        self.data.validate()
        self.inner.validate()
        self.rounds.validate()
        self.async_rounds.validate()
        resolve_payload(self.payload_dtype)
        model = resolve_model_config(self.model)
        if model.hf_config_path is None and self.data.seq_len > model.max_seq_len:
            raise ValueError(f"DataConfig.seq_len={self.data.seq_len!r}: expected an int <= the model's max_seq_len="
                             f"{model.max_seq_len} (model preset {model.preset!r}; raise ModelConfig.max_seq_len "
                             f"or lower seq_len)")
        for name in ("outer", "diloco_outer"):
            try:
                build_outer_optimizer(getattr(self, name))
            except ValueError as err:
                raise ValueError(f"{name}.{err}") from err
        return self
