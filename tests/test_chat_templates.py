"""Chat templates of real checkpoints: read from tokenizer_config.json / chat_template.jinja (tokenizer.json has
none), rendered exactly as transformers' `apply_chat_template`, and used by the sweep's `chat` template on a real
byte-level BPE tokenizer with its spans landing on the passages and the question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mdm_lens import HookedMDM, chat
from mdm_lens.errors import CheckpointError, ConfigError, InputError
from mdm_lens.sweep import items as SI
from mdm_lens.sweep import templates as TM
from tests.tiny_checkpoints import hf_reference, write_dream, write_llada

# Llama-3 / LLaDA-Instruct style (header tokens, bos from the special tokens, trimmed content) and Qwen2 / Dream
# ChatML style (a default system turn), written for these tests in the checkpoints' formats.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}\n"
          "  {% if add_generation_prompt %}\n{{ '<|im_start|>assistant\n' }}{% endif %}")  # needs trim + lstrip
STYLES = {
    "llada": dict(template=LLAMA3, special=["<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>",
                                           "<|eot_id|>", "<|mdm_mask|>"], bos="<|startoftext|>", eos="<|eot_id|>"),
    "dream": dict(template=CHATML, special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"],
                  bos=None, eos="<|im_end|>"),
}
CORPUS = ["The river Lumora flows past the city of Ketterby, founded in 1954.",
          "Question: which company owns the otter? Answer: the Nolvo company.",
          "Read the passages in the context and answer the question with a few words taken from them."] * 20
ITEM = {"id": "q1", "question": "Where does the river Lumora flow?", "answers": ["Ketterby"], "gold_index": 1,
        "passages": ["Otters live near Nolvo.", "The river Lumora flows past Ketterby.", "Varek owns a pet."]}


def _tokenizer(special: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _checkpoint(tmp: Path, family: str, where: str = "config") -> Path:
    style = STYLES[family]
    tok = _tokenizer(style["special"])
    vocab = tok.get_vocab_size()
    mask = tok.token_to_id(style["special"][-1])
    ref = hf_reference("llada" if family == "llada" else "dream", vocab_size=vocab)
    folder = tmp / family
    overrides = {"mask_token_id": mask, "eos_token_id": tok.token_to_id(style["eos"]),
                 "pad_token_id": tok.token_to_id(style["eos"]),
                 ("max_sequence_length" if family == "llada" else "max_position_embeddings"): 512}  # RAG prompts
    (write_llada if family == "llada" else write_dream)(ref, folder, config_overrides=overrides)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": style["eos"], "bos_token": style["bos"]}
    if where == "config":
        cfg["chat_template"] = style["template"]
    elif where == "named":
        cfg["chat_template"] = [{"name": "tool_use", "template": "{{ 'wrong' }}"},
                                {"name": "default", "template": style["template"]}]
    elif where == "jinja":
        cfg["chat_template"] = "{{ 'the jinja file wins' }}"
        (folder / "chat_template.jinja").write_text(style["template"])
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _transformers_render(folder: Path, family: str, content: str) -> str:
    from transformers import PreTrainedTokenizerFast

    style = STYLES[family]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=style["bos"],
                                  eos_token=style["eos"], chat_template=style["template"])
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("where", ["config", "named", "jinja"])
def test_template_is_read_and_renders_as_transformers(tmp_path, family, where):
    folder = _checkpoint(tmp_path, family, where)
    model = HookedMDM.from_pretrained(folder)
    assert model.chat_template is not None
    content = "  Context:\nPassage 1:\nOtters.  "
    ours = chat.render_user_turn(model, content)
    assert ours == _transformers_render(folder, family, content)
    if family == "llada":  # spelled out once, so a shared mistake in both renderers cannot hide
        assert ours == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nContext:\nPassage 1:\nOtters."
                        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    else:
        assert ours == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n" + content +
                        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_chat_prompt_spans_land_on_the_passages(tmp_path, family):
    model = HookedMDM.from_pretrained(_checkpoint(tmp_path, family))
    assert TM.resolve_template(model, "auto") == "chat"
    item = SI.parse_item(ITEM, 1)
    r = TM.render(model, item, "chat")
    qa = r.qa
    assert r.text.startswith("<|startoftext|>" if family == "llada" else "<|im_start|>system")
    assert [r.text[a:b] for a, b in qa.passage_spans] == ITEM["passages"]
    assert r.text[slice(*qa.question_span)] == ITEM["question"]
    assert r.text[slice(*qa.evidence_span)] == "Ketterby" and qa.gold_index == 1
    # one tokenisation: special tokens are single ids, the offsets cut the text back into the tokens
    tok = model.tokenizer
    first = tok.token_to_id("<|startoftext|>" if family == "llada" else "<|im_start|>")
    assert r.ids[0] == first and r.ids.count(first) == (1 if family == "llada" else 3)
    assert "".join(r.text[a:b] for a, b in r.offsets) == r.text
    assert tok.decode(r.ids, skip_special_tokens=False).replace(" ", "") == r.text.replace(" ", "")
    closed = TM.render(model, item, "chat", context=False)
    assert TM.PLACEHOLDER in closed.text and "Ketterby" not in closed.text


def test_no_template_falls_back_to_rag_and_chat_is_refused(tmp_path):
    folder = _checkpoint(tmp_path, "llada", where="none")
    model = HookedMDM.from_pretrained(folder)
    assert model.chat_template is None and TM.resolve_template(model, "auto") == "rag"
    item = SI.parse_item(ITEM, 1)
    with pytest.raises(InputError, match="no chat template") as e:
        TM.render(model, item, "chat")
    assert e.value.argument == "template"
    r = TM.render(model, item, "rag")
    # LLaDA's tokenizer has add_bos_token false and generate.py encodes without special tokens: nothing prepended
    assert r.text.startswith(TM.INSTRUCTION) and r.ids == model.tokenizer.encode(r.text, add_special_tokens=False).ids


def test_template_errors_are_typed(tmp_path):
    t = chat.ChatTemplate("x", "{{ raise_exception('only user turns') }}")
    with pytest.raises(InputError, match="only user turns"):
        t.render([{"role": "user", "content": "hi"}])
    with pytest.raises(CheckpointError, match="failed to render"):
        chat.ChatTemplate("x", "{{ messages[5]['content'] + 1 }}").render([{"role": "user", "content": "hi"}])
    with pytest.raises(InputError, match="messages"):
        t.render([{"role": "user"}])
    # the sandbox: template code cannot reach Python internals
    with pytest.raises(CheckpointError):
        chat.ChatTemplate("x", "{{ ''.__class__.__mro__[1].__subclasses__() }}").render([{"role": "u", "content": ""}])
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json"):   # as the loader's special-token reader
        chat.read_chat_template(tmp_path)


def test_sweep_on_a_chat_checkpoint(tmp_path):
    """The whole path on a real tokenizer: auto → chat, a KILT line, accuracy and absorption rows."""
    from mdm_lens import sweep

    model = HookedMDM.from_pretrained(_checkpoint(tmp_path, "llada"))
    kilt = {"id": "k1", "input": ITEM["question"], "output": [{"answer": "Ketterby"}],
            "passage": [{"segment": p} for p in ITEM["passages"]]}
    data = tmp_path / "kilt.jsonl"
    data.write_text(json.dumps(kilt) + "\n")
    tabs = sweep.run(model, data, "accuracy,absorption", tmp_path / "out", steps=2, gen_length=2, block_length=2,
                     progress=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["template"] == "chat"
    assert set(tabs["absorption"]["item_id"]) == {"k1"} and set(tabs["accuracy"]["item_id"]) == {"k1"}
