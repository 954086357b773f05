"""`mdm-lens` command line: `demo`, `sweep`, `report`, `zoo export`, `bench`, `export-activations`."""

from __future__ import annotations

import argparse
import sys

from mdm_lens.errors import MDMLensError


def _demo(args: argparse.Namespace) -> int:
    from mdm_lens.demo import run_demo

    run_demo(out=args.out, quick=args.quick)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from mdm_lens.sweep.__main__ import run_from_args

    return run_from_args(args)


def _report(args: argparse.Namespace) -> int:
    from mdm_lens.views.sweep_report import report

    index = report(args.dir, out=args.out)
    print(f"report: {index.resolve()}")
    return 0


GOLD_NAMES = ("random", "first", "middle", "last")


def _check_zoo_export(args: argparse.Namespace) -> None:
    """Every ``zoo export`` flag and their combination, named as flags, before anything is written."""
    from pathlib import Path

    from mdm_lens import validate
    from mdm_lens.errors import ArgumentError
    from mdm_lens.zoo.pools import MAX_PASSAGES

    validate.integer(args.n, name="--n", min=1)
    validate.integer(args.seed, name="--seed", min=0)
    nd = validate.integer(args.n_distractors, name="--n-distractors", min=0, max=MAX_PASSAGES - 1)
    g = args.gold_position
    if isinstance(g, str):
        validate.choice(g, GOLD_NAMES, name="--gold-position")
    else:
        validate.integer(g, name="--gold-position", min=-(nd + 1), max=nd)
    if Path(args.out).is_dir():
        raise ArgumentError(f"--out {args.out!r} is a folder; give the path of the jsonl file to write.",
                            argument="out", value=args.out, allowed="a file path")


def _zoo_export(args: argparse.Namespace) -> int:
    from mdm_lens.zoo import jsonl

    _check_zoo_export(args)
    jsonl.export(args.out, args.n, args.seed, n_distractors=args.n_distractors, gold_position=args.gold_position)
    print(f"wrote {args.n} items to {args.out}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.__main__ import main as bench_main  # benchmarks live beside the package, in the repo

    return bench_main(args.rest)


def _export_activations(args: argparse.Namespace) -> int:
    import os

    from mdm_lens.sae.export import export_activations, parse_steps

    ds = export_activations(args.model, args.data, [h.strip() for h in args.hooks.split(",") if h.strip()],
                            out=args.out, steps=parse_steps(args.steps), positions=args.positions,
                            n_steps=args.n_steps, gen_length=args.gen_length, block_length=args.block_length,
                            batch_size=args.batch_size, seed=args.seed, template=args.template, limit=args.limit,
                            skip_bad=args.skip_bad, store_dtype=args.store_dtype, device=args.device,
                            dtype=args.dtype, force=args.force, progress=not args.no_progress)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"export-activations: {args.out}  ({len(ds)} rows, columns {', '.join(ds.column_names)})")
    return 0


def _add_export_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="hub id or local folder (e.g. mdm-lens/tiny-mdm)")
    p.add_argument("--data", required=True, help="jsonl: KILT / Attention-Floating items or {id, prompt} lines")
    p.add_argument("--hooks", required=True, help="comma-separated hook names or globs (blocks.1.hook_resid_post)")
    p.add_argument("--out", required=True, help="dataset folder (datasets.load_from_disk; reruns resume into it)")
    p.add_argument("--steps", default=None, help="denoising steps to export: all (default), '0,-1', 'every=4'")
    p.add_argument("--positions", default="masked", choices=("masked", "unmasked", "all", "generated"))
    p.add_argument("--n-steps", type=int, default=None, help="denoising steps of the sampler (default gen_length)")
    p.add_argument("--gen-length", type=int, default=None, help="default: the checkpoint's trained canvas, else 32")
    p.add_argument("--block-length", type=int, default=None, help="LLaDA block length (default gen_length)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="first N usable items")
    p.add_argument("--template", default="auto", choices=("auto", "zoo", "rag", "chat"))
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank under torchrun)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    p.add_argument("--store-dtype", default="float32", choices=("float32", "float16"), help="activation dtype")
    p.add_argument("--force", action="store_true", help="overwrite a folder made with other arguments")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed lines (counted in manifest.json)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _gold(v: str):
    """An index (negative counts from the end, as in Python) or a position name; anything else is a usage error."""
    if v.lstrip("-").isdigit():
        return int(v)
    if v not in GOLD_NAMES:
        raise argparse.ArgumentTypeError(f"{v!r} is neither an index nor one of {', '.join(GOLD_NAMES)}")
    return v


def main(argv: list[str] | None = None) -> int:
    from mdm_lens.sweep.__main__ import Parser, add_arguments, fail

    parser = Parser(prog="mdm-lens", description="Interpretability for masked diffusion LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a small sweep over the shipped tiny twins, written as an HTML report")
    demo.add_argument("--out", default="mdm_lens_report", help="folder for the report (default: ./mdm_lens_report)")
    demo.add_argument("--quick", action="store_true", help="fewer samples (for smoke tests)")
    demo.set_defaults(func=_demo)
    sweep = add_arguments(sub.add_parser("sweep", help="run probes over a jsonl dataset (torchrun for many ranks)"))
    sweep.set_defaults(func=_sweep)
    rep = sub.add_parser("report", help="the HTML report (figures and tables) of one or more sweep folders")
    rep.add_argument("dir", help="a sweep folder, or a folder whose subfolders are sweeps (compared side by side)")
    rep.add_argument("--out", default=None, help="report folder (default: DIR/report)")
    rep.set_defaults(func=_report)
    zoo = sub.add_parser("zoo", help="the tiny twins' synthetic data").add_subparsers(dest="zoo_command", required=True)
    exp = zoo.add_parser("export", help="write zoo QA items as jsonl for `mdm-lens sweep`")
    exp.add_argument("--n", type=int, required=True)
    exp.add_argument("--seed", type=int, default=0)
    exp.add_argument("--out", required=True)
    exp.add_argument("--n-distractors", type=int, default=4)
    exp.add_argument("--gold-position", type=_gold, default="random", help="random, first, middle, last or an index")
    exp.set_defaults(func=_zoo_export)
    bench = sub.add_parser("bench", help="run the ratio benchmarks (repository checkout only)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    export = _add_export_arguments(sub.add_parser(
        "export-activations", help="step-wise activations in SAELens' cached-activation layout (torchrun for many ranks)"))
    export.set_defaults(func=_export_activations)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MDMLensError as e:      # bad arguments or data: one line, exit 2 (as argparse's usage errors)
        return fail(e, 2)
    except OSError as e:           # the file system said no (permissions, a full disk): one line, exit 1
        return fail(e, 1)


if __name__ == "__main__":
    sys.exit(main())
