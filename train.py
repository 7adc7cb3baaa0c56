"""Train a minagi character-level MoE model: the entry point of `python train.py` and `torchrun ... train.py`.

The code is minagi/train.py (`python -m minagi.train`, `minagi-train` once installed): `--help` says it all.
"""
import sys
from pathlib import Path

from minagi.train import main

if __name__ == "__main__":
    sys.exit(main(entry=str(Path(__file__).resolve())))
