"""Chat templates rendered as transformers' ``apply_chat_template(add_generation_prompt=True)``
renders them (:class:`ChatTemplate`), for the text the engine tokenizes for a chat request.
jinja2 is imported only when a template is compiled, so completions-only fleets need none."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from epp.request import ChatMessage


class ChatTemplateUnavailable(RuntimeError):
    """The tokenizer directory has no chat template, or jinja2 is not installed."""


class ChatTemplate:
    """A chat template rendered with transformers' ``apply_chat_template`` semantics.

    Same jinja2 environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls,
    ``{% generation %}`` blocks, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
    non-ASCII text) and the same variables (``messages``, ``add_generation_prompt=True``, the
    special tokens). Message content is a string, or a list of text parts when the template
    iterates over the content, which is how vLLM's "auto" content format decides.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        env = _environment()
        self._template = env.from_string(source)
        self.content_as_parts = _iterates_over_content(env.parse(source))
        self._variables = dict(special_tokens)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        return str(
            self._template.render(
                messages=[
                    {"role": m.role, "content": m.template_content(self.content_as_parts)}
                    for m in messages
                ],
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self._variables,
            )
        )


def _environment() -> Any:
    """transformers' chat-template environment. jinja2 is imported here, not at module load,
    so that completions-only deployments work without it."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateUnavailable(
            "jinja2 is not installed: chat prompts cannot be rendered"
        ) from None

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering is unaffected, so the block renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _iterates_over_content(ast: Any) -> bool:
    """True if the template loops over a message's content (directly or through a variable)."""
    from jinja2 import nodes

    def is_content(node: Any) -> bool:
        while isinstance(node, nodes.Filter | nodes.Test):
            node = node.node
        return (isinstance(node, nodes.Getattr) and node.attr == "content") or (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == "content"
        )

    aliases = {
        a.target.name
        for a in ast.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and is_content(a.node)
    }
    for loop in ast.find_all(nodes.For):
        target = loop.iter
        while isinstance(target, nodes.Filter):
            target = target.node
        if is_content(target) or (isinstance(target, nodes.Name) and target.name in aliases):
            return True
    return False
