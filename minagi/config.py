"""Strict configuration: one frozen, keyword-only dataclass per component, loaded from TOML.

A profile (``profiles/<name>.toml`` in a clone, shipped inside the installed package as
``minagi/profiles/``: `PROFILES_DIR`) has one table per component -- ``[model]``, ``[pool]``,
``[data]``, ``[train]``, ``[memory]`` -- and may carry a top-level ``description = "..."``. Precedence:
``--set section.key=value`` > profile > dataclass defaults.

Loading is strict (torchtitan's habit): an unknown section or key, a wrong type, a value outside a
``Literal`` or an impossible value raises :class:`ConfigError`, whose message is ONE line naming
the source (file or ``--set``) and the dotted key, e.g.
``profiles/foo.toml: unknown key 'pool.n_expert' (valid: ...); did you mean 'n_experts'?``.
"""

import dataclasses
import difflib
import json
import math
import re
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


def _profiles_dir() -> Path:
    """The shipped profiles: package data of an installed minagi (minagi/profiles/), else the clone's
    profiles/ beside the package (a clone, or an editable install of one)."""
    package = Path(__file__).resolve().parent
    installed = package / "profiles"
    return installed if installed.is_dir() else package.parent / "profiles"


PROFILES_DIR = _profiles_dir()


class ConfigError(ValueError):
    """A configuration problem. ``str(err)`` is one line; ``err.key`` is the dotted key, if any, and
    ``err.related`` the other keys of a rule between several (``top_k <= n_experts``)."""

    def __init__(self, message: str, key: str | None = None, related: tuple[str, ...] = ()):
        super().__init__(" ".join(message.splitlines()))  # one line, whatever was interpolated
        self.key = key
        self.related = related


class ConfigNote(UserWarning):
    """A setting the loader adapted, and why (a profile's warmup fitted to a shorter train.steps)."""


# --- value checks shared by __post_init__ and the loader -------------------------------------

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
               tuple[str, ...]: "an array of strings"}


def _toml_type(value: Any) -> str:
    """The TOML name of a parsed value's type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    return f"a {type(value).__name__}"  # TOML dates and times


def _fmt(value: Any) -> str:
    """A value as TOML would spell it, shortened, for one-line messages."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_type(key: str, typ: Any, value: Any) -> Any:
    """Check ``value`` against a field type; return it with an int widened to float where needed.

    bool is not accepted for int (``isinstance(True, int)`` holds in Python, not in the config).
    A union (``bool | Literal["rows"]``) takes a value any of its members takes.
    """
    if _is_union(typ):
        for member in typing.get_args(typ):
            try:
                return _check_type(key, member, value)
            except ConfigError:
                continue
        raise ConfigError(f"{key} = {_fmt(value)} is not one of: {_union_choices(typ)}", key)
    if typing.get_origin(typ) is Literal:
        choices = typing.get_args(typ)
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"{key} = {_fmt(value)} is not one of: {', '.join(choices)}", key)
        return value
    if typing.get_origin(typ) is tuple:  # tuple[str, ...]: a TOML array of strings
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} = {_fmt(value)} has the wrong type: expected an array of strings, "
                              f"got {_toml_type(value)}", key)
        return tuple(value)
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif typ is str:
        ok = isinstance(value, str)
    else:  # a field type this checker does not know: a bug in this module, not in the profile
        raise AssertionError(f"{key}: unsupported field type {typ!r}")
    if not ok:
        raise ConfigError(f"{key} = {_fmt(value)} has the wrong type: expected "
                          f"{_TYPE_NAMES[typ]}, got {_toml_type(value)}", key)
    if typ is float:
        try:
            value = float(value)
        except OverflowError:  # an int too large for a float
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {_fmt(value)} is impossible: must be a finite number", key)
    return value


def _is_union(typ: Any) -> bool:
    return typing.get_origin(typ) in (typing.Union, types.UnionType)


def _union_choices(typ: Any) -> str:
    """`true, false, "rows"`: what a union of bool and string literals takes, as TOML spells it."""
    out = []
    for member in typing.get_args(typ):
        out += ["true", "false"] if member is bool else [_fmt(c) for c in typing.get_args(member)]
    return ", ".join(out)


def _require(ok: bool, key: str, value: Any, why: str, related: tuple[str, ...] = ()) -> None:
    if not ok:
        raise ConfigError(f"{key} = {_fmt(value)} is impossible: {why}", key, related)


