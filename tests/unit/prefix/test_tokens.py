"""Request -> engine token ids: agreement with real vLLM, chat templates, the token cache."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from epp.prefix.token_cache import RESTART_SPACING, TokenCache
from epp.prefix.tokens import ModelTokenizer, TokenizerRegistry
from epp.request import InferenceRequest, RequestPolicy, parse_request
from epp.sim.tokenization import BUNDLED_DIR, SimTokenizer
from tests.unit.prefix.helpers import FIXTURES

pytest.importorskip("jinja2")

TOKENIZE_CALLS = json.loads((FIXTURES / "tokenize.json").read_text())["calls"]
WORDS = [
    *["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on"],
    *["be", "by", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an"],
    *["they", "you", "were", "her", "all", "she", "there", "would", "their", "we", "him"],
    *["naïve", "café", "東京", "数据", "—", "“quoted”", "3.14159", "2026", "x86_64"],
    *["foo_bar()", "{}[]", "\t\t", "tabs", "   ", "spaces", "!!", "...", "'s"],
]


def request(path: str, body: dict[str, object]) -> InferenceRequest:
    return parse_request(path, {}, json.dumps(body).encode(), RequestPolicy())


def registry(models: dict[str, str | None] | None = None) -> TokenizerRegistry:
    reg = TokenizerRegistry()
    reg.set_models(models if models is not None else {"tiny": str(BUNDLED_DIR)})
    return reg


def text(rng: random.Random, words: int) -> str:
    out = []
    for _ in range(words):
        out.append(rng.choice(WORDS))
        out.append(rng.choice([" ", " ", " ", "\n", ", ", ". ", "  ", "\n\n"]))
    return "".join(out)


@pytest.fixture(scope="module")
def executor() -> ThreadPoolExecutor:
    with ThreadPoolExecutor(1) as pool:
        yield pool


# -- agreement with the real engine (tests/fixtures/vllm/tokenize.json) ------------------------


@pytest.mark.parametrize("call", [0, 2], ids=["completion-with-bos", "chat-template"])
def test_token_ids_equal_real_vllm_tokenize(call: int) -> None:
    recorded = TOKENIZE_CALLS[call]
    body = dict(recorded["request"]["body"])
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body.pop("add_generation_prompt", None)
    ids = registry().token_ids(request(path, body))
    assert ids is not None
    assert list(ids) == recorded["response"]["tokens"]


def test_token_prompts_need_no_tokenizer() -> None:
    req = request("/v1/completions", {"model": "other", "prompt": [5, 6, 7]})
    assert registry({}).token_ids(req) == (5, 6, 7)


def test_model_without_tokenizer_gets_none_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = registry({"tiny": str(BUNDLED_DIR), "bare": None})
    req = request("/v1/completions", {"model": "bare", "prompt": "hello"})
    with caplog.at_level(logging.WARNING, logger="epp.prefix.tokens"):
        assert reg.token_ids(req) is None
        assert reg.token_ids(req) is None
        assert (
            reg.token_ids(request("/v1/completions", {"model": "unknown", "prompt": "x"})) is None
        )
    assert len([r for r in caplog.records if "'bare'" in r.getMessage()]) == 1


def test_unloadable_tokenizer_dir_is_logged_and_scored_without(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    reg = registry({"broken": str(tmp_path)})
    assert reg.token_ids(request("/v1/completions", {"model": "broken", "prompt": "x"})) is None


# -- chat rendering -----------------------------------------------------------------------------


MULTI_PART = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "First part."},
            {"type": "text", "text": ""},
            "Second part.",
            {"type": "text", "text": "Third\npart."},
        ],
    },
    {"role": "assistant", "content": None},
]


def test_multi_part_text_is_joined_as_the_engine_joins_it() -> None:
    """vLLM joins a message's non-empty text parts with a newline before rendering the
    template; the ids must be those of the simulator's template, which implements vLLM's."""
    req = request("/v1/chat/completions", {"model": "tiny", "messages": MULTI_PART})
    ids = registry().token_ids(req)
    expected = SimTokenizer(BUNDLED_DIR).encode_chat(MULTI_PART, add_generation_prompt=True)
    assert ids is not None
    assert list(ids) == expected
    joined = request(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "First part.\nSecond part.\nThird\npart."},
                {"role": "assistant", "content": ""},
            ],
        },
    )
    assert registry().token_ids(joined) == ids


def test_image_parts_get_no_precise_ids_and_distinct_hashing_text() -> None:
    def with_image(url: str) -> InferenceRequest:
        content = [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        return request(
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": content}]},
        )

    a, b = with_image("https://example.com/a.png"), with_image("https://example.com/b.png")
    assert registry().token_ids(a) is None
    assert a.prompt != b.prompt
    assert "https://example.com/a.png" in a.prompt


def test_responses_instructions_come_first_as_a_system_message() -> None:
    responses = request(
        "/v1/responses", {"model": "tiny", "instructions": "Be brief.", "input": "Hi"}
    )
    chat = request(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
        },
    )
    assert responses.messages == chat.messages
    assert responses.prompt == chat.prompt
    assert registry().token_ids(responses) == registry().token_ids(chat)


def tokenizer_dir(tmp_path: Path, **config: object) -> Path:
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED_DIR / name, tmp_path / name)
    base = json.loads((BUNDLED_DIR / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return tmp_path


def render(directory: Path, messages: list[dict[str, str]]) -> str:
    parsed = request("/v1/chat/completions", {"model": "t", "messages": messages or [{}]})
    return ModelTokenizer(directory).chat_template().render(parsed.messages[: len(messages)])


def test_template_environment_matches_transformers(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}\n"
        "{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% generation %}{{ m.role | upper }}: {{ m.content | tojson }}{% endgeneration %}!\n"
        "  {% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    directory = tokenizer_dir(tmp_path, chat_template=template, eos_token={"content": "</s>"})
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before
    # one; tojson keeps non-ASCII text, as in transformers.
    assert render(directory, [{"role": "user", "content": "café"}]) == 'USER: "café"!\n</s>'
    reg = registry({"t": str(directory)})
    bad = request(
        "/v1/chat/completions", {"model": "t", "messages": [{"role": "tool", "content": "x"}]}
    )
    assert reg.token_ids(bad) is None


def test_templates_that_iterate_over_content_get_text_parts(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% set parts = m['content'] %}"
        "{% for p in parts %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endfor %}"
    )
    directory = tokenizer_dir(tmp_path, chat_template=template)
    assert render(directory, [{"role": "user", "content": "hi"}]) == "[text:hi]"


def test_named_templates_and_template_file(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    directory = tokenizer_dir(tmp_path, chat_template=named)
    assert render(directory, []) == "D"
    (directory / "chat_template.jinja").write_text("F{{ bos_token }}")
    assert render(directory, []) == "F<s>"


def test_no_chat_template_means_no_chat_tokens(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, chat_template=None)
    reg = registry({"t": str(directory)})
    chat = request("/v1/chat/completions", {"model": "t", "messages": [{"role": "user"}]})
    assert reg.token_ids(chat) is None
    assert reg.token_ids(request("/v1/completions", {"model": "t", "prompt": "hi"})) is not None


def test_broken_template_or_untokenizable_text_never_fails_the_request(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, chat_template="{% for m in messages %}")
    reg = registry({"t": str(directory)})
    chat = request("/v1/chat/completions", {"model": "t", "messages": [{"role": "user"}]})
    assert reg.token_ids(chat) is None
    assert reg.token_ids(chat) is None
    # JSON may escape a lone surrogate; the Rust tokenizer refuses such text. parse_request
    # refuses it (400) before scheduling; the registry must not fail on it all the same.
    lone = dataclasses.replace(
        request("/v1/completions", {"model": "t", "prompt": "ab"}), prompt="a\ud800b"
    )
    assert reg.token_ids(lone) is None
    assert reg.token_ids(request("/v1/completions", {"model": "t", "prompt": "ab"})) is not None


# -- the token cache ----------------------------------------------------------------------------


def bundled() -> Tokenizer:
    return Tokenizer.from_file(str(BUNDLED_DIR / "tokenizer.json"))


def whole(tokenizer: Tokenizer, s: str) -> list[int]:
    return tokenizer.encode(s, add_special_tokens=False).ids


def test_prefix_reuse_gives_the_ids_of_whole_text_tokenization(
    executor: ThreadPoolExecutor,
) -> None:
    """Shared system prompts, next chat turns, edits in the middle: always exact."""
    tokenizer = bundled()
    cache = TokenCache(tokenizer)
    rng = random.Random(7)
    system = "<s><|im_start|>system\n" + text(rng, 3000) + "<|im_end|>\n"
    reused = 0
    conversation = system
    for turn in range(6):
        conversation += f"<|im_start|>user\n{text(rng, 200 + 150 * turn)}<|im_end|>\n"
        other_user = system + f"<|im_start|>user\n{text(rng, 300)}<|im_end|>\n"
        half = len(conversation) // 2
        edited = conversation[:half] + "EDIT" + conversation[half:]
        for prompt in (conversation + "<|im_start|>assistant\n", other_user, edited):
            plan = cache.plan(prompt)
            reused += plan.base is not None
            ids = cache.encode(prompt, 10**9, executor)
            assert ids is not None
            assert ids.tolist() == whole(tokenizer, prompt)
    assert reused >= 15  # nearly every prompt after the first reused a cached prefix
    assert cache.reuse


def test_cached_text_is_returned_without_tokenizing(executor: ThreadPoolExecutor) -> None:
    cache = TokenCache(bundled())
    prompt = text(random.Random(1), 50)
    first = cache.encode(prompt, 10**9, executor)
    assert cache.encode(prompt, 10**9, executor) is first


def test_reuse_is_verified_and_switched_off_when_inexact(executor: ThreadPoolExecutor) -> None:
    """SentencePiece-style normalizers mark the start of the text: tokenizing from the middle
    of a text is not the same as tokenizing it whole, and the cache must notice."""
    rng = random.Random(3)
    corpus = [text(rng, 400) for _ in range(20)]
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Prepend("▁")
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(corpus, trainer)
    cache = TokenCache(tokenizer)
    base = text(rng, 3000)
    for prompt in (base, base + text(rng, 100), base + text(rng, 200)):
        ids = cache.encode(prompt, 10**9, executor)
        assert ids is not None
        assert ids.tolist() == whole(tokenizer, prompt)
    assert not cache.reuse


def test_long_uncached_text_is_tokenized_in_the_background(executor: ThreadPoolExecutor) -> None:
    tokenizer = bundled()
    cache = TokenCache(tokenizer)
    rng = random.Random(5)
    prompt = text(rng, 4000)
    assert cache.encode(prompt, 1000, executor) is None
    assert cache.encode(prompt, 1000, executor) is None  # already queued: not queued twice
    deadline = time.monotonic() + 10
    while (ids := cache.encode(prompt, 1000, executor)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ids.tolist() == whole(tokenizer, prompt)
    # The next question after the same document is only its own length: inline.
    follow_up = prompt + text(rng, 30)
    plan = cache.plan(follow_up)
    assert plan.start > len(prompt) - 2 * RESTART_SPACING - 100
    assert cache.encode(follow_up, len(follow_up) - plan.start, executor) is not None


def test_cache_is_bounded_and_forgets_oldest(executor: ThreadPoolExecutor) -> None:
    cache = TokenCache(bundled(), max_bytes=200_000)
    rng = random.Random(9)
    prompts = [f"{i} " + text(rng, 2000) for i in range(10)]
    for prompt in prompts:
        cache.encode(prompt, 10**9, executor)
    assert cache._bytes <= 200_000
    assert prompts[0] not in cache._entries
    assert prompts[-1] in cache._entries
    anchored = {t for texts in cache._anchors.values() for t in texts}
    assert anchored <= set(cache._entries)
