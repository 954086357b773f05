"""Dataset-scale sweeps: ``mdm-lens sweep`` / ``torchrun -m mdm_lens.sweep`` / ``mdm_lens.sweep.run``.

    from mdm_lens import sweep
    tables = sweep.run("mdm-lens/tiny-mdm", "items.jsonl", "absorption,accuracy", "runs/tiny", limit=64)
    tables["absorption_summary"]     # layer mean ± std over items

See ``runner`` (sharding, seeds, resume, ``--limit`` growth), ``items`` (input formats), ``templates`` (prompts),
``checks`` (which items each probe can use), ``adapter`` (which probe makes which rows), ``shared`` (qk at every
layer from one forward), ``store`` (the folder layout) and ``manifest`` (what ran).
"""

from mdm_lens.sweep.adapter import PROBES
from mdm_lens.sweep.items import SweepItem, read_items
from mdm_lens.sweep.runner import item_seed, make_batches, parse_probes, run

__all__ = ["run", "PROBES", "SweepItem", "read_items", "item_seed", "parse_probes", "make_batches"]
