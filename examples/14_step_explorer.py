"""The step explorer on the shipped tiny twins: one interactive page, the MDM and its AR twin side by side on one
prompt, with linked step sliders (mapped, since their step counts differ). Opens offline in any browser.

    python examples/14_step_explorer.py [OUT.html]
"""

from __future__ import annotations

import sys

from mdm_lens import ReceivedAttention, steps
from mdm_lens.views import explore
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)


def main(path: str = "step_explorer.html") -> None:
    mdm, arm = load("mdm-lens/tiny-mdm"), load("mdm-lens/tiny-arm")
    prompt = mdm.to_tokens("[1] the owl lives in elvasta. question: where does the owl live? answer:")
    out = mdm.generate(prompt, steps=8, gen_length=8, record=[ReceivedAttention()],
                       cache="blocks.3.attn.hook_pattern" @ steps(0, 4))   # full patterns at two steps
    out_arm = arm.generate(prompt, gen_length=8, record=[ReceivedAttention()])
    view = explore([out, out_arm], [mdm, arm])
    print(view.save(path), f"({view.size_bytes / 1024:.0f} KB)")
    print(out.texts, out_arm.texts)


if __name__ == "__main__":
    main(*sys.argv[1:])
