"""Token ids epp derives for chat requests equal the real engine's (EPP_CONTRACT=1 only).

The precise prefix scorer matches the engine's cached blocks by token ids, so epp must render
and tokenize a conversation exactly as vLLM does, multi-part content included: vLLM joins the
non-empty text parts of a message with a newline for templates that take string content, and
hands templates that iterate over content the list of text parts. Each case goes to the engine's
``/tokenize`` (same code path as ``/v1/chat/completions``) and through epp's
:class:`~epp.prefix.tokens.TokenizerRegistry`, for the served model's own template (string
content) and for a template that iterates over parts (sent to ``/tokenize`` as
``chat_template``, loaded by epp from a tokenizer directory that holds it).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import RealVllm
from make_tiny_model import DEFAULT_MODEL_DIR

from epp.prefix.tokens import TokenizerRegistry
from epp.request import RequestPolicy, parse_request

pytestmark = pytest.mark.contract

PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}[{{ part['type'] }}]{{ part['text'] }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "two-text-parts": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Summarize the following."},
                {"type": "text", "text": "The quick brown fox jumps over the lazy dog."},
            ],
        }
    ],
    "empty-and-multiline-parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief.\nReally."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First."},
                {"type": "text", "text": ""},
                {"type": "text", "text": "Second\n\nthird."},
            ],
        },
    ],
    "mixed-string-and-parts-multi-turn": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "Colour of the sky?"}]},
        {"role": "assistant", "content": "Blue."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And of grass?"},
                {"type": "text", "text": "One word, please."},
            ],
        },
    ],
}


def _tokenize(real_vllm: RealVllm, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        real_vllm.base_url + "/tokenize",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _epp_ids(directory: Path, messages: list[dict[str, Any]]) -> list[int] | None:
    registry = TokenizerRegistry()
    registry.set_models({"tiny": str(directory)})
    body = json.dumps({"model": "tiny", "messages": messages}).encode()
    request = parse_request("/v1/chat/completions", {}, body, RequestPolicy())
    ids = registry.token_ids(request)
    return None if ids is None else list(ids)


@pytest.fixture(scope="module")
def parts_template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("parts-template")
    for name in ("tokenizer.json", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    (directory / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    return directory


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_multi_part_chat_ids_equal_engine_tokenize(real_vllm: RealVllm, name: str) -> None:
    messages = CONVERSATIONS[name]
    status, answer = _tokenize(
        real_vllm, {"model": real_vllm.model, "messages": messages, "add_generation_prompt": True}
    )
    assert status == 200, answer
    assert _epp_ids(DEFAULT_MODEL_DIR, messages) == answer["tokens"]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_parts_iterating_template_ids_equal_engine_tokenize(
    real_vllm: RealVllm, parts_template_dir: Path, name: str
) -> None:
    messages = CONVERSATIONS[name]
    status, answer = _tokenize(
        real_vllm,
        {
            "model": real_vllm.model,
            "messages": messages,
            "add_generation_prompt": True,
            "chat_template": PARTS_TEMPLATE,
        },
    )
    assert status == 200, answer
    assert _epp_ids(parts_template_dir, messages) == answer["tokens"]


def test_image_part_is_refused_by_a_text_only_engine_and_gets_no_epp_ids(
    real_vllm: RealVllm,
) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            ],
        }
    ]
    status, answer = _tokenize(
        real_vllm, {"model": real_vllm.model, "messages": messages, "add_generation_prompt": True}
    )
    assert status == 400, answer
    assert _epp_ids(DEFAULT_MODEL_DIR, messages) is None
