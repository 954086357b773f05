"""Chat templates of real checkpoints, read from the tokenizer files and rendered without transformers.

`tokenizer.json` (what `mdm_lens.loading` reads into a `tokenizers.Tokenizer`) carries no chat template:
released checkpoints keep it in `tokenizer_config.json` (`"chat_template"`: a Jinja string, or a list of
`{"name", "template"}` of which "default" is used) or, since transformers 4.43, in `chat_template.jinja`.
`read_chat_template(folder)` finds it and the special-token strings the template may refer to
(`bos_token`, `eos_token`, …); `ChatTemplate.render` renders it the way transformers'
`apply_chat_template` does (a sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`,
`raise_exception`, `strftime_now`, a non-ASCII-preserving `tojson`), so the prompt text is the one the
model was trained on. No template code runs outside the sandbox.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from mdm_lens import validate
from mdm_lens.errors import CheckpointError, InputError
from mdm_lens.loading.special import _read_json, _token_name  # the loader's readers of the same files

__all__ = ["ChatTemplate", "read_chat_template", "render_user_turn", "has_chat_template"]

_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special-token strings it is rendered with."""

    source: str
    template: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        validate.boolean(add_generation_prompt, name="add_generation_prompt")
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise InputError(f"messages={validate.describe(messages)} is invalid: expected a non-empty list of "
                             '{"role": str, "content": str} dicts.', argument="messages", value=messages,
                             allowed="a list of role/content dicts")
        try:
            return _compiled(self.template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                   **self.special_tokens)
        except InputError:
            raise
        except Exception as e:  # a template error is the checkpoint's, not the caller's
            raise CheckpointError(f"the chat template from {self.source} failed to render: {e}") from e


def _raise(message: str) -> None:
    raise InputError(f"the chat template refused the messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_CACHE: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    if template not in _CACHE:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _CACHE[template] = env.from_string(template)
    return _CACHE[template]


def read_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The checkpoint's chat template (`chat_template.jinja` first, then `tokenizer_config.json`), or None."""
    folder = Path(folder)
    cfg = _read_json(folder / "tokenizer_config.json")
    special = {k: s for k in _SPECIAL if (s := _token_name(cfg.get(k))) is not None}
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return ChatTemplate(str(jinja), jinja.read_text(encoding="utf-8"), special)
    raw = cfg.get("chat_template")
    if isinstance(raw, list):  # named templates: transformers uses "default" when no name is asked for
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default")
    if isinstance(raw, str) and raw.strip():
        return ChatTemplate(str(folder / "tokenizer_config.json"), raw, special)
    return None


def render_user_turn(model: Any, content: str) -> str:
    """`content` as the user turn of the model's chat template, generation prompt added: the checkpoint's own
    template (`model.chat_template`), else a transformers tokenizer's `apply_chat_template`."""
    own = getattr(model, "chat_template", None)
    if own is not None:
        return own.render([{"role": "user", "content": content}], add_generation_prompt=True)
    tok = getattr(model, "tokenizer", None)
    if getattr(tok, "chat_template", None) and hasattr(tok, "apply_chat_template"):
        return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
    raise InputError(f"{model.cfg.model_name} has no chat template: its folder has neither chat_template.jinja nor "
                     "a chat_template in tokenizer_config.json (and its tokenizer has none); use template='rag'.",
                     argument="template", value="chat", allowed="'rag' or 'zoo' for this model")


def has_chat_template(model: Any) -> bool:
    tok = getattr(model, "tokenizer", None)
    return getattr(model, "chat_template", None) is not None or bool(getattr(tok, "chat_template", None))
