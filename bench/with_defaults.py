"""Runs a module as __main__ with kernel or top-k defaults set first, so that any benchmark
(the `jaxspec-bench` CLI included) can be timed with another default, each setting in its own
process, as `--kernel-default` does for bench_cycle, profile_cycle and bench_engine:

    PYTHONPATH=$PWD python3 bench/with_defaults.py --kernel-default topk.PALLAS_TOP_K=False \
        jaxspec.bench_cli --model $GGUF --batch-sizes 1 --spec default

NAME=VALUE as in `bench.common.set_kernel_defaults`; everything after the module's name goes to
the module as its own arguments.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_kernel_default, apply_kernel_defaults  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_kernel_default(ap)
    ap.add_argument("module", help="the module to run as __main__, e.g. jaxspec.bench_cli")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the module's own arguments")
    a = ap.parse_args(argv)
    apply_kernel_defaults(a)
    sys.argv = [a.module, *a.args]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
