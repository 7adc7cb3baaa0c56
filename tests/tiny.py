"""What the tests that train a tiny model on the CPU share: the text, the settings, one run helper."""
from __future__ import annotations

from pathlib import Path

from minagi.config import Config, load_config
from minagi.trainer import TrainResult, train

# One row of width 32, 4 experts top-2, 4 x 16 characters a step: a run takes well under a second.
TINY = ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "model.context=16",
        "pool.n_experts=4", "pool.top_k=2", "pool.d_expert=32",
        "train.steps=6", "train.batch_size=4", "train.warmup_steps=2", "train.eval_every=3",
        "train.eval_batches=2", "train.device=cpu"]


def tiny_text() -> str:
    """Deterministic, varied enough that the loss falls within a few steps; ~9k characters."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "sleeps", "moon"]
    return "".join(f"{i:03d} {' '.join(words[(i * j) % len(words)] for j in range(1, 7))}.\n"
                   for i in range(200))


def write_tiny_text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    if not path.exists():
        path.write_text(tiny_text(), encoding="utf-8")
    return path


def tiny_cfg(tmp_path: Path, data_path: Path | None, *extra: str, run_name: str = "run",
             settings: list[str] = TINY) -> Config:
    """`settings`, then the data, cache and run folder in tmp_path, then `extra`."""
    data_path = data_path if data_path is not None else write_tiny_text(tmp_path)
    return load_config(None, [*settings, f"data.path={data_path}", f"data.cache_dir={tmp_path / 'cache'}",
                              f"train.out_dir={tmp_path / 'runs'}", f"train.run_name={run_name}", *extra])


def tiny_argv(tmp_path: Path, data_path: Path, *extra: str, run_name: str = "run",
              settings: list[str] = TINY) -> list[str]:
    """train.py's arguments for the run `tiny_cfg` describes: --data, --run-name and --set items."""
    sets = [*settings, f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={tmp_path / 'runs'}", *extra]
    return ["--data", str(data_path), "--run-name", run_name, *[arg for item in sets for arg in ("--set", item)]]


def run_tiny(tmp_path: Path, data_path: Path | None, *extra: str, run_name: str = "run",
             settings: list[str] = TINY, **kwargs) -> TrainResult:
    """Train `tiny_cfg(...)` quietly in this process (data_path None: the tiny text in tmp_path)."""
    return train(tiny_cfg(tmp_path, data_path, *extra, run_name=run_name, settings=settings), "tiny",
                 progress=False, log=lambda msg: None, argv=["test"], **kwargs)


def new_pool(d_model: int, d_expert: int, n_experts: int, top_k: int, path: str = "grouped", **pool_settings):
    """A PooledMLP from plain numbers: the tests' shorthand for a [pool] section and a path."""
    from minagi.config import PoolConfig
    from minagi.pool import PooledMLP
    cfg = PoolConfig(n_experts=n_experts, top_k=top_k, d_expert=d_expert, **pool_settings)
    return PooledMLP(d_model, cfg, path)


def interrupt_at(monkeypatch, at_step: int) -> None:
    """Ctrl-C as the training loop takes the batch of 0-based step `at_step` (after `at_step` steps)."""
    from minagi.trainer import Trainer
    take = Trainer._batch

    def interrupting(self, step):
        if step == at_step:
            raise KeyboardInterrupt
        return take(self, step)
    monkeypatch.setattr(Trainer, "_batch", interrupting)
