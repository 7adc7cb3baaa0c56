"""The optimizer a run trains with (`build_optimizer`): torch's AdamW with fp32 moments, or AdamW whose
two moments are held in bf16 (`AdamWBF16`, `train.optimizer_states = "bf16"`).

Bytes per trainable weight (fp32 weights): fp32 moments 4 (weight) + 8 (moments) = 12 between steps,
16 with the gradient during a step; bf16 moments 4 + 4 = 8, and 12 (docs/benchmarks.md §15).

`AdamWBF16` computes each update in fp32 from the stored moments and writes them back with stochastic
rounding (the fp32 value rounded up or down at random, with the chance that keeps its mean: torchao's
`bf16_stochastic_round`, Gupta et al. 2015). Rounded to nearest, a second moment decaying by beta2 =
0.999 a step would stall: 0.1% is below bf16's resolution (2^-8). The random bits come from a generator
seeded by (the group's seed, the step, the group and the chunk), so a resume draws what the uninterrupted
run drew, whatever else used the global generators. The arithmetic is torch's `_foreach` ops over each device's tensors
(one kernel per op, not per tensor) on views of one flat fp32 buffer per moment, rounded back at once,
in chunks of at most CHUNK weights (a larger tensor alone): the update's temporaries (the two fp32
moments, the denominator, the rounding's bits and result: ~20 bytes a weight) then cost at most
20 x CHUNK bytes at a time, not 20 bytes a weight (which would make the update the peak of a small card).

On an NVIDIA GPU with Triton the update is instead one launch a group (minagi/adamw_triton.py: the
same arithmetic, one pass over each tensor, no temporaries, its rounding bits Philox's at (a per-tensor
seed, the element)). The
foreach form launches ~20 kernels and a few copies a chunk; its launches held the host, and bf16 states
trained at 0.71x fp32's speed (docs/benchmarks.md §16). `fused` says which: None picks the kernel where
it runs and passes its probe. The two draw different rounding bits, so a run resumed exactly takes the
same form as before (a machine without Triton cannot go on bit for bit). `tools/bench_optim.py` times
the three optimizers side by side.
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Iterable

import torch
from torch import Tensor

__all__ = ["AdamWBF16", "build_optimizer", "clips_in_update", "state_bytes", "step_divided"]

_STATE_KEYS = ("exp_avg", "exp_avg_sq")
CHUNK = 1 << 24  # weights updated together: temporaries of at most ~20 x 16M bytes = 320 MiB
_TRITON = importlib.util.find_spec("triton") is not None
_WARNED: set[torch.device] = set()  # devices whose failed kernel probe was said
UPDATE_TEMP = 20  # bytes a weight of a chunk the update holds at once: 2 x 4 fp32 moments, 4 denominator
#                   (freed before rounding) or 2 + 9 rounding (bf16 result, int32 bits, mask, where's copy)


def build_optimizer(param_groups: list[dict], *, lr: float, betas: tuple[float, float], states: str,
                    device: torch.device, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over `param_groups` with `states` ("fp32": torch's, fused on CUDA; "bf16": `AdamWBF16`)."""
    if states == "fp32":
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, fused=device.type == "cuda")
    if states == "bf16":
        return AdamWBF16(param_groups, lr=lr, betas=betas, seed=seed)
    raise ValueError(f"train.optimizer_states must be fp32 or bf16; got {states!r}")


