"""Chained block hashes of prompts."""

from __future__ import annotations

import json
from array import array

import pytest
from xxhash import xxh64_intdigest

from epp.prefix.hashing import BlockHasher
from epp.request import RequestPolicy, parse_request
from tests.unit.scheduling.common import req, text

HASHER = BlockHasher(block_chars=64, block_size=16, max_blocks=256)


def test_only_full_blocks_are_hashed() -> None:
    assert HASHER.hashes(req("x" * 63)) == []
    assert len(HASHER.hashes(req("x" * 127))) == 1
    assert len(HASHER.hashes(req("x" * 128))) == 2


def test_hashes_are_chained_so_a_block_names_its_whole_prefix() -> None:
    shared = text("shared", 128)
    a = HASHER.hashes(req(text("a", 64) + shared))
    b = HASHER.hashes(req(text("b", 64) + shared))
    # Blocks 2 and 3 have the same text, but what came before differs.
    assert not set(a) & set(b)
    c = HASHER.hashes(req(text("a", 64) + shared + text("tail", 64)))
    assert c[:3] == a
    assert len(c) == 4


def test_prefix_of_a_longer_prompt_has_the_same_leading_hashes() -> None:
    long = text("p", 64 * 10)
    assert HASHER.hashes(req(long[:256] + "different")) == HASHER.hashes(req(long))[:4]


def test_seeded_by_model_and_adapter() -> None:
    prompt = text("p", 256)
    base = HASHER.hashes(req(prompt))
    assert HASHER.hashes(req(prompt)) == base
    for other in (req(prompt, model="other"), req(prompt, lora="adapter")):
        assert not set(HASHER.hashes(other)) & set(base)


def test_at_most_max_blocks_leading_blocks() -> None:
    hasher = BlockHasher(block_chars=64, max_blocks=3)
    hashes = hasher.hashes(req(text("p", 64 * 10)))
    assert hashes == HASHER.hashes(req(text("p", 64 * 10)))[:3]


def test_chat_turn_two_repeats_turn_one_blocks() -> None:
    policy = RequestPolicy()
    system = {"role": "system", "content": text("system prompt", 700)}
    turn1 = [system, {"role": "user", "content": text("first question", 300)}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": text("answer", 400)},
        {"role": "user", "content": text("second question", 200)},
    ]

    def hashes(messages: list[dict[str, str]]) -> list[int]:
        body = json.dumps({"model": "m", "messages": messages}).encode()
        return HASHER.hashes(parse_request("/v1/chat/completions", {}, body, policy))

    first, second = hashes(turn1), hashes(turn2)
    assert len(first) == (700 + 300 + len("system\x1f\x1euser\x1f\x1e")) // 64
    assert second[: len(first)] == first
    assert len(second) > len(first)


def test_token_prompts_hash_blocks_of_block_size_tokens() -> None:
    hasher = BlockHasher(block_size=4)
    ids = tuple(range(100, 118))  # 18 tokens: 4 full blocks
    hashes = hasher.hashes(req(tokens=ids))
    assert len(hashes) == 4
    assert hasher.hashes(req(tokens=(*ids[:8], 1, 2, 3, 4)))[:2] == hashes[:2]
    assert hasher.hashes(req(tokens=(*ids[:8], 1, 2, 3, 4)))[2] != hashes[2]
    assert hasher.hashes(req(tokens=(1, 2, 3))) == []
    # Ids no vocabulary has cannot be hashed as such; the request is still routed.
    assert hasher.hashes(req(tokens=(-1, 2, 3, 4))) == []


def test_any_text_hashes_including_lone_surrogates() -> None:
    # Blocks are UTF-8 bytes: 20 x 8 three-byte characters, 64 three-byte lone surrogates.
    assert len(HASHER.hashes(req("日本語のテキスト" * 20 + "\ud800" * 64))) == (480 + 192) // 64


def test_tokens_per_block() -> None:
    assert HASHER.tokens_per_block(req("x")) == 16
    assert BlockHasher(block_size=32).tokens_per_block(req(tokens=(1,))) == 32


@pytest.mark.parametrize("field", ["block_chars", "block_size", "max_blocks"])
def test_rejects_non_positive_parameters(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BlockHasher(**{field: 0})


@pytest.mark.parametrize("blocks", [0, 1, 5, 300])
def test_the_chain_is_xxh64_of_each_block_seeded_with_the_previous_hash(blocks: int) -> None:
    """The definition other processes (and saved indexes) rely on, spelled out: the seed is
    xxh64 of ``model NUL lora``; block i is hashed with block i-1's hash as seed. Text in
    64-byte UTF-8 blocks (multi-byte characters may straddle two), token ids in 16-id blocks
    of 4-byte unsigned integers; a partial last block is not hashed."""

    def chain(data: bytes, step: int, seed: int) -> list[int]:
        out: list[int] = []
        h = seed
        for i in range(0, min(len(data) // step, 256) * step, step):
            h = xxh64_intdigest(data[i : i + step], h)
            out.append(h)
        return out

    prompt = ("héllo wörld ✓ " * 40 * (blocks + 1))[: blocks * 64 + 30]
    seed = xxh64_intdigest(b"m\x00")
    assert HASHER.hashes(req(prompt)) == chain(prompt.encode(), 64, seed)
    ids = tuple(range(7, 7 + blocks * 16 + 5))
    token_request = req("", tokens=ids)
    expected = chain(array("I", ids[: 256 * 16]).tobytes(), 64, seed)
    assert HASHER.hashes(token_request) == expected
