"""The training loop between two records: what it measures for the next record (`Interval`) and what it
shows (`Progress`): a tqdm bar on a terminal; without one (a log file, a job scheduler, where tqdm
draws nothing) a plain line ten times an evaluation interval. The shown char/s (and its MFU, on CUDA)
is over the last RATE_WINDOW steps, not the interval: the first interval's mean holds torch.compile's
minute (history.jsonl's chars_per_s and mfu stay the interval's mean)."""
from __future__ import annotations

import collections
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from . import devices

__all__ = ["RATE_WINDOW", "Interval", "Progress"]

RATE_WINDOW = 16


@dataclass
class Interval:
    """This process's steps since the last record (after a resume: since the resume), which the record's
    rate, learning rate and per-step counts cover. Made when the loop starts and after each record."""
    steps: int = 0
    chars: int = 0
    seconds: float = 0.0       # training only: evaluation and saving excluded
    lr: float | None = None    # the learning rate of its last step

    def add(self, chars: int, seconds: float, lr: float) -> None:
        self.steps, self.chars, self.seconds, self.lr = self.steps + 1, self.chars + chars, self.seconds + seconds, lr

    @property
    def chars_per_s(self) -> float | None:
        return self.chars / self.seconds if self.seconds > 0 else None


class Progress:
    """The bar or the plain lines of one call of the loop; `shown` False shows nothing."""

    def __init__(self, *, shown: bool, steps: int, start: int, eval_every: int, device: torch.device,
                 say: Callable[[str], None], mfu: Callable[[float], float | None] | None = None):
        self.bar = tqdm(total=steps, initial=start, file=sys.stderr, mininterval=1.0, dynamic_ncols=True,
                        disable=True if not shown else None, unit="step")
        self.line_every = max(1, min(eval_every, steps) // 10) if shown and self.bar.disable else 0
        self.steps, self.device, self.say = steps, device, say
        self.mfu = mfu or (lambda chars_per_s: None)  # the MFU of a rate (None: not known here, the CPU)
        self.recent_s: collections.deque[float] = collections.deque(maxlen=RATE_WINDOW)  # step seconds

    def step(self, step: int, loss: float, seconds: float, chars: int) -> None:
        """Step `step` (1-based) is done: its train loss, its seconds and the characters it trained on."""
        self.recent_s.append(seconds)
        line_due = self.line_every and step % self.line_every == 0
        if self.bar.disable and not line_due:
            return
        mem = (f"mem {_fmt_bytes(torch.cuda.memory_allocated(self.device))}" if self.device.type == "cuda"
               else f"rss {_fmt_bytes(devices.rss_bytes())}")
        rate = len(self.recent_s) * chars / sum(self.recent_s)
        mfu = self.mfu(rate)
        status = f"loss {loss:.4f} | {rate:,.0f} char/s | " + (f"MFU {mfu:.1%} | " if mfu is not None else "") + mem
        if self.bar.disable:
            self.say(f"step {step}/{self.steps}: {status}")
        else:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _fmt_bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}GiB"