class _Section:
    """Mixin for the component dataclasses: type checks every field, then ``_validate``."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f"{self.section}.{f.name}", f.type, getattr(self, f.name))
        self._validate()

    def _validate(self) -> None:
        pass

    def _at_least(self, minimum: float, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            _require(value >= minimum, f"{self.section}.{name}", value, f"must be >= {minimum}")

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            _require(value > 0, f"{self.section}.{name}", value, "must be > 0")


# --- the components --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
    """The char LM: rows of attention + an MLP, pooled experts (`[pool]`) or a dense SwiGLU twin."""

    section: ClassVar[str] = "model"

    n_rows: int = 2
    d_model: int = 64
    n_heads: int = 4
    context: int = 64  # characters per training sequence (and max KV length default)
    rope_base: float = 10000.0
    mlp: Literal["pooled", "dense"] = "pooled"
    d_dense: int = 0  # the dense twin's hidden width; 0 = pool.dense_width, (top_k + shared_experts) x d_expert
    dropout: float = 0.0  # on the embedding, the attention probabilities and each residual branch (training)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def _validate(self) -> None:
        self._at_least(1, "n_rows", "d_model", "n_heads", "context")
        self._at_least(0, "d_dense")
        _require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")
        _require(self.d_model % self.n_heads == 0, "model.d_model", self.d_model,
                 f"must be a multiple of n_heads ({self.n_heads})", ("model.n_heads",))
        _require(self.head_dim % 2 == 0, "model.d_model", self.d_model,
                 f"head dim d_model // n_heads = {self.head_dim} must be even "
                 "(RoPE rotates pairs of channels)", ("model.n_heads",))
        self._positive("rope_base")


@dataclass(frozen=True, kw_only=True)
class PoolConfig(_Section):
    """One row's pooled experts: the router, the card of experts and how they are dispatched.

    Passed whole to `PooledMLP`; checked here once.
    """

    section: ClassVar[str] = "pool"

    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 64  # F, the expert width
    # Always-on SwiGLU experts of width d_expert beside the routed ones (DeepSeekMoE), added to the
    # routed output; held as one SwiGLU of width shared_experts x d_expert (minagi/pool.py). They stay
    # trainable whatever [experts] says: frozen/NF4, LoRA and offload apply to the routed stack only.
    shared_experts: int = 0
    capacity_factor: float = 0.0  # 0 = uncapped (dropless)
    dispatch: Literal["auto", "grouped", "native", "triton", "rectangle", "loop"] = "auto"
    balance_coef: float = 0.01  # Switch E*sum f_i P_i
    z_loss_coef: float = 0.0
    aux_free_bias: bool = False  # DeepSeek-V3 selection bias
    bias_update_rate: float = 1e-3
    # How the router scores experts (minagi/router.py): a softmax over the E logits, or DeepSeek-V3's
    # sigmoid per expert, gates normalised over the chosen top_k.
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    sink_ratio: float = 4.0  # reporting only: an expert over sink_ratio x fair share counts as a sink
    # The SwiGLU's kernels (minagi/swiglu.py): auto = minagi's Triton kernels where they run, else
    # torch's jiterator ones on a GPU; jiterator = those on any GPU (a card without Triton); eager = torch ops.
    swiglu: Literal["auto", "jiterator", "eager"] = "auto"
    expert_dropout: float = 0.0  # training: each chosen expert's output dropped with this chance (gates rescaled)
    # The balance term's f.P over: the whole optimizer step (all micro-batches and ranks), each
    # micro-batch (one forward, all ranks), or each sequence (then averaged). Equal with accum_steps 1
    # but for "sequence".
    balance_scope: Literal["step", "batch", "sequence"] = "step"

    def _validate(self) -> None:
        self._at_least(1, "n_experts", "top_k", "d_expert")
        _require(0 <= self.expert_dropout < 1, "pool.expert_dropout", self.expert_dropout, "must be in [0, 1)")
        _require(self.top_k <= self.n_experts, "pool.top_k", self.top_k,
                 f"top_k must be <= n_experts ({self.n_experts})", ("pool.n_experts",))
        self._at_least(0, "capacity_factor", "balance_coef", "z_loss_coef", "bias_update_rate")
        self._positive("sink_ratio")
        self._validate_recipe()

    def _validate_recipe(self) -> None:
        """The routing recipe's own settings (shared experts, router scores)."""
        self._at_least(0, "shared_experts")

    @property
    def dense_width(self) -> int:
        """The hidden width of a dense SwiGLU with this pool's active compute per character: the
        top_k routed experts and the shared ones."""
        return (self.top_k + self.shared_experts) * self.d_expert


