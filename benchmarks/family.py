"""A family of workloads, not one workload: each seed draws the shape of the traffic.

A router tuned on one workload can win it and lose the next, so the tail benchmark
(:mod:`benchmarks.tails`) measures every router on several draws of this family. A draw sets,
from its seed alone:

- shared-prefix groups: how many, how long their system prompts and questions, how skewed
  their popularity (Zipf exponent);
- chat conversations: how many at once, how many turns, how long their own system prompts and
  first and later messages, and the think time between a reply and the next turn;
- one-off prompts that share nothing with anything (their share of requests and their length);
- the mix between groups, chats and one-offs, the output length (each request draws its own
  around the draw's mean) and how bursty arrivals are (the coefficient of variation of the
  gaps between them: 1 is Poisson, higher clumps arrivals into bursts).

Everything is in the simulator's tokens, like :mod:`benchmarks.workloads`, and the same seed
gives the same requests in the same order for every router.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from benchmarks.loadgen import Request
from benchmarks.workloads import MODEL, Chats, Item, _body, text, tokenizer
from epp.sim.profiles import Profile


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


@dataclass(frozen=True)
class Shape:
    """One draw of the family (see the module docstring for what each part is)."""

    seed: int
    groups: int
    system_tokens: int
    question_tokens: int
    zipf_s: float
    conversations: int
    turns: int
    chat_system_tokens: int
    first_user_tokens: int
    user_tokens: int
    think_seconds: float
    unique_tokens: int
    output_tokens: int
    chat_share: float
    unique_share: float
    burstiness: float

    @classmethod
    def draw(cls, seed: int) -> Shape:
        """The shape of draw ``seed``; the ranges are wide on purpose (no shape is favoured)."""
        rng = random.Random(f"family/{seed}")
        chat_share = rng.uniform(0.1, 0.8)
        unique_share = rng.uniform(0.0, min(0.3, 1.0 - chat_share))
        return cls(
            seed=seed,
            groups=rng.randint(4, 32),
            system_tokens=round(_log_uniform(rng, 512, 4096)),
            question_tokens=round(_log_uniform(rng, 64, 512)),
            zipf_s=rng.uniform(0.6, 1.4),
            conversations=rng.randint(4, 32),
            turns=rng.randint(2, 10),
            chat_system_tokens=round(_log_uniform(rng, 128, 1024)),
            first_user_tokens=round(_log_uniform(rng, 256, 3072)),
            user_tokens=round(_log_uniform(rng, 32, 256)),
            think_seconds=rng.uniform(0.0, 2.0),
            unique_tokens=round(_log_uniform(rng, 256, 4096)),
            output_tokens=round(_log_uniform(rng, 32, 512)),
            chat_share=chat_share,
            unique_share=unique_share,
            burstiness=rng.uniform(1.0, 4.0),
        )

    def describe(self) -> str:
        group_share = 1.0 - self.chat_share - self.unique_share
        return (
            f"draw {self.seed}: {100 * group_share:.0f}% shared-prefix ({self.groups} groups, "
            f"Zipf s={self.zipf_s:.2f}, system {self.system_tokens} + question "
            f"{self.question_tokens}), {100 * self.chat_share:.0f}% chat ({self.conversations} "
            f"x {self.turns} turns, system {self.chat_system_tokens}, first "
            f"{self.first_user_tokens}, later {self.user_tokens}, think "
            f"{self.think_seconds:.1f} s), {100 * self.unique_share:.0f}% one-off "
            f"({self.unique_tokens} tokens); output ~{self.output_tokens}; "
            f"arrival CV {self.burstiness:.1f}"
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def mean_prompt_tokens(self) -> float:
        """Mean prompt length over the mix (a chat turn at its mean context)."""
        group = self.system_tokens + self.question_tokens
        per_turn = self.user_tokens + self.output_tokens
        chat = self.chat_system_tokens + self.first_user_tokens + per_turn * (self.turns - 1) / 2
        group_share = 1.0 - self.chat_share - self.unique_share
        return group_share * group + self.chat_share * chat + self.unique_share * self.unique_tokens

    def capacity(self, profile: Profile, replicas: float, time_scale: float) -> float:
        """Requests per second the fleet serves when nothing is cached: every prompt token
        prefilled, outputs decoded in full batches. The offered load is a fraction of this, so
        a draw with long prompts gets a lower rate than one with short ones; a router that
        reuses cached prefixes has the more headroom the more it reuses."""
        prefill = self.mean_prompt_tokens() * profile.prefill_s_per_token
        batch = profile.max_num_seqs
        decode = self.output_tokens * (profile.step_overhead_s / batch + profile.decode_s_per_seq)
        seconds = (prefill + decode + profile.request_overhead_s) * time_scale
        return replicas / seconds


@dataclass
class _ChatDims:
    """A conversation's dimensions, as :func:`benchmarks.workloads._chat` reads them."""

    turns: int
    first_user_tokens: int
    user_tokens: int
    output_tokens: int


