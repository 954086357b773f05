"""Zoo data, part 3: SQuAD-style answer scoring (normalise, exact match, substring match, token F1).

The functions live in the core (`mdm_lens.items`: probes and sweep score real data with them); re-exported here."""

from __future__ import annotations

from mdm_lens.items import (  # noqa: F401
    _ARTICLES_RE, _PUNCT_TABLE, _SPECIAL_RE, exact_match, normalize, score, substring_match, token_f1)
