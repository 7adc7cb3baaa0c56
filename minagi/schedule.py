"""The learning-rate schedule: linear warmup, then a cosine to a floor; and what extending a run does to it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

__all__ = ["Schedule", "as_function", "lr_factor"]


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of train.lr for 0-based `step`: linear warmup to 1, then cosine down to min_ratio.
    Step -1 (the rate "before" a fresh run, asked at its start) is 0 in a warmup, else the peak."""
    if 0 < warmup and step < warmup:
        return max(0, step + 1) / warmup
    progress = min(1.0, max(0, step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    """A run's learning-rate multiplier per 0-based step: `lr_factor`, and what an extension makes of it.

    A resume that changes train.steps (an extension) continues from the rate the run had reached:
    from `bend` (the last step before the resume) on, a cosine from that step's factor `bend_factor`
    down to min_ratio at the new `total`. So the rate never jumps at a resume; a finished run, extended,
    goes on at its floor. (A fresh warmup and cosine is a new run: --init from the checkpoint.) A run
    still warming up keeps its warmup, which does not depend on train.steps, and a cosine to the new end.
    Checkpoints carry it (`Checkpoint.schedule`), so a second extension bends the first one's curve.
    """
    total: int
    warmup: int
    min_ratio: float
    bend: int = -1            # -1: the plain schedule; steps before `bend` are done, their factor unused
    bend_factor: float = 1.0

    def __call__(self, step: int) -> float:
        if self.bend < 0 or step < self.bend:
            return lr_factor(step, self.total, self.warmup, self.min_ratio)
        progress = min(1.0, (step - self.bend) / max(1, self.total - self.bend))
        return self.min_ratio + (self.bend_factor - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def extended(self, step: int, total: int) -> "Schedule":
        """This schedule for a run resumed after `step` steps with train.steps = `total`."""
        if total == self.total:
            return self
        if step <= self.warmup and self.bend < 0:
            return dataclasses.replace(self, total=total)
        return Schedule(total=total, warmup=self.warmup, min_ratio=self.min_ratio, bend=step - 1,
                        bend_factor=self(step - 1))


def as_function(schedule: Schedule) -> Callable[[int], float]:
    # LambdaLR saves (and on load writes back into) the attributes of a callable object that is not a
    # plain function: a function keeps the schedule out of the scheduler's state, which is ours to set.
    return lambda step: schedule(step)

