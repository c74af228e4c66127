"""Build the tiny random-weight model (and a random LoRA adapter) the real-vLLM tier serves.

    python tests/contract/make_tiny_model.py            # -> .cache/tiny-model, .cache/tiny-lora
    python tests/contract/make_tiny_model.py --out DIR --lora-out DIR2 --force

Stdlib only on purpose: it runs in the project's .venv, in the vLLM venv, or in CI before either
exists.  The model dir holds no weights at all: vLLM is started with `--load-format dummy`, which
fills the parameters randomly, so only `config.json` and the tokenizer files matter.  The
tokenizer is the repo's own (`epp/sim/tokenizer/`), so the simulator and the real engine tokenize
identically, which is what makes token-level contract comparisons (prefix hashes, block counts)
meaningful.

The architecture is the smallest Llama the CPU backend accepts: the CPU attention kernels need a
head size in {32, 64, 80, 96, 112, 128, 256}, so head_dim is 64 (4 heads x 64 = hidden 256), and
2 KV heads exercise GQA like real models.  Generated text is gibberish; timings, metrics, KV
events and the tokenizer are real.

The LoRA adapter is a PEFT-format dir (adapter_config.json + adapter_model.safetensors) with
random rank-8 A/B matrices on q_proj and v_proj.  The safetensors file is written by hand (the
format is an 8-byte little-endian header length, a JSON header, then raw tensor bytes), which
avoids depending on torch/safetensors/peft here.
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import random
import shutil
import struct
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "epp" / "sim" / "tokenizer"
DEFAULT_MODEL_DIR = REPO / ".cache" / "tiny-model"
DEFAULT_LORA_DIR = REPO / ".cache" / "tiny-lora"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 512
MAX_POSITIONS = 2048
LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


def wait_for_tokenizer(src: Path, timeout_s: float) -> None:
    """Poll until every tokenizer file exists and parses as JSON (another tool may be writing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [name for name in TOKENIZER_FILES if not _is_complete_json(src / name)]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(f"tokenizer files missing or incomplete in {src}: {missing}")
        print(f"waiting for {missing} in {src} ...", file=sys.stderr)
        time.sleep(5)


def _is_complete_json(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def vocab_size(tokenizer_json: Path) -> int:
    """Embedding rows needed: one past the largest id in the BPE vocab or the added tokens."""
    tok = json.loads(tokenizer_json.read_text())
    ids = list(tok["model"]["vocab"].values())
    ids += [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


def special_id(tokenizer_json: Path, content: str) -> int | None:
    tok = json.loads(tokenizer_json.read_text())
    for t in tok.get("added_tokens", []):
        if t["content"] == content:
            return int(t["id"])
    return tok["model"]["vocab"].get(content)


def llama_config(tokenizer_json: Path) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size(tokenizer_json),
        "bos_token_id": special_id(tokenizer_json, "<s>"),
        "eos_token_id": special_id(tokenizer_json, "</s>"),
        "pad_token_id": special_id(tokenizer_json, "<pad>"),
        # float32, not vLLM's CPU default bfloat16: CPUs without AVX512-BF16 (like this AMD
        # EPYC, AVX2 only) run bf16 linears on a slow fallback ("Failed to create oneDNN
        # linear"), which makes prefill ~3x slower than decode would suggest (500-token prefill
        # 166 ms in bf16 vs 53 ms in f32). vllm_server.py also passes --dtype float32.
        "torch_dtype": "float32",
    }


def tokenizer_digest(src: Path) -> str:
    """sha256 over the tokenizer files: fixtures record it so a tokenizer change is detectable."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        h.update(name.encode())
        h.update((src / name).read_bytes())
    return h.hexdigest()


def build_model(out: Path, src: Path = TOKENIZER_DIR) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)
    cfg = llama_config(src / "tokenizer.json")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2
        )
        + "\n"
    )
    (out / ".build-stamp").write_text(build_stamp(src) + "\n")
    return out


def build_stamp(src: Path = TOKENIZER_DIR) -> str:
    """Changes whenever the tokenizer files or the generated config would change."""
    cfg = json.dumps(llama_config(src / "tokenizer.json"), sort_keys=True)
    return hashlib.sha256((tokenizer_digest(src) + cfg).encode()).hexdigest()


def _random_f32(n: int, rng: random.Random, scale: float) -> bytes:
    buf = array.array("f", (rng.gauss(0.0, scale) for _ in range(n)))
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


def write_safetensors(path: Path, tensors: dict[str, tuple[list[int], bytes]]) -> None:
    """Minimal safetensors writer for F32 tensors: {name: (shape, little-endian bytes)}."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, data) in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec recommends 8-byte alignment of the data section
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for _, data in tensors.values():
            fh.write(data)


def build_lora(out: Path, base_model: Path, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)  # deterministic: the same adapter bytes on every machine
    out_dims = {
        "q_proj": HEADS * HEAD_DIM,
        "k_proj": KV_HEADS * HEAD_DIM,
        "v_proj": KV_HEADS * HEAD_DIM,
        "o_proj": HIDDEN,
    }
    tensors: dict[str, tuple[list[int], bytes]] = {}
    for layer in range(LAYERS):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (
                [LORA_RANK, HIDDEN],
                _random_f32(LORA_RANK * HIDDEN, rng, 0.02),
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                [out_dims[target], LORA_RANK],
                _random_f32(out_dims[target] * LORA_RANK, rng, 0.02),
            )
    write_safetensors(out / "adapter_model.safetensors", tensors)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": LORA_RANK,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGETS),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def ensure_model(
    model_dir: Path = DEFAULT_MODEL_DIR,
    lora_dir: Path = DEFAULT_LORA_DIR,
    *,
    force: bool = False,
    wait_s: float = 0.0,
) -> tuple[Path, Path]:
    """Build both dirs unless they are current (same tokenizer files, same config)."""
    wait_for_tokenizer(TOKENIZER_DIR, wait_s)
    stamp = model_dir / ".build-stamp"
    current = stamp.is_file() and stamp.read_text().strip() == build_stamp(TOKENIZER_DIR)
    if force or not current or not (model_dir / "config.json").is_file():
        build_model(model_dir)
    if force or not (lora_dir / "adapter_model.safetensors").is_file():
        build_lora(lora_dir, model_dir)
    return model_dir, lora_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lora-out", type=Path, default=DEFAULT_LORA_DIR)
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument(
        "--wait",
        type=float,
        default=600.0,
        help="seconds to wait for the tokenizer files to appear (default 600)",
    )
    args = ap.parse_args()
    model, lora = ensure_model(args.out, args.lora_out, force=args.force, wait_s=args.wait)
    cfg = json.loads((model / "config.json").read_text())
    print(f"model: {model} (vocab {cfg['vocab_size']})")
    print(f"lora:  {lora} (rank {LORA_RANK}, targets {', '.join(LORA_TARGETS)})")


if __name__ == "__main__":
    main()
