"""The bundled tokenizer directory and the Python rendering of its chat template."""

from __future__ import annotations

import importlib.util
import json

import pytest

from epp.sim import chat_template
from epp.sim.tokenization import BUNDLED_DIR, OFFLOAD_CHARS, SimTokenizer


def test_bundled_tokenizer_is_hf_loadable_shape() -> None:
    config = json.loads((BUNDLED_DIR / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    assert config["model_max_length"] > 0
    # The renderer implements exactly the template the directory declares.
    assert config["chat_template"] == chat_template.TEMPLATE
    assert json.loads((BUNDLED_DIR / "special_tokens_map.json").read_text())["eos_token"] == "</s>"


def test_build_script_declares_the_same_template() -> None:
    spec = importlib.util.spec_from_file_location(
        "build_tokenizer", BUNDLED_DIR.parents[2] / "tools" / "build_tokenizer.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.CHAT_TEMPLATE == chat_template.TEMPLATE


def test_chat_rendering(tokenizer: SimTokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == 0
    assert ids[1] == 3  # <|im_start|> is one special token


def test_chat_rejects_non_text_parts(tokenizer: SimTokenizer) -> None:
    with pytest.raises(chat_template.ChatTemplateError):
        tokenizer.encode_chat([{"role": "user", "content": [{"type": "image_url"}]}])


def test_filler_tokens_are_deterministic_words(tokenizer: SimTokenizer) -> None:
    prompt = tokenizer.encode("hello")
    out = [tokenizer.filler_token(prompt, i) for i in range(8)]
    assert out == [tokenizer.filler_token(prompt, i) for i in range(8)]
    assert all(tokenizer.decode([t]).strip().isalpha() for t in out)


async def test_long_texts_tokenize_the_same_off_the_loop(tokenizer: SimTokenizer) -> None:
    text = "def handler(request):\n    return request.json()\n" * 1000
    assert len(text) >= OFFLOAD_CHARS
    assert await tokenizer.encode_async(text) == tokenizer.encode(text)
