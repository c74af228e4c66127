"""Deterministic request streams for the routing benchmark, measured in the simulator's tokens.

Each workload is an endless, seeded stream: every router sees exactly the same requests in the
same order (only the arrival times depend on the rate), so differences come from routing alone.
Text is made of whole words from the simulator's own BPE vocabulary, one token each, and every
prompt is tokenized with that tokenizer as the engine will see it, so token counts, KV
footprints and the oracle's cache model are exact rather than estimated from characters.

- ``shared-prefix``: GIE/inference-perf ``shared_prefix`` scaled down: G groups x U users, a long
  system prompt per group and a shorter question per user; a request is a random (group, user).
- ``multi-turn``: chat conversations whose turns extend the previous turn's messages; the session
  header carries the conversation id.
- ``lora``: completions on several LoRA adapters (Zipf popularity), each adapter with its own
  task prompt; the fleet keeps fewer adapters resident (``--max-loras``) than there are.
- ``mixed``: shared-prefix groups of Zipf popularity beside chat conversations with their own
  system prompts, whose turns wait for the previous reply.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Protocol

from benchmarks.loadgen import Request
from epp.sim.tokenization import BUNDLED_DIR, SimTokenizer
from epp.wire import SESSION_HEADER

MODEL = "tiny"


@cache
def tokenizer() -> SimTokenizer:
    return SimTokenizer(BUNDLED_DIR)


@cache
def _words() -> tuple[str, ...]:
    """ASCII vocabulary words: each is a single token when preceded by a space."""
    vocab = tokenizer().tokenizer.get_vocab()
    words = (t[1:] for t in vocab if t.startswith("Ġ"))
    return tuple(sorted(w for w in words if w.isascii() and w.isalpha()))


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of word salad (exact counts come from tokenizing the prompt)."""
    words = _words()
    return " ".join(rng.choice(words) for _ in range(tokens))


@dataclass(frozen=True, slots=True)
class Item:
    """A request plus what the benchmark's own models need to know about it.

    ``key`` names the unit an ideal router would keep on one replica (group, conversation,
    adapter); ``prompt_ids`` are the engine's token ids, for the oracle's cache model.
    """

    request: Request
    key: str
    prompt_ids: tuple[int, ...]
    lora: str | None = None
    # A chat turn's conversation: the turn is sent only once the previous one was answered,
    # and ``think`` seconds after that answer.
    follows: str | None = None
    think: float = 0.0


def _body(**fields: object) -> bytes:
    return json.dumps(
        {**fields, "stream": True, "stream_options": {"include_usage": True}},
        separators=(",", ":"),
    ).encode()


@dataclass
class SharedPrefix:
    groups: int = 32
    users: int = 8
    system_tokens: int = 2048
    question_tokens: int = 256
    output_tokens: int = 200
    seed: int = 0
    name: str = "shared-prefix"

    def describe(self) -> str:
        return (
            f"{self.groups} groups x {self.users} users, system prompt {self.system_tokens} "
            f"tokens + question {self.question_tokens}, output {self.output_tokens} tokens"
        )

    def shared_tokens(self) -> int:
        """Tokens an ideal fleet keeps cached: every group's system prompt once."""
        return self.groups * self.system_tokens

    def loras(self) -> tuple[list[str], int]:
        """Adapters the fleet must serve and how many fit at once (none here)."""
        return [], 1

    def stream(self) -> Iterator[Item]:
        rng = random.Random(self.seed)
        items: dict[tuple[int, int], Item] = {}
        systems = [text(rng, self.system_tokens) for _ in range(self.groups)]
        for g, system in enumerate(systems):
            for u in range(self.users):
                prompt = f"{system}\n\n{text(rng, self.question_tokens)}"
                items[g, u] = Item(
                    Request(
                        "/v1/completions",
                        _body(model=MODEL, prompt=prompt, max_tokens=self.output_tokens),
                    ),
                    key=f"group-{g}",
                    prompt_ids=tuple(tokenizer().encode(prompt)),
                )
        while True:
            yield items[rng.randrange(self.groups), rng.randrange(self.users)]


class _ChatShape(Protocol):
    turns: int
    first_user_tokens: int
    user_tokens: int
    output_tokens: int