@dataclass(frozen=True, kw_only=True)
class DataConfig(_Section):
    """Where the characters come from and how many are held out."""

    section: ClassVar[str] = "data"

    path: str = ""  # file, directory or glob; "" = the Python standard library's source files
    heldout_fraction: float = 0.1  # several files: whole files near this share; one file: its last part
    heldout_files: tuple[str, ...] = ()  # hold out exactly these files (names as the corpus lists them)
    strip_gutenberg: bool = False  # drop each file's Project Gutenberg header and licence first
    cache_dir: str = ""  # "" = ~/.cache/minagi

    def _validate(self) -> None:
        _require(0 < self.heldout_fraction < 1, "data.heldout_fraction", self.heldout_fraction,
                 "must be strictly between 0 and 1")


# One rule for every seed a user gives (train.seed, sample.py --seed): what a non-negative int64 holds.
SEED_RULE = "must be >= 0 and < 2**63"


def valid_seed(seed: int) -> bool:
    return 0 <= seed < 2**63


@dataclass(frozen=True, kw_only=True)
class TrainConfig(_Section):
    """The optimisation loop, evaluation cadence and run folder."""

    section: ClassVar[str] = "train"

    steps: int = 300
    batch_size: int = 16  # GLOBAL batch of one forward (sequences, all ranks together)
    accum_steps: int = 1  # micro-batches of batch_size per optimizer step: a step is accum_steps x batch_size
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    warmup_steps: int = 30
    weight_decay: float = 0.1
    expert_weight_decay: float = -1.0  # on the pools' expert stacks; < 0 = weight_decay
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    eval_every: int = 100  # held-out eval + history record + checkpoint every N steps
    eval_batches: int = 8  # held-out batches of the step (accum_steps x batch_size sequences), evaluated micro-batch by micro-batch
    early_stop_evals: int = 0  # > 0: stop when this many evaluations in a row did not beat the best held-out loss
    seed: int = 1337
    # true: the whole training step through torch.compile (static shapes: the native grouped GEMM);
    # "rows": each row's attention, norms and router (a dense twin's whole row) as one graph, the expert
    # dispatch eager (the bucketed path, whose shapes change every step); false: eager.
    compile: bool | Literal["rows"] = False
    # torch.compile's mode, for the whole step (true) and for the rows' compiled regions ("rows");
    # "reduce-overhead" replays the compiled graphs as CUDA graphs (GPU only): far fewer launches where
    # the host sets the step's pace (docs/benchmarks.md section 22).
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    # torch.compile's backend: "inductor" fuses kernels (Triton on a GPU, C++ on the CPU); "cudagraphs"
    # fuses nothing and replays the traced regions (or step) as CUDA graphs of torch's own kernels: no
    # Triton needed (Windows, ROCm on Windows), a GPU needed (docs/benchmarks.md section 24).
    compile_backend: Literal["inductor", "cudagraphs"] = "inductor"
    checkpoint_rows: bool = False  # recompute each row in backward (torch.utils.checkpoint, non-reentrant)
    # Autocast's dtype: auto = bf16 where the device has it natively, else fp32; fp16 scales the loss
    # (torch's GradScaler) and skips a step whose gradients overflow.
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    optimizer_states: Literal["fp32", "bf16"] = "fp32"  # AdamW's two moments (bf16: minagi/optim.py)
    tensorboard: bool = False  # mirror each history record to TensorBoard in the run folder (minagi/watch.py)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    out_dir: str = "runs"
    run_name: str = ""  # "" = <profile>-<YYYYmmdd-HHMMSS>
    # Past one process (docs/multi_gpu.md): "ddp", every rank a whole copy; "fsdp", each row and the
    # embedding/head sharded over the ranks with FSDP2 (one process: no wrapper either way).
    parallel: Literal["ddp", "fsdp"] = "ddp"
    expert_parallel: int = 1  # N > 1: each rank holds n_experts / N experts, routed rows exchanged (all-to-all)

    def _validate(self) -> None:
        self._at_least(1, "steps", "batch_size", "accum_steps", "eval_every", "eval_batches", "expert_parallel")
        self._positive("lr")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio,
                 "must be between 0 and 1")
        self._at_least(0, "warmup_steps", "weight_decay", "grad_clip", "early_stop_evals")
        _require(self.warmup_steps <= self.steps, "train.warmup_steps", self.warmup_steps,
                 f"warmup_steps must be <= steps ({self.steps})", ("train.steps",))
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"train.{name}", value, "must be in [0, 1)")
        _require(valid_seed(self.seed), "train.seed", self.seed, SEED_RULE)
        _require(not (self.checkpoint_rows and self.compile is True), "train.checkpoint_rows", self.checkpoint_rows,
                 "a whole-step compile (train.compile = true) does not recompute rows: the replay's memo is not "
                 "traced; use train.compile = \"rows\" or false with row checkpointing", ("train.compile",))
        _require(self.compile_backend == "inductor" or self.compile_mode == "default", "train.compile_mode",
                 self.compile_mode, f"a mode is inductor's; with train.compile_backend = \"{self.compile_backend}\" "
                 "leave it \"default\" (that backend replays CUDA graphs already)", ("train.compile_backend",))
        _require(self.out_dir != "", "train.out_dir", self.out_dir,
                 "must name a folder (e.g. \"runs\")")
        _require(self.run_name not in (".", "..") and not re.search(r"[/\\]", self.run_name),
                 "train.run_name", self.run_name,
                 "must be a plain folder name inside out_dir (no / or \\)")