def clips_in_update(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can divide the gradients as its update reads them: torch's AdamW, fused
    (its `grad_scale`, which torch's GradScaler sets to unscale fp16 gradients, divides every gradient
    inside the update's one pass, which then writes each gradient back divided). Clipping there saves
    clip_grad_norm_'s multiply: its launches, and 4 bytes a weight (the multiply read and wrote each
    gradient; the update writes what it reads)."""
    return type(optimizer) is torch.optim.AdamW and all(g.get("fused") for g in optimizer.param_groups)


def step_divided(optimizer: torch.optim.Optimizer, divisor: Tensor | None) -> None:
    """optimizer.step() with every gradient divided by `divisor` (a 0-d fp32 tensor on the gradients'
    device; None: as they are) inside the fused update (`clips_in_update`). The attribute is the one
    torch's GradScaler sets around a step, and it is gone again after this one."""
    if divisor is None:
        optimizer.step()
        return
    optimizer.grad_scale = divisor
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (moments; not the step counters), counted once each."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for key in _STATE_KEYS:
            t = state.get(key)
            if isinstance(t, Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def stochastic_round_(dest_bf16: Tensor, value_fp32: Tensor, generator: torch.Generator) -> None:
    """dest = value rounded to bf16 up or down at random, E[dest] = value: random bits below bf16's 16
    kept bits are added to the fp32 pattern, which is then cut to its top 16 bits (inf and NaN stay)."""
    bits = value_fp32.view(torch.int32)
    rounded = torch.randint(0, 1 << 16, value_fp32.shape, dtype=torch.int32, device=value_fp32.device,
                            generator=generator)
    rounded.add_(bits).bitwise_and_(-65536)  # in place: -65536 = 0xFFFF0000
    rounded = torch.where(torch.isfinite(value_fp32), rounded, bits)
    dest_bf16.copy_(rounded.view(torch.float32))  # exact: the low 16 bits are zero (NaN keeps its NaN)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) with bf16 moments; weights and gradients as they
    are (fp32). Same hyper-parameters and update as `torch.optim.AdamW` with amsgrad off."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, seed: int = 0, fused: bool | None = None):
        if lr <= 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or weight_decay < 0:
            raise ValueError(f"invalid AdamW settings: lr {lr}, betas {betas}, eps {eps}, weight_decay {weight_decay}")
        if fused and not _TRITON:
            raise RuntimeError("AdamWBF16(fused=True) needs Triton, which is not installed here")
        # Not a group setting: a checkpoint's param_groups (written with or without it) must load either way.
        self.fused = fused
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seed=seed))

    def fuses(self, device: torch.device) -> bool:
        """Whether tensors on `device` take the Triton kernel: `fused` as given, else (None) an NVIDIA GPU with Triton
        (ROCm's Triton was never run with it) where the kernel passed its probe there (`adamw_triton.works`;
        a failure is one warning). fused=True on the CPU runs Triton's interpreter (TRITON_INTERPRET=1)."""
        if self.fused is not None:
            return self.fused
        if not (device.type == "cuda" and _TRITON and torch.version.hip is None):
            return False
        from . import adamw_triton  # imports Triton: only runs that may fuse pay for it
        why = adamw_triton.works(device)
        if why and device not in _WARNED:
            _WARNED.add(device)
            warnings.warn(f"the fused bf16 AdamW kernel {why} on {device} (torch {torch.__version__}): the bf16 "
                          "states update through torch's foreach ops instead", stacklevel=2)
        return not why

    def __getstate__(self) -> dict:
        # torch's Optimizer pickles (and deep-copies) only defaults, state and param_groups.
        return {**super().__getstate__(), "fused": self.fused}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__({"fused": None, **state})

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts every floating state tensor to its parameter's dtype on load: the moments go back to bf16."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in _STATE_KEYS:
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, group in enumerate(self.param_groups):
            by_device: dict[torch.device, list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("AdamWBF16 does not support sparse gradients")
                    by_device.setdefault(p.device, []).append(p)
            for device, params in by_device.items():
                if self.fuses(device):
                    params = self._update_fused(group, params, g)  # what the kernel cannot take is left
                if params:
                    generator = torch.Generator(device=device)
                    for c, chunk in enumerate(_chunks(params)):
                        self._update(group, chunk, generator, (g, c))
        return loss

    def _update_fused(self, group: dict, params: list[Tensor], g: int) -> list[Tensor]:
        """One AdamW step of each of `params` that the kernel takes, in one launch (minagi/adamw_triton.py),
        each tensor's rounding seeded by (the group's seed, the step, group `g`, its place in the group);
        the rest returned."""
        from . import adamw_triton  # imports Triton: only runs that fuse pay for it
        taken, places, counters, left = [], [], [], []
        for t, p in enumerate(params):
            state = self._state(p)
            if not adamw_triton.fits(p, p.grad, state["exp_avg"], state["exp_avg_sq"]):
                left.append(p)
                continue
            taken.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
            places.append(t)
            counters.append(state["step"])
        if taken:
            torch._foreach_add_(counters, 1)  # the CPU step counters, at once: a tensor each costs the host ~4 us
            steps = [int(s) for s in torch.stack(counters).tolist()]
            seeds = [(((group["seed"] * 1_000_003 + s) * 1_009 + g) * 65_537 + t) % 2**63 for s, t in zip(steps, places)]
            beta1, beta2 = group["betas"]
            adamw_triton.update_many_(taken, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                      weight_decay=group["weight_decay"], steps=steps, seeds=seeds, fitted=True)
        return left

    def _update(self, group: dict, params: list[Tensor], generator: torch.Generator, where: tuple[int, int]) -> None:
        """One AdamW step of `params` (one device, one chunk): the moments read into one flat fp32 buffer
        each, updated there (foreach over views of it), rounded back to bf16 at once, copied home; the
        rounding's bits seeded by (the group's seed, the step, `where`: group and chunk)."""
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        states = [self._state(p) for p in params]
        for s in states:
            s["step"] += 1
        step = int(states[0]["step"])  # a group's parameters step together
        sizes = [p.numel() for p in params]
        grads = [p.grad.float() for p in params]
        flat = {key: torch.cat([s[key].reshape(-1) for s in states]).float() for key in _STATE_KEYS}  # reshape: a weight may be strided
        exp_avg, exp_avg_sq = ([t.view_as(p) for t, p in zip(flat[key].split(sizes), params)] for key in _STATE_KEYS)
        torch._foreach_lerp_(exp_avg, grads, 1 - beta1)  # m = beta1 m + (1 - beta1) g
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - beta2)  # v = beta2 v + (1 - beta2) g^2
        if decay:
            torch._foreach_mul_(params, 1 - lr * decay)
        correction1, correction2 = 1 - beta1 ** step, 1 - beta2 ** step
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, correction2 ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, -lr / correction1)
        del denom
        g, c = where
        generator.manual_seed((((group["seed"] * 1_000_003 + step) * 1_009 + g) * 65_537 + c) % 2**63)
        for key in _STATE_KEYS:
            rounded = torch.empty(flat[key].shape, dtype=torch.bfloat16, device=flat[key].device)
            stochastic_round_(rounded, flat[key], generator)
            torch._foreach_copy_([s[key] for s in states], [t.view_as(p) for t, p in zip(rounded.split(sizes), params)])

    def _state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # on the CPU, as torch's non-capturable AdamW
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        return state


def _chunks(params: list[Tensor]) -> list[list[Tensor]]:
    """`params` in order, in runs of at most CHUNK weights (a tensor larger than CHUNK alone)."""
    chunks, run, size = [], [], 0
    for p in params:
        if run and size + p.numel() > CHUNK:
            chunks.append(run)
            run, size = [], 0
        run.append(p)
        size += p.numel()
    return chunks + [run] if run else chunks