def _chat(
    rng: random.Random, conv: str, system: dict[str, str], shape: _ChatShape, waits: bool
) -> Iterator[Item]:
    """One conversation's turns after ``system``: a first message of ``first_user_tokens``,
    then a canned reply and a new message per turn; with ``waits`` a turn is sent only once
    the previous one was answered (the load generator's ``follows``)."""
    messages = [system, {"role": "user", "content": text(rng, shape.first_user_tokens)}]
    for turn in range(shape.turns):
        if turn:
            # The reply is canned, not the engine's output, so the stream is identical for
            # every router; the cache hit is on everything before it.
            messages += [
                {"role": "assistant", "content": text(rng, shape.output_tokens)},
                {"role": "user", "content": text(rng, shape.user_tokens)},
            ]
        yield Item(
            Request(
                "/v1/chat/completions",
                _body(model=MODEL, messages=messages, max_tokens=shape.output_tokens),
                {SESSION_HEADER: conv},
            ),
            key=conv,
            prompt_ids=tuple(tokenizer().encode_chat(messages)),
            follows=conv if waits else None,
        )


class Chats:
    """``count`` chat conversations running at once, a finished one replaced by a new one;
    :meth:`next` is the next turn of one of them, chosen at random. ``system`` gives a new
    conversation its system message (one shared by all, or its own); ``think`` draws the
    seconds a waiting turn is sent after the reply it follows (:attr:`Item.think`)."""

    def __init__(
        self,
        rng: random.Random,
        count: int,
        shape: _ChatShape,
        system: Callable[[], dict[str, str]],
        waits: bool,
        think: Callable[[], float] | None = None,
    ) -> None:
        self._rng = rng
        self._shape = shape
        self._system = system
        self._waits = waits
        self._think = think
        self._started = 0
        self._active = [self._conversation() for _ in range(count)]

    def _conversation(self) -> Iterator[Item]:
        conv = f"conv-{self._started}"
        self._started += 1
        for item in _chat(self._rng, conv, self._system(), self._shape, self._waits):
            yield item if self._think is None else replace(item, think=self._think())

    def next(self) -> Item:
        i = self._rng.randrange(len(self._active))
        item = next(self._active[i], None)
        if item is None:
            self._active[i] = self._conversation()
            item = next(self._active[i])
        return item


@dataclass
class MultiTurn:
    conversations: int = 24  # active at once; a finished one is replaced by a new one
    turns: int = 6
    system_tokens: int = 256  # shared by every conversation (the app's instructions)
    first_user_tokens: int = 2048  # the first message brings a document
    user_tokens: int = 96
    output_tokens: int = 128
    seed: int = 0
    name: str = "multi-turn"

    def describe(self) -> str:
        return (
            f"{self.conversations} active conversations x {self.turns} turns, first message "
            f"{self.first_user_tokens} tokens, later ones {self.user_tokens}, replies "
            f"{self.output_tokens} tokens"
        )

    def shared_tokens(self) -> int:
        """Histories the fleet should keep between turns: mean context of an active chat."""
        per_turn = self.user_tokens + self.output_tokens
        mean_context = self.system_tokens + self.first_user_tokens + per_turn * self.turns / 2
        return int(self.conversations * mean_context)

    def loras(self) -> tuple[list[str], int]:
        """Adapters the fleet must serve and how many fit at once (none here)."""
        return [], 1

    def stream(self) -> Iterator[Item]:
        rng = random.Random(self.seed)
        system = {"role": "system", "content": text(rng, self.system_tokens)}
        chats = Chats(rng, self.conversations, self, lambda: system, waits=False)
        while True:
            yield chats.next()


@dataclass
class LoraMix:
    adapters: int = 8
    max_loras: int = 2
    task_tokens: int = 768
    question_tokens: int = 128
    output_tokens: int = 128
    zipf_s: float = 1.0
    seed: int = 0
    name: str = "lora"
    _names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self._names = [f"adapter-{i}" for i in range(self.adapters)]

    def describe(self) -> str:
        return (
            f"{self.adapters} adapters (Zipf s={self.zipf_s}), max_loras {self.max_loras}, "
            f"task prompt {self.task_tokens} tokens + question {self.question_tokens}, "
            f"output {self.output_tokens}"
        )

    def shared_tokens(self) -> int:
        return self.adapters * self.task_tokens

    def loras(self) -> tuple[list[str], int]:
        return self._names, self.max_loras

    def stream(self) -> Iterator[Item]:
        rng = random.Random(self.seed)
        tasks = [text(rng, self.task_tokens) for _ in self._names]
        weights = [1 / (i + 1) ** self.zipf_s for i in range(self.adapters)]
        while True:
            i = rng.choices(range(self.adapters), weights)[0]
            prompt = f"{tasks[i]}\n\n{text(rng, self.question_tokens)}"
            name = self._names[i]
            yield Item(
                Request(
                    "/v1/completions",
                    _body(model=name, prompt=prompt, max_tokens=self.output_tokens),
                ),
                key=name,
                prompt_ids=tuple(tokenizer().encode(prompt)),
                lora=name,
            )