def check_cuda_graphs(train: TrainConfig) -> None:
    """CUDA graphs of a compiled step (train.compile_mode = "reduce-overhead", or train.compile_backend =
    "cudagraphs") replay one forward and its backward at a time. Refused in one line when a run is built,
    not when a stored config is read, so a run folder saved before this check still loads, writes and
    resumes (with another compile_mode):
      - gradient accumulation: a backward graph's output becomes a parameter's .grad, and the next
        micro-batch's replay overwrites it (torch issue 169545: an error, on some versions a wrong sum);
      - row checkpointing under "rows": a recompute would call a forward graph inside backward."""
    if train.compile is False or not uses_cuda_graphs(train):
        return
    if train.compile_backend == "cudagraphs":  # the setting that asked for the graphs, and what does without
        key, value, plain = ("train.compile_backend", train.compile_backend,
                             'train.compile_backend = "inductor" (it needs Triton) or train.compile = false')
    else:
        key, value, plain = "train.compile_mode", train.compile_mode, 'train.compile_mode = "default"'
    rules = [("accum_steps", train.accum_steps > 1, "a micro-batch's gradients, outputs of a graph, are overwritten "
              "by the next micro-batch's replay (torch issue 169545)")]
    if train.compile == "rows":
        rules.append(("checkpoint_rows", train.checkpoint_rows, "a checkpointed row's recompute cannot replay them"))
    for setting, on, why in rules:
        toml = str(getattr(train, setting)).lower()  # as TOML writes it
        _require(not on, key, value, f"with CUDA graphs {why}; use {plain} with train.{setting} = {toml}",
                 ("train.compile", f"train.{setting}"))


def uses_cuda_graphs(train: TrainConfig) -> bool:
    """Whether what train.compile compiles is replayed as CUDA graphs (torch's cudagraph trees)."""
    return train.compile_mode == "reduce-overhead" or train.compile_backend == "cudagraphs"


