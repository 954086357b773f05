"""Build ``mdm_lens/zoo/assets/tokenizer.json`` and report coverage and prompt lengths.

Run ``python -m mdm_lens.zoo.build_tokenizer`` after changing any pool or template in
``mdm_lens.zoo.data``; the test suite fails if the shipped file drifts from a rebuild.
"""

from __future__ import annotations

import argparse

from mdm_lens.zoo.data import make_dataset
from mdm_lens.zoo.tokenizer import TOKENIZER_PATH, UNK_ID, build_tokenizer, save_tokenizer


def measure_lengths(n: int = 2000, seed: int = 0) -> dict[str, int]:
    """Max prompt token length per distractor count (and no-context), with UNK check."""
    tok = build_tokenizer()
    out: dict[str, int] = {}
    settings = [("no_context", 0, True)] + [(str(k), k, False) for k in (0, 4, 8, 19)]
    for name, k, no_ctx in settings:
        items = make_dataset(n, seed, n_distractors=k, no_context=no_ctx)
        lengths = []
        for it in items:
            ids = tok.encode(it.prompt, add_special_tokens=False).ids
            if UNK_ID in ids:
                raise RuntimeError(f"<unk> in generated prompt: {it.prompt!r}")
            lengths.append(len(ids))
        out[name] = max(lengths)
    return out


def main() -> None:
    """CLI entry: write the tokenizer, print vocab size and max prompt lengths."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(TOKENIZER_PATH))
    parser.add_argument("--n", type=int, default=2000, help="items per length setting")
    args = parser.parse_args()
    path = save_tokenizer(args.out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    print(f"vocab size: {build_tokenizer().get_vocab_size(with_added_tokens=True)}")
    for name, length in measure_lengths(args.n).items():
        print(f"max prompt tokens, distractors={name}: {length}")


if __name__ == "__main__":
    main()
