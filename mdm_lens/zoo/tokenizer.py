"""Word-level tokenizer for the zoo's synthetic QA data (HF ``tokenizers``).

Why word-level: every answer is then exactly one token, so "did the model produce the
answer" and "which input token holds the evidence" are single-position questions, and
a masked diffusion LM can fill the answer with one ``<mask>``.

* Special tokens have fixed ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<mask>``=3,
  ``<unk>``=4; then passage markers ``[1]``..``[20]``, template words and pool words in
  the stable order of ``data.vocabulary_words()``. Vocab size: 322.
* Pipeline: ``Lowercase`` normaliser; pre-tokeniser = whitespace split, then each chunk
  split into ``[k]`` markers, ``\\w+`` runs and single punctuation marks (so untidy input
  such as ``"kelmira."`` still tokenises); no post-processor (``<bos>`` is written in
  the text by ``data``); decoding joins tokens with single spaces.
* Measured token lengths of ``prompt`` (max over 2000 items per setting, seed 0):
  0 distractors: 22, 4: 60, 8: 97, 19: 194 (no-context: 13). The training text adds
  2 tokens (answer, ``<eos>``), so the 0..8-distractor training mixture fits in 99
  tokens; 19 distractors need a longer context (or are for length stress tests only).
* Special-token strings are matched case-sensitively (write ``<bos>``, not ``<BOS>``).

Rebuild the shipped ``assets/tokenizer.json`` with ``python -m mdm_lens.zoo.build_tokenizer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel

from mdm_lens.items import char_span_to_token_span  # noqa: F401  (re-exported: the core owns region spans)
from mdm_lens.zoo.data import vocabulary_words

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<mask>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, MASK_ID, UNK_ID = range(len(SPECIAL_TOKENS))
PAD, BOS, EOS, MASK, UNK = SPECIAL_TOKENS

TOKENIZER_PATH: Path = Path(__file__).resolve().parent / "assets" / "tokenizer.json"

#: Within a whitespace-free chunk: a passage marker, a word, or one punctuation mark.
_CHUNK_PATTERN = r"\[\d+\]|\w+|[^\w\s]"


def build_tokenizer() -> Tokenizer:
    """Build the word-level tokenizer over the generator's complete vocabulary.

    The vocabulary is enumerated from the pools and templates rather than counted
    from samples, so coverage is complete by construction and ids are deterministic.
    """
    words = [w for w in vocabulary_words() if w not in SPECIAL_TOKENS]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *words])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(_CHUNK_PATTERN), behavior="isolated"),
        ]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(path: Path | str = TOKENIZER_PATH) -> Path:
    """Build and write the tokenizer JSON (compact, for shipping in the package)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path), pretty=False)
    return path


@lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    """Load the shipped tokenizer (cached: it is immutable in use)."""
    return Tokenizer.from_file(str(TOKENIZER_PATH))


def vocab_size() -> int:
    """Number of token ids, special tokens included."""
    return load_tokenizer().get_vocab_size(with_added_tokens=True)


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (no tokens are added: write ``<bos>`` in the text)."""
    return load_tokenizer().encode(text, add_special_tokens=False).ids


def encode_with_offsets(text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids plus per-token half-open character offsets into ``text``.

    One tokenisation gives both ids and positions, so prompt regions (question,
    passages, evidence) map to exactly the token positions the model sees.
    """
    enc = load_tokenizer().encode(text, add_special_tokens=False)
    return enc.ids, [tuple(o) for o in enc.offsets]


def decode(ids: Sequence[int], skip_pad: bool = True) -> str:
    """Space-joined tokens; specials such as ``<mask>`` stay visible, pads are dropped.

    ``Tokenizer.decode`` would hide ``<mask>`` (a special token), which defeats the
    purpose of inspecting partially denoised MDM samples, hence the manual join.
    """
    tok = load_tokenizer()
    out: list[str] = []
    for i in ids:
        i = int(i)
        if skip_pad and i == PAD_ID:
            continue
        out.append(tok.id_to_token(i) or UNK)
    return " ".join(out)