@dataclass(frozen=True, kw_only=True)
class ExpertsConfig(_Section):
    """How the pools' expert stacks are held: trainable (the default), or frozen (NF4 or plain),
    with optional LoRA adapters that train, and what row checkpointing keeps of them."""

    section: ClassVar[str] = "experts"

    frozen: bool = False
    quant: Literal["nf4", "none"] = "nf4"   # frozen stacks in 4-bit NormalFloat, or as bf16 buffers
    blocksize: int = 64                    # NF4 block: one fp32 absmax per this many weights
    double_quant: bool = False             # the absmax quantized too (8-bit, blocks of 256)
    lora_rank: int = 0                     # 0 = no adapters
    lora_alpha: float = 16.0               # adapters scale by lora_alpha / lora_rank
    replay_pin: Literal["auto", "on", "off"] = "auto"  # keep a row replay's dequantized stack for its backward
    pin_floor_mib: float = 512.0           # auto pins a stack only from this size (docs/benchmarks.md)
    offload: Literal["none", "cpu"] = "none"  # frozen stacks homed in pinned CPU memory, staged per row
    prefetch: bool = True                  # offload: copy the next row while this one computes

    def _validate(self) -> None:
        _require(self.blocksize in (32, 64, 128, 256, 512, 1024, 2048, 4096), "experts.blocksize", self.blocksize,
                 "must be a power of two from 32 to 4096")
        self._at_least(0, "lora_rank", "pin_floor_mib")
        _require(self.lora_rank % 8 == 0, "experts.lora_rank", self.lora_rank,
                 "must be a multiple of 8 (grouped GEMMs in bf16 need it; 0 = no adapters)")
        self._positive("lora_alpha")
        _require(self.frozen or self.lora_rank == 0, "experts.lora_rank", self.lora_rank,
                 "LoRA adapters train on frozen experts: set experts.frozen = true (or lora_rank = 0)",
                 ("experts.frozen",))
        _require(self.frozen or self.offload == "none", "experts.offload", self.offload,
                 "only frozen experts can be offloaded: set experts.frozen = true", ("experts.frozen",))
        _require(self.offload == "none" or self.quant == "nf4", "experts.offload", self.offload,
                 "offload stages NF4 stacks: set experts.quant = \"nf4\"", ("experts.quant",))


