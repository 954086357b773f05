"""`mdm-lens` command line: `demo`, `bench`."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from mdm_lens.demo import run_demo

    run_demo(out=args.out, quick=args.quick)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.__main__ import main as bench_main  # benchmarks live beside the package, in the repo

    return bench_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mdm-lens", description="Interpretability for masked diffusion LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the analyses on the shipped tiny twins and write an HTML report")
    demo.add_argument("--out", default="mdm_lens_report", help="folder for the report (default: ./mdm_lens_report)")
    demo.add_argument("--quick", action="store_true", help="fewer samples (for smoke tests)")
    demo.set_defaults(func=_demo)
    bench = sub.add_parser("bench", help="run the ratio benchmarks (repository checkout only)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
