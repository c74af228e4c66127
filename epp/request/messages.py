"""A conversation as the engine's chat handling sees it (:class:`ChatMessage`: a role and typed
content parts), and the text prefix scorers hash, derived from it (:func:`hashing_text`).

Both the hashing text and the chat template's input (:meth:`ChatMessage.template_content`) come
from this structure, with every separator declared once below, so they cannot drift apart or
from the engine's: a later turn's text starts with exactly the text of the earlier turns and
matches their cached blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# vLLM joins the non-empty text parts of one message with a newline before rendering a template
# that takes string content (vllm/entrypoints/chat_utils.py, ``"\n".join(texts)``). Token ids
# epp derives for multi-part content match the engine's only with the same rule.
TEXT_PART_SEPARATOR = "\n"
# Separators that cannot appear in ordinary text keep "role + content" boundaries unambiguous
# in the hashing text; a media part is marked so that its reference never equals a text part.
ROLE_SEPARATOR = "\x1f"
MESSAGE_SEPARATOR = "\x1e"
MEDIA_MARK = "\x1d"


PartKind = Literal["text", "image", "other"]


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a message's content: text, an image, or other media (audio, video, file).

    ``value`` is the text of a text part, and for media a stable reference to it (its URL, or
    the part as canonical JSON) so that two different images never hash alike.
    """

    kind: PartKind
    value: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """A chat message as the engine's chat handling sees it: a role and its content parts."""

    role: str
    parts: tuple[ContentPart, ...]

    @property
    def text_only(self) -> bool:
        return all(p.kind == "text" for p in self.parts)

    def text(self) -> str:
        """The content as the engine passes it to a template that takes strings (empty text
        parts dropped, as vLLM drops them before joining)."""
        return TEXT_PART_SEPARATOR.join(p.value for p in self.parts if p.kind == "text" and p.value)

    def template_content(self, as_parts: bool) -> str | list[dict[str, str]]:
        """The ``content`` a chat template sees: a string, or (for templates that iterate over
        content, vLLM's "openai" content format) the list of text parts."""
        if as_parts:
            return [{"type": "text", "text": p.value} for p in self.parts if p.kind == "text"]
        return self.text()


def hashing_text(messages: Sequence[ChatMessage]) -> str:
    """The conversation laid out for prefix hashing: each message's role, then its parts in
    order (text as it is, media as a marked reference), so a later turn extends an earlier one."""
    return "".join(
        message.role
        + ROLE_SEPARATOR
        + TEXT_PART_SEPARATOR.join(
            p.value if p.kind == "text" else f"{MEDIA_MARK}{p.kind}:{p.value}{MEDIA_MARK}"
            for p in message.parts
            if p.value or p.kind != "text"
        )
        + MESSAGE_SEPARATOR
        for message in messages
    )