@dataclass(frozen=True, kw_only=True)
class MemoryConfig(_Section):
    """Allocator settings; applied by the entry point before the first CUDA allocation."""

    section: ClassVar[str] = "memory"

    alloc_conf: str = ""  # e.g. "expandable_segments:True"
    gpu_cap_gib: float = 0.0  # > 0: this process may allocate at most this much of the GPU (a smaller card)

    def _validate(self) -> None:
        # PyTorch parses "key:value,key:value"; a malformed string only warns (or is ignored)
        # at the first allocation, long after the run started -- so catch it here.
        ok = all(re.fullmatch(r"\s*\w+\s*:\s*[^,:\s][^,:]*", item)
                 for item in self.alloc_conf.split(",")) if self.alloc_conf else True
        _require(ok, "memory.alloc_conf", self.alloc_conf,
                 "expected comma-separated name:value pairs, e.g. \"expandable_segments:True\"")
        self._at_least(0, "gpu_cap_gib")


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration: one field per component; TOML sections mirror the fields."""

    model: ModelConfig = field(default_factory=ModelConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, f.type):
                raise ConfigError(f"config.{f.name} must be a {f.type.__name__}, "
                                  f"got {type(value).__name__}", f.name)
        if self.experts.frozen and self.model.mlp == "dense":
            raise ConfigError("experts.frozen = true needs pooled experts: model.mlp is \"dense\"", "experts.frozen")
        per_expert = self.model.d_model * self.pool.d_expert  # down's weights; gate_up holds twice as many
        if self.experts.frozen and self.experts.quant == "nf4" and per_expert % (2 * self.experts.blocksize):
            raise ConfigError(f"experts.blocksize = {self.experts.blocksize} is impossible: an expert's "
                              f"{self.model.d_model} x {self.pool.d_expert} weights must fill whole NF4 blocks "
                              f"(a multiple of 2 x blocksize = {2 * self.experts.blocksize})", "experts.blocksize")
        self._check_parallel()

    def _check_parallel(self) -> None:
        """What train.parallel and train.expert_parallel can run (the world size is checked at launch)."""
        ep = self.train.expert_parallel
        if self.train.parallel == "fsdp" and self.experts.offload != "none":
            raise ConfigError("experts.offload = \"cpu\" with train.parallel = \"fsdp\": fully_shard moves every "
                              "buffer of a row to the GPU, the pinned homes included; offloaded frozen stacks "
                              "train under \"ddp\"", "experts.offload", ("train.parallel",))
        if self.train.parallel == "fsdp" and self.train.optimizer_states != "fp32":
            # AdamWBF16 keeps its moments as views of one flat buffer; FSDP2's DTensor shards are not.
            raise ConfigError("train.optimizer_states = \"bf16\" with train.parallel = \"fsdp\" is not built: "
                              "use \"fp32\" states, or \"ddp\"", "train.optimizer_states", ("train.parallel",))
        if self.train.parallel == "fsdp" and self.train.precision == "fp16":
            # torch's GradScaler unscales local tensors, not FSDP2's sharded gradients.
            raise ConfigError("train.precision = \"fp16\" with train.parallel = \"fsdp\" is not built: use "
                              "bf16 or fp32, or \"ddp\"", "train.precision", ("train.parallel",))
        if ep == 1:
            return
        why = ("needs pooled rows: model.mlp is \"dense\"" if self.model.mlp == "dense" else
               f"must divide pool.n_experts = {self.pool.n_experts}" if self.pool.n_experts % ep else
               "splits trainable stacks only: frozen stacks (experts.frozen) are replicated on every rank"
               if self.experts.frozen else
               "needs dropless routing (pool.capacity_factor = 0): a capacity would be applied per rank, "
               "before the exchange" if self.pool.capacity_factor > 0 else None)
        if why is not None:
            raise ConfigError(f"train.expert_parallel = {ep} {why}", "train.expert_parallel")

    @property
    def dense_width(self) -> int:
        """The dense twin's hidden width: model.d_dense, or the pool's active width when 0."""
        return self.model.d_dense or self.pool.dense_width


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
_TOP_LEVEL_EXTRA = ("description",)  # allowed beside the sections; not part of Config

# Settings a resumed run may change (with --set); any other difference would make the checkpoint and
# the run folder describe a run that never happened.
RESUMABLE_KEYS = (
    "train.steps",      # extending a run
    "train.compile",    # the same model through compiled kernels
    "train.compile_mode",
    "train.compile_backend",
    "pool.sink_ratio",  # reporting only: which loads the diagnostics call sinks
    "pool.swiglu",      # the same function through other kernels
    "data.path",        # where the corpus is now: its content must be the run's (checked on resume)
    "data.cache_dir",   # where its encoding is cached
    "experts.replay_pin",     # the same bits, kept or recomputed
    "experts.pin_floor_mib",
    "experts.offload",        # where the frozen stacks live between uses: the same weights
    "experts.prefetch",
    "train.parallel",         # checkpoints hold the unwrapped, whole model whatever the layout
    "train.expert_parallel",
    "train.tensorboard",      # watching: the history stays the record
)

# Format 1 (checkpoints and run.json before the [pool] section existed) kept these under [model].
_POOL_KEYS_OF_FORMAT_1 = ("n_experts", "top_k", "d_expert", "capacity_factor", "dispatch", "balance_coef",
                          "z_loss_coef", "aux_free_bias", "bias_update_rate", "sink_ratio")


def upgrade_config_dict(d: Mapping) -> dict:
    """A config dict as this code reads it: format 1's pool settings move from [model] to [pool].

    Idempotent; a dict already in the current layout comes back equal.
    """
    d = {k: dict(v) if isinstance(v, Mapping) else v for k, v in d.items()}
    model = d.get("model")
    if isinstance(model, dict) and any(k in model for k in _POOL_KEYS_OF_FORMAT_1):
        pool = d.setdefault("pool", {})
        for key in _POOL_KEYS_OF_FORMAT_1:
            if key in model:
                pool[key] = model.pop(key)
    return d


# --- dicts <-> Config -----------------------------------------------------------------------


def config_to_dict(cfg: Config) -> dict:
    """A nested ``{section: {key: value}}`` dict of bool/int/float/str: JSON- and TOML-able."""
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in SECTIONS}


def _valid_list(names) -> str:
    return ", ".join(sorted(names))


def _hint(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _elsewhere(key: str, section: str) -> str:
    """'; it belongs under [pool]: pool.top_k' when another section has the key (old profiles)."""
    owners = [s for s, cls in SECTIONS.items()
              if s != section and key in {f.name for f in dataclasses.fields(cls)}]
    return f"; it belongs under [{owners[0]}]: {owners[0]}.{key}" if owners else ""


def _section_from_dict(name: str, table: Mapping) -> Any:
    """Build one component from its table; errors are unprefixed (no source) but carry the key."""
    cls = SECTIONS[name]
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        if key not in types:
            raise ConfigError(f"unknown key '{name}.{key}' (valid: {_valid_list(types)})"
                              f"{_hint(key, types) or _elsewhere(key, name)}", f"{name}.{key}")
        kwargs[key] = _check_type(f"{name}.{key}", types[key], value)
    return cls(**kwargs)


def _from_dict(d: Mapping) -> Config:
    """config_from_dict without the source prefix (callers add the source they know)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"expected a table of sections, got {_toml_type(d)}")
    sections = {}
    for key, value in d.items():
        if key in _TOP_LEVEL_EXTRA:
            if not isinstance(value, str):
                raise ConfigError(f"{key} = {_fmt(value)} has the wrong type: expected a string, "
                                  f"got {_toml_type(value)}", key)
            continue
        if key not in SECTIONS:
            if isinstance(value, Mapping):
                raise ConfigError(f"unknown section '[{key}]' (valid: {_valid_list(SECTIONS)})"
                                  f"{_hint(key, SECTIONS)}", key)
            owners = [s for s, cls in SECTIONS.items()
                      if key in {f.name for f in dataclasses.fields(cls)}]
            where = f"; did you mean '{owners[0]}.{key}' (under [{owners[0]}])?" if owners else ""
            raise ConfigError(f"unknown top-level key '{key}' (valid: description and the "
                              f"sections {_valid_list(SECTIONS)}){where}", key)
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{key}' must be a table [{key}], got {_toml_type(value)}", key)
        sections[key] = _section_from_dict(key, value)
    return Config(**sections)


