"""Run a script as on a machine without Triton (Windows, ROCm on Windows), on this one:

    python tools/without_triton.py tools/bench_paired.py --profile strix_large --set pool.dispatch=grouped ...
    python tools/without_triton.py train.py --profile cuda_small

Triton is hidden before torch is imported (`import triton` fails, `find_spec("triton")` is None), so
torch, inductor and minagi all take their Triton-less paths: the jiterator SwiGLU, the bucketed
dispatch where torch has no grouped GEMM, a compile through inductor refused. How docs/benchmarks.md
section 24 stood an H200 in for such a card. Ranks that train.py --nproc-per-node launches are new
processes, which see Triton again.
"""
import os
import runpy
import sys

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python tools/without_triton.py SCRIPT [ARGS...] (--help says more)")
    if sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    sys.modules["triton"] = None
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` would have it
    runpy.run_path(sys.argv[0], run_name="__main__")
