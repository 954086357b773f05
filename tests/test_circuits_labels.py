"""circuitsvis token labels: special tokens (`<bos>`, `<eos>`, `<|endoftext|>`, `&lt;`) stay visible, and the
views validate their arguments.

circuitsvis writes a token's label into its token strips as HTML (`dangerouslySetInnerHTML`) and into its
heatmap axes and tooltips as plain text.  `html_text` below is what a browser shows for the HTML case (the
text nodes of the parsed fragment, as `innerText`); `canvas_text` the plain-text case (a zero-width space
draws nothing).  A label must read as the token in both.
"""

from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig, steps
from mdm_lens.errors import ArgumentError, NonFiniteError, OutOfRangeError
from mdm_lens.views import circuits

SPECIALS = ["<bos>", "<eos>", "<|endoftext|>", "</s>", "&lt;", "a<b", "[MASK]", "plain"]


class _Text(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts = []

    def handle_data(self, data):
        self.parts.append(data)


def html_text(label: str) -> str:
    p = _Text()
    p.feed(label.replace(" ", "&nbsp;", 1))          # what circuitsvis' AttentionTokens does first
    p.close()
    return "".join(p.parts).replace("\xa0", " ").replace(circuits.ZWSP, "")


def canvas_text(label: str) -> str:
    return label.replace(circuits.ZWSP, "")


def test_the_html_model_shows_the_bug_it_guards_against():
    assert html_text("<bos>") == "" and html_text("&lt;") == "<"      # raw labels: blank / wrong
    assert html_text("plain") == "plain"


@pytest.mark.parametrize("label", SPECIALS)
def test_labels_read_as_the_token_in_html_and_in_plain_text(label):
    shown = circuits._visible(label)
    assert html_text(shown) == label and canvas_text(shown) == label
    assert circuits._plain(shown) == label
    assert circuits._visible("") == circuits.EMPTY_LABEL and html_text(circuits.EMPTY_LABEL) == "\u2205"


def tiny_tokenized():
    """A word-level tokenizer with <bos>/<eos>/<pad> and a mask token, on a random model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<mask>": 3, "x": 4, "y": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cfg = MDMConfig(d_model=16, n_layers=2, n_heads=2, d_mlp=32, d_vocab=6, n_ctx=32, mask_token_id=3,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = HookedMDM.from_config(cfg, seed=0)
    model.set_tokenizer(tok)
    return model


@pytest.fixture(scope="module")
def run():
    model = tiny_tokenized()
    out = model.generate(torch.tensor([[1, 4, 5, 2]]), gen_length=2, steps=2,
                         cache="blocks.0.attn.hook_pattern" @ steps(0))
    return model, out


@pytest.mark.parametrize("kind", ["patterns", "heads"])
def test_bos_and_eos_are_visible_in_attention_views(run, kind):
    model, out = run
    element, props = circuits.parse_view(circuits.attention(out, step=0, layer=0, model=model, kind=kind))
    assert element == ("AttentionPatterns" if kind == "patterns" else "AttentionHeads")
    shown = [html_text(t) for t in props["tokens"]]
    assert shown == ["<bos>", " x", " y", " <eos>", " [MASK]", " [MASK]"]
    assert [canvas_text(t) for t in props["tokens"]] == shown
    fb = circuits.to_html(circuits.attention(out, 0, 0, model=model), renderer="fallback", full_document=False)
    assert '"<bos>"' in fb and circuits.ZWSP not in fb and "\\u200b" not in fb


def test_colored_tokens_keep_specials_visible():
    view = circuits.tokens_by_persistence(["<bos>", "a", "<eos>"], [1.0, 0.0, np.nan])
    _, props = circuits.parse_view(view)
    assert [html_text(t) for t in props["tokens"]] == ["<bos>", " a", " <eos>"] and props["values"] == [1.0, 0.0, 0.0]
    fb = circuits.to_html(view, renderer="fallback")
    assert "&lt;bos&gt;" in fb and "&lt;eos&gt;" in fb


def test_views_validate_steps_layers_rows_heads_shapes_and_nan(run):
    model, out = run
    with pytest.raises(OutOfRangeError, match="step"):
        circuits.attention(out, step=2, layer=0)
    with pytest.raises(OutOfRangeError, match="layer"):
        circuits.attention(out, step=0, layer=2, model=model)
    with pytest.raises(OutOfRangeError, match="batch"):
        circuits.attention(out, step=0, layer=0, batch=1)
    with pytest.raises(OutOfRangeError, match="heads"):
        circuits.attention(out, step=0, layer=0, heads=[2])
    with pytest.raises(ArgumentError, match="kind"):
        circuits.attention(out, step=0, layer=0, kind="matrix")
    with pytest.raises(OutOfRangeError, match="batch"):
        circuits.step_str_tokens(out, 0, model=model, batch=3)
    last = circuits.attention(out, step=0, layer=-2, model=model)           # negative layer: layer 0
    assert circuits.parse_view(last)[1]["tokens"] == circuits.parse_view(circuits.attention(out, 0, 0))[1]["tokens"]
    eye = np.eye(3, dtype=np.float32)
    with pytest.raises(ArgumentError, match="pattern"):
        circuits.attention_from_pattern(["a", "b", "c"], eye[None, None])
    with pytest.raises(ArgumentError, match="square"):
        circuits.attention_from_pattern(["a", "b", "c"], eye[:2])
    with pytest.raises(ArgumentError, match="labels"):
        circuits.attention_from_pattern(["a", "b"], eye)
    bad = eye.copy()
    bad[0, 1] = np.nan
    with pytest.raises(NonFiniteError, match="pattern"):
        circuits.attention_from_pattern(["a", "b", "c"], bad)
    with pytest.raises(NonFiniteError, match="persistence"):
        circuits.tokens_by_persistence(["a"], [np.inf])