@dataclass
class FamilyWorkload:
    """The requests of one :class:`Shape` (the routing benchmark's workload protocol)."""

    shape: Shape
    name: str = "family"

    @property
    def seed(self) -> int:
        return self.shape.seed

    @property
    def _chat_shape(self) -> _ChatDims:
        s = self.shape
        return _ChatDims(s.turns, s.first_user_tokens, s.user_tokens, s.output_tokens)

    def describe(self) -> str:
        return self.shape.describe()

    def shared_tokens(self) -> int:
        s = self.shape
        per_turn = s.user_tokens + s.output_tokens
        chat = s.chat_system_tokens + s.first_user_tokens + per_turn * s.turns / 2
        return int(s.groups * s.system_tokens + s.conversations * chat)

    def loras(self) -> tuple[list[str], int]:
        return [], 1

    def _output(self, rng: random.Random) -> int:
        return max(8, round(rng.lognormvariate(math.log(self.shape.output_tokens), 0.5)))

    def stream(self) -> Iterator[Item]:
        s = self.shape
        rng = random.Random(f"family-requests/{s.seed}")
        systems = [text(rng, s.system_tokens) for _ in range(s.groups)]
        weights = [1 / (g + 1) ** s.zipf_s for g in range(s.groups)]

        def completion(prompt: str, key: str) -> Item:
            body = _body(model=MODEL, prompt=prompt, max_tokens=self._output(rng))
            return Item(
                Request("/v1/completions", body),
                key=key,
                prompt_ids=tuple(tokenizer().encode(prompt)),
            )

        def system() -> dict[str, str]:
            return {"role": "system", "content": text(rng, s.chat_system_tokens)}

        def think() -> float:
            return rng.expovariate(1 / s.think_seconds) if s.think_seconds else 0.0

        chats = Chats(rng, s.conversations, self._chat_shape, system, waits=True, think=think)
        unique = 0
        while True:
            roll = rng.random()
            if roll < s.unique_share:
                unique += 1
                yield completion(text(rng, s.unique_tokens), f"unique-{unique}")
            elif roll < s.unique_share + s.chat_share:
                yield chats.next()
            else:
                g = rng.choices(range(s.groups), weights)[0]
                yield completion(f"{systems[g]}\n\n{text(rng, s.question_tokens)}", f"group-{g}")


def bursty_arrivals(rate: float, duration: float, cv: float, rng: random.Random) -> list[float]:
    """Send offsets of a renewal process of mean ``rate`` whose gaps have coefficient of
    variation ``cv`` (gamma gaps: ``cv`` 1 is Poisson, above 1 arrivals come in bursts)."""
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    times: list[float] = []
    t = rng.gammavariate(shape, scale)
    while t < duration:
        times.append(t)
        t += rng.gammavariate(shape, scale)
    return times
