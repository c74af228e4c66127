"""Train the simulator's small byte-level BPE tokenizer and write it as a Hugging Face dir.

Why a real tokenizer: routers, load generators and a tiny real vLLM model all need the same
token ids for the same text, so prefix hashes agree between the simulator, the picker and vLLM.
It is trained on local text only (the Python standard library's sources, a sorted file list,
a fixed byte budget) so the build is reproducible without network access.

Usage: python tools/build_tokenizer.py [--out epp/sim/tokenizer] [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: <s>=0, </s>=1, <pad>=2, <|im_start|>=3, <|im_end|>=4.
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# Role-tagged turns, then an assistant generation prompt. epp/sim/chat_template.py renders this
# exact template without jinja2; keep the two in step (a unit test compares them).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MODEL_MAX_LENGTH = 32768
# A few MB of text is plenty for a 4k vocab and keeps the build to seconds on 2 cores.
TRAIN_BYTES = 6 * 1024 * 1024


def corpus_files() -> list[Path]:
    """Standard library .py files in sorted order, skipping tests (large, repetitive data)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in {"site-packages", "test", "idlelib", "lib2to3"} or "tests" in rel:
            continue
        files.append(path)
    return files


def corpus_lines(budget: int) -> Iterator[str]:
    """Yield whole files' text until the byte budget is spent (deterministic prefix)."""
    used = 0
    for path in corpus_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        used += len(text.encode())
        yield text
        if used >= budget:
            return


def train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(TRAIN_BYTES), trainer=trainer)
    # Completions prompts get a BOS like Llama tokenizers do; chat prompts carry it in the
    # template and are tokenized without special tokens (as vLLM does).
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def tokenizer_config(tok: Tokenizer) -> dict[str, object]:
    """HF tokenizer_config.json: loadable by PreTrainedTokenizerFast and vLLM."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("epp/sim/tokenizer"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    tok = train(args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    for name, data in [
        ("tokenizer_config.json", tokenizer_config(tok)),
        ("special_tokens_map.json", special_map),
    ]:
        (args.out / name).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out} (vocab {tok.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
