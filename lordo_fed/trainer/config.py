"""Typed configuration of the reference trainer (Hydra structured config, torchtitan style)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from lordo_fed.rounds.config import CommonConfig
from lordo_fed.rounds.methods import METHODS


@dataclass
class TrainConfig(CommonConfig):
    """One reference-trainer invocation: several methods on the same data, model and seed."""

    methods: List[str] = field(default_factory=lambda: ["lordo_global", "ddp"])
    """Methods to run, in order: ddp, lowrank_ddp, diloco, local_adam, desloc, lordo_global, lordo_local,
    async_diloco, async_lookahead, heloco, async_lordo, heloco_lordo."""
    workers: int = 4
    """M: number of workers (data partitions), run in turn."""
    total_steps: int = 128
    """Optimizer steps per worker; every method trains on the same M × batch_size × seq_len × total_steps tokens."""
    progress: bool = True
    """Show a progress bar."""
    checkpoint_every: int = 0
    """Rounds between each method's checkpoints under out_dir/checkpoints/<method> (and one at its last round;
    0 = none): started again with the same settings, a killed run continues from its newest one
    (lordo_fed.trainer.checkpoints; an asynchronous method counts its records as rounds)."""
    diagnostics: bool = False
    """Log the stable rank of each round's averaged pseudo-gradient, its share in the shared subspace and
    the length it keeps of the replies' (`delta_retention`), and the workers' out-of-subspace share of the
    update and error-feedback norm (lordo_fed.wire.messages.DIAGNOSTIC_METRICS)."""

    @classmethod
    def of_app(cls, app, workers: int, **overrides) -> "TrainConfig":
        """The reference trainer on a Flower run's settings (a lordo_fed.app.config.AppConfig): its common
        fields, its variant as the one method, its steps, `workers` partitions, no progress bar; what a Flower
        run must reproduce (tests/integration/test_flower_app.py, test_async_flower.py)."""
        import dataclasses

        common = {f.name: getattr(app, f.name) for f in dataclasses.fields(cls) if hasattr(app, f.name)}
        return cls(**{**common, "methods": [app.variant], "workers": workers, "total_steps": app.total_steps,
                      "progress": False, **overrides}).validate()

    def validate(self) -> "TrainConfig":
        """Raise ValueError naming the key, the value and what is allowed."""
        if not self.methods:
            raise ValueError("methods=[]: expected at least one method")
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"methods: {m!r} is not a method; expected any of {sorted(METHODS)}")
        for name in ("workers", "total_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer > 0")
        super().validate()
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"checkpoint_every={every!r}: expected an integer >= 0 (rounds between checkpoints; 0 = none)")
        self.async_rounds.validate(self.workers)
        rc = self.rounds
        if rc.steps_before(rc.rounds_in(self.total_steps) + 1) == self.total_steps:
            return self  # whole rounds: every method trains on the same tokens
        ramp = list(rc.local_steps_ramp)
        start = rc.steps_before(rc.first_late_round()) if rc.late_local_steps else None
        if start is not None and self.total_steps > start:
            raise ValueError(f"total_steps={self.total_steps} with rounds.late_local_steps={rc.late_local_steps} from "
                             f"rounds.late_from_step={rc.late_from_step}: the late rounds start at step {start}, and the "
                             f"{self.total_steps - start} steps after it are not a whole number of them; expected every "
                             "method to train on the same tokens in whole rounds")
        if self.total_steps < sum(ramp):  # a run may end inside the ramp, at the end of one of its rounds
            ends = [rc.steps_before(r + 1) for r in range(1, len(ramp) + 1)]
            shown = ", ".join(map(str, ends[:8])) + (", ..." if len(ends) > 8 else "")
            raise ValueError(f"total_steps={self.total_steps} ends inside round {rc.rounds_in(self.total_steps) + 1} of "
                             f"rounds.local_steps_ramp={ramp!r}: expected a step its rounds end at ({shown}) or a "
                             f"multiple of rounds.local_steps={rc.local_steps} from {sum(ramp)} on, so that every "
                             "method trains on the same tokens in whole rounds")
        raise ValueError(
            f"total_steps={self.total_steps} is not a multiple of rounds.local_steps={rc.local_steps}: "
            "every method must train on the same tokens in whole rounds"
        )
