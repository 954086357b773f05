"""``python -m mdm_lens.sweep`` (also under ``torchrun``) and the ``mdm-lens sweep`` subcommand."""

from __future__ import annotations

import argparse
import sys

from mdm_lens import validate
from mdm_lens.errors import MDMLensError


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``prog: error: ...``, exit 2), not the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(e: BaseException, code: int) -> int:
    """Print an error as one line on stderr and return its exit code (2: bad arguments or data; 1: I/O)."""
    print("error: " + " ".join(str(e).split()), file=sys.stderr)
    return code


#: count flags and their smallest value; checked with the flag's name in the message
COUNTS = {"limit": 1, "batch_size": 1, "steps": 1, "gen_length": 1, "block_length": 1, "seed": 0, "keep_keys": 0,
          "max_passages": 1}


def check_counts(a: argparse.Namespace) -> None:
    """The count flags and ``--out``, named as flags (the runner checks them again, by argument name)."""
    for name, low in COUNTS.items():
        v = getattr(a, name, None)
        if v is not None:
            validate.integer(v, name="--" + name.replace("_", "-"), min=low)
    validate.output_folder(a.out, name="--out", allowed="a folder (new or a sweep folder)")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from mdm_lens.sweep.adapter import PROBES
    from mdm_lens.sweep.runner import DTYPES
    from mdm_lens.sweep.templates import TEMPLATES

    p.add_argument("--model", required=True, help="hub id or local folder (e.g. mdm-lens/tiny-mdm)")
    p.add_argument("--data", required=True, help="jsonl: KILT / Attention-Floating items or {id, prompt} lines")
    p.add_argument("--probes", required=True, help=f"comma-separated, from: {','.join(PROBES)}")
    p.add_argument("--out", required=True, help="sweep folder (reruns resume into it)")
    p.add_argument("--limit", type=int, default=None, help="first N usable items (raise it on a finished run to "
                   "add items: only the new ones are computed)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default gen_length)")
    p.add_argument("--gen-length", type=int, default=None, help="default: the checkpoint's trained canvas, else 32")
    p.add_argument("--block-length", type=int, default=None, help="LLaDA block length (default gen_length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank under torchrun)")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--template", default="auto", choices=TEMPLATES)
    p.add_argument("--batching", default="length", choices=("length", "padded"),
                   help="length: model calls on equal-length prompts only, never padded (rows bit-identical to "
                        "one item alone; temporal's received-attention record to ~1e-8); padded: left-pad a "
                        "batch's mixed lengths (fewer model calls, equal up to fp32 rounding)")
    p.add_argument("--keep-keys", type=int, default=1, help="items whose per-key temporal rows are kept")
    p.add_argument("--max-passages", type=int, default=None, help="passages the rag / chat prompts show (default "
                   "5; refused under the zoo template, which shows them all); an item whose gold passage would not be "
                   "shown is refused (or skipped with --skip-bad)")
    p.add_argument("--force", action="store_true", help="overwrite a folder made with other arguments")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed lines and items a probe cannot use "
                   "(each with its reason in skipped.parquet and manifest.json)")
    p.add_argument("--no-progress", action="store_true")
    return p


def run_from_args(a: argparse.Namespace) -> int:
    from mdm_lens.sweep.runner import run

    check_counts(a)
    tables = run(a.model, a.data, a.probes, a.out, limit=a.limit, batch_size=a.batch_size, steps=a.steps,
                 gen_length=a.gen_length, block_length=a.block_length, seed=a.seed, device=a.device, dtype=a.dtype,
                 template=a.template, force=a.force, skip_bad=a.skip_bad, keep_keys=a.keep_keys, batching=a.batching,
                 max_passages=a.max_passages, progress=not a.no_progress)
    import os
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"sweep: {a.out}  (" + ", ".join(f"{k}: {len(v)} rows" for k, v in tables.items()
                                               if not k.endswith("_summary")) + ")")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(Parser(prog="python -m mdm_lens.sweep", description=__doc__))
    a = p.parse_args(argv)
    try:
        return run_from_args(a)
    except MDMLensError as e:
        return fail(e, 2)
    except OSError as e:
        return fail(e, 1)


if __name__ == "__main__":
    sys.exit(main())