def config_from_dict(d: Mapping, source: str = "<dict>") -> Config:
    """Strictly build a Config from a nested dict; missing sections and keys take the defaults.

    Same checks as a profile file; errors are one line starting with ``source``.
    """
    try:
        return _from_dict(d)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}{_default_hint(d, err.key, source)}", err.key) from None


def _default_hint(d: Mapping, key: str | None, source: str) -> str:
    """Where the key a rule failed on is not in the file, its value is the default: say so, or the
    reader looks for a setting the file does not have."""
    section, _, name = (key or "").partition(".")
    table = d.get(section)
    if not name or (isinstance(table, Mapping) and name in table):
        return ""
    return f" ({key} is the default: {source} does not set it)"


# --- profiles ---------------------------------------------------------------------------------


def _display(path: Path) -> str:
    """A path as short as is unambiguous: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def available_profiles() -> list[str]:
    """Names of the profiles shipped in ``profiles/``."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def resolve_profile(name_or_path: str) -> Path:
    """A path to an existing file (its .toml may be left off), else ``profiles/<name>.toml``, else
    ConfigError listing names."""
    given = Path(name_or_path)
    if given.is_file():
        return given
    stem = name_or_path[:-len(".toml")] if name_or_path.endswith(".toml") else name_or_path
    if "/" in stem or "\\" in stem:  # a path, not a name
        with_suffix = Path(f"{stem}.toml")
        if with_suffix.is_file():
            return with_suffix
        if given.is_dir():
            raise _a_folder(name_or_path)
        raise ConfigError(f"unknown profile '{name_or_path}': no such file, nor {with_suffix} (a name without a "
                          f"folder is one of: {', '.join(available_profiles())})")
    candidate = PROFILES_DIR / f"{stem}.toml"
    if candidate.is_file():
        return candidate
    if given.is_dir():  # after the shipped names: a folder here called h200 must not hide profiles/h200.toml
        raise _a_folder(name_or_path)
    raise ConfigError(f"unknown profile '{name_or_path}': no such file and no "
                      f"{_display(candidate)} (available: {', '.join(available_profiles())})"
                      f"{_hint(stem, available_profiles())}")


def _a_folder(name_or_path: str) -> ConfigError:
    return ConfigError(f"--profile {name_or_path}: a folder, not a profile (a .toml file, or one of: "
                       f"{', '.join(available_profiles())})")


def _read_profile(path: Path) -> dict:
    source = _display(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"{source}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: invalid TOML: {err}") from None


# --- --set overrides --------------------------------------------------------------------------

_KEY_RE = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*")


def override_key(item: str) -> str:
    """The key a ``--set section.key=value`` item sets, spaced or not (``"train.steps = 5"``)."""
    return item.partition("=")[0].strip()


