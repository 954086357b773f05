"""Screenshots of the demo report and of the step explorer at two steps, taken in headless Chromium by the same
harness the browser tests use (`mdm_lens.views.browser`). Writes docs/*.png and prints the explorer's render time.

    python docs/screenshots.py            # runs the demo on the shipped twins first (~30 s)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from mdm_lens import HookedMDM, ReceivedAttention, steps
from mdm_lens.demo import run_demo
from mdm_lens.views import browser, explore

HERE = Path(__file__).parent


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        index = run_demo(str(Path(tmp) / "report"))
        page = browser.load(index)
        root = page.dom.find_all("div", class_="mdx-root")[0]
        print(f"report {index.stat().st_size / 2**20:.2f} MB, explorer rendered in {root.attrs['data-render-ms']} ms, "
              f"{len(page.console_errors)} console errors, {len(page.resources)} requests")
        section = next(e.attrs["id"] for e in page.dom.find_all("section") if "step-explorer" in e.attrs.get("id", ""))
        # the report's own page with every other section hidden, so the shot shows its explorer (a #fragment
        # scroll is not kept by a headless screenshot)
        only = index.parent / "explorer_section.html"
        only.write_text(index.read_text().replace(
            "</head>", f"<style>main > :not(#{section}):not(h1){{display:none}}</style></head>", 1))
        browser.screenshot(only, HERE / "report.png", size=(1200, 700))
        mdm = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
        arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
        prompt = mdm.to_tokens("[1] the owl lives in elvasta. question: where does the owl live? answer:")
        out = mdm.generate(prompt, steps=8, gen_length=8, block_length=8, record=[ReceivedAttention()],
                           cache="blocks.3.attn.hook_pattern" @ steps(2))
        out_arm = arm.generate(prompt, gen_length=8, record=[ReceivedAttention()])
        path = explore([out, out_arm], [mdm, arm]).save(Path(tmp) / "explorer.html")
        for step in (2, 6):
            browser.screenshot(path, HERE / f"explorer_step{step}.png", fragment=f"step={step}&layer=3",
                               size=(1200, 800))
    print("wrote", ", ".join(sorted(p.name for p in HERE.glob("*.png"))))
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
