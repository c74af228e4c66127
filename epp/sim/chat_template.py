"""Renders the bundled tokenizer's chat template.

vLLM renders chat templates with jinja2. jinja2 is not a dependency of epp, so the simulator
implements the one fixed template it ships (tools/build_tokenizer.py CHAT_TEMPLATE) in Python;
a unit test checks the template text is still the one implemented here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

    vLLM's "string" content format joins text parts with newlines; non-text parts are
    rejected because the simulated model is text-only.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatTemplateError("only text content parts are supported")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
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