def _parse_override(item: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> (section, key, checked value). Errors name ``--set section.key``.

    The value is read as a TOML value (``20000``, ``3e-4``, ``true``, ``"text"``). A string field
    also takes the raw text when it is not a TOML string, so ``data.path=~/corpus.txt`` and
    ``train.run_name=2024-01-01`` work unquoted.
    """
    key, eq, raw = item.partition("=")
    key, raw = key.strip(), raw.strip()
    if not eq or not _KEY_RE.fullmatch(key):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=20000")
    section, name = key.split(".")
    if section not in SECTIONS:
        raise ConfigError(f"--set {key}: unknown section '{section}' (valid: "
                          f"{_valid_list(SECTIONS)}){_hint(section, SECTIONS)}", key)
    types = {f.name: f.type for f in dataclasses.fields(SECTIONS[section])}
    if name not in types:
        raise ConfigError(f"--set {key}: unknown key '{key}' (valid: {_valid_list(types)})"
                          f"{_hint(name, types) or _elsewhere(name, section)}", key)
    typ = types[name]
    try:
        parsed = tomllib.loads(f"v = {raw}")
        ok = list(parsed) == ["v"]  # "1\nw = 2" would smuggle in a second key
    except tomllib.TOMLDecodeError:
        ok = False
    is_string_field = typ is str or typing.get_origin(typ) is Literal or (
        _is_union(typ) and any(typing.get_origin(m) is Literal for m in typing.get_args(typ)))
    if is_string_field:  # a union also takes its other members' TOML values (true, false)
        value = parsed["v"] if ok and (isinstance(parsed["v"], str) or _is_union(typ)) else raw
    elif ok:
        value = parsed["v"]
    else:
        expected = _TYPE_NAMES.get(typ, "a value")
        raise ConfigError(f"--set {key}: cannot read {raw!r} as {expected} (values are TOML: "
                          "20000, 3e-4, true, \"text\")", key)
    try:
        return section, name, _check_type(key, typ, value)
    except ConfigError as err:
        raise ConfigError(f"--set {key}: {err}", key) from None


def apply_overrides(cfg: Config, overrides: Sequence[str], *, fit_warmup: bool = False) -> Config:
    """Apply ``--set section.key=value`` items in order (a later one wins) and re-validate.

    An impossible combination (``top_k`` above a newly set ``n_experts``) is blamed on the
    ``--set`` of the key it is about, else on the ``--set`` of the other keys of its rule, else on
    the ``--set`` items of the same section.
    fit_warmup: a ``--set train.steps`` below the profile's ``warmup_steps`` (a short first try of a
    long profile) warms up over a tenth of the steps instead, said in a ConfigNote warning, rather
    than failing. A ``--set train.warmup_steps`` above the steps is still an error: the user asked.
    """
    if isinstance(overrides, str):
        overrides = [overrides]  # one "a.b=c" would otherwise be iterated character by character
    d = config_to_dict(cfg)
    set_keys: list[str] = []
    for item in overrides:
        section, name, value = _parse_override(item)
        d[section][name] = value
        set_keys.append(f"{section}.{name}")
    train = d["train"]
    if (fit_warmup and "train.steps" in set_keys and "train.warmup_steps" not in set_keys
            and isinstance(train["steps"], int) and train["warmup_steps"] > train["steps"] >= 1):
        fitted = max(1, train["steps"] // 10)  # at least one: "over 0 steps" read as no warm-up at all
        note = (f"train.warmup_steps = {train['warmup_steps']} exceeds train.steps = {train['steps']}: warming up "
                f"over {fitted} step{'s' if fitted > 1 else ''} (a tenth of them, at least one) instead; --set "
                "train.warmup_steps to choose")
        train["warmup_steps"] = fitted
    else:
        note = None
    try:
        cfg = _from_dict(d)
    except ConfigError as err:
        culprits = ([err.key] if err.key in set_keys else
                    [k for k in set_keys if k in err.related] or
                    [k for k in set_keys if err.key and k.split(".")[0] == err.key.split(".")[0]]
                    or set_keys)
        raise ConfigError(f"--set {', '.join(dict.fromkeys(culprits))}: {err}", err.key, err.related) from None
    if note is not None:  # said once the settings hold: before an unrelated error it would mislead
        warnings.warn(note, ConfigNote, stacklevel=2)
    return cfg


def load_config(profile: str | None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the profile (a name in profiles/ or a .toml path; None = none), then --set.

    The profile must be valid on its own; --set items are checked exactly like the file. A --set
    train.steps below the profile's warmup fits the warmup to it (`apply_overrides`' fit_warmup).
    """
    cfg = Config()
    if profile is not None:
        path = resolve_profile(profile)
        cfg = config_from_dict(_read_profile(path), source=_display(path))
    return apply_overrides(cfg, overrides, fit_warmup=True) if overrides else cfg
