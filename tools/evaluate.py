"""Held-out loss of a checkpoint on any text: the entry point of `python tools/evaluate.py`.

The code is minagi/evaluate.py (`python -m minagi.evaluate`, `minagi-eval` once installed): `--help` says it all.
"""
import sys

from minagi.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