@dataclass
class Mixed:
    """Shared-prefix groups of Zipf popularity beside chat conversations, each with its own
    system prompt, whose turns wait for the previous reply (closed loop per conversation):
    nobody tuned for it, and it mixes long cold prefills with short cached turns."""

    groups: int = 16
    users: int = 8
    system_tokens: int = 2048
    question_tokens: int = 256
    zipf_s: float = 1.0
    conversations: int = 16
    turns: int = 6
    chat_system_tokens: int = 512
    first_user_tokens: int = 1024
    user_tokens: int = 96
    output_tokens: int = 128
    chat_share: float = 0.5
    seed: int = 0
    name: str = "mixed"

    def describe(self) -> str:
        return (
            f"{100 * (1 - self.chat_share):.0f}% shared-prefix ({self.groups} groups, Zipf "
            f"s={self.zipf_s}, system prompt {self.system_tokens} + question "
            f"{self.question_tokens}), {100 * self.chat_share:.0f}% chat ({self.conversations} "
            f"conversations x {self.turns} turns, own system prompt {self.chat_system_tokens}, "
            f"first message {self.first_user_tokens}, later {self.user_tokens}; a turn waits "
            f"for the previous reply), output {self.output_tokens} tokens"
        )

    def shared_tokens(self) -> int:
        per_turn = self.user_tokens + self.output_tokens
        chat = self.chat_system_tokens + self.first_user_tokens + per_turn * self.turns / 2
        return int(self.groups * self.system_tokens + self.conversations * chat)

    def loras(self) -> tuple[list[str], int]:
        return [], 1

    def stream(self) -> Iterator[Item]:
        rng = random.Random(self.seed)
        systems = [text(rng, self.system_tokens) for _ in range(self.groups)]
        weights = [1 / (g + 1) ** self.zipf_s for g in range(self.groups)]

        def group_item(g: int) -> Item:
            prompt = f"{systems[g]}\n\n{text(rng, self.question_tokens)}"
            return Item(
                Request(
                    "/v1/completions",
                    _body(model=MODEL, prompt=prompt, max_tokens=self.output_tokens),
                ),
                key=f"group-{g}",
                prompt_ids=tuple(tokenizer().encode(prompt)),
            )

        def system() -> dict[str, str]:
            return {"role": "system", "content": text(rng, self.chat_system_tokens)}

        chats = Chats(rng, self.conversations, self, system, waits=True)
        while True:
            if rng.random() >= self.chat_share:
                yield group_item(rng.choices(range(self.groups), weights)[0])
            else:
                yield chats.next()


def warmup(seconds: float, rate: float, seed: int) -> tuple[list[Request], list[float]]:
    """Requests and evenly spaced send times for a warm-up before a router's first stage:
    ``seconds * rate`` prompts of 2,304 tokens (a shared-prefix request's size) cached
    nowhere and sharing no prefix with any workload's (their own word salad, from a seed of
    their own), 32 output tokens each. They give a learning router every replica's speed
    without warming the measured prompts' caches: the first stage's cold prompts stay cold."""
    rng = random.Random(f"warmup/{seed}")
    count = max(1, round(seconds * rate))
    requests = [
        Request(
            "/v1/completions",
            _body(model=MODEL, prompt=f"warm-up {i}: {text(rng, 2300)}", max_tokens=32),
        )
        for i in range(count)
    ]
    return requests, [i / rate for i in range(count)]


class Workload(Protocol):
    """A deterministic, endless request stream the routing benchmarks replay."""

    @property
    def name(self) -> str: ...

    @property
    def seed(self) -> int: ...

    def describe(self) -> str: ...

    def shared_tokens(self) -> int: ...

    def loras(self) -> tuple[list[str], int]: ...

    def stream(self) -> Iterator[Item]: ...


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": SharedPrefix,
    "multi-turn": MultiTurn,
    "lora": LoraMix,
    "mixed": Mixed,
}
