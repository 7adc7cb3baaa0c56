"""Write text with a trained minagi model: the entry point of `python sample.py`.

The code is minagi/sample.py (`python -m minagi.sample`, `minagi-sample` once installed): `--help` says it all.
"""
import sys

from minagi.sample import main

if __name__ == "__main__":
    sys.exit(main())
