"""Renders the bundled tokenizer's chat template.

vLLM renders chat templates with jinja2. jinja2 is not a dependency of epp, so the simulator
implements the one fixed template it ships (tools/build_tokenizer.py CHAT_TEMPLATE) in Python;
a unit test checks the template text is still the one implemented here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.request import TEXT_PART_SEPARATOR

TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A message the template cannot render (maps to HTTP 400)."""


def message_text(content: Any) -> str:
    """OpenAI content (string or list of parts) as the string the template sees.

    vLLM's "string" content format joins the non-empty text parts with the separator epp's
    request model declares (a newline); media parts are rejected because the simulated model is
    text-only (vLLM: "... is not a multimodal model", 400).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                texts.append(str(part.get("text") or ""))
            else:
                raise ChatTemplateError("the simulated model is not a multimodal model")
        return TEXT_PART_SEPARATOR.join(t for t in texts if t)
    raise ChatTemplateError("message content must be a string or a list of parts")


def render(messages: Sequence[Any], bos_token: str, add_generation_prompt: bool = True) -> str:
    out = [bos_token]
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError("each message needs a string 'role'")
        out.append(f"<|im_start|>{m['role']}\n{message_text(m.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
