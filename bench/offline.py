"""Offline engine benchmark: `python bench/offline.py --config 2b --batch-sizes 1,64,256` (same as
`jetserve bench offline`)."""

from __future__ import annotations

import argparse
import sys

from jetserve.engine.bench_offline import add_offline_bench_arguments, run_offline_bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_offline_bench_arguments(parser)
    return run_offline_bench(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
