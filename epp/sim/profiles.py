"""Hardware profiles: how fast a replica computes and how much KV it holds.

Numbers are rough public figures for an 8B-class model (Llama-3-8B, bf16, 128 KiB of KV per
token) so that relative behaviour is right: prefill is ~100x cheaper per token than a decode
step, decode slows as the batch and its context grow, and H100 is ~1.6x an A100. `cpu-tiny`
matches the real vLLM CPU setup in REFERENCE §4 (tiny random model, 8 MiB KV cache, block 32,
~50 ms for 500 prompt + 16 output tokens). Calibrate against real vLLM with docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_overhead_s: float  # fixed per step: scheduling, launch, sampling
    prefill_s_per_token: float  # per uncached prompt token computed
    decode_s_per_seq: float  # per sequence decoding in the step
    attn_s_per_ctx_token: float  # per context token read by decoding sequences
    lora_load_s: float  # loading one adapter into a GPU slot


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="h100",
            block_size=16,
            num_gpu_blocks=28_000,  # ~60 GB free for KV / 128 KiB per token / 16
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            step_overhead_s=0.006,
            prefill_s_per_token=0.00006,
            decode_s_per_seq=0.00004,
            attn_s_per_ctx_token=0.00000002,
            lora_load_s=0.02,
        ),
        Profile(
            name="a100",
            block_size=16,
            num_gpu_blocks=10_000,  # 40 GB card
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            step_overhead_s=0.009,
            prefill_s_per_token=0.0001,
            decode_s_per_seq=0.00007,
            attn_s_per_ctx_token=0.00000004,
            lora_load_s=0.03,
        ),
        Profile(
            name="cpu-tiny",
            block_size=32,
            num_gpu_blocks=256,  # 8 MiB / (2 layers x 2 KV heads x 64 x 2 x 2 bytes) / 32
            max_num_seqs=4,
            max_num_batched_tokens=2048,
            step_overhead_s=0.0025,
            prefill_s_per_token=0.0000125,
            decode_s_per_seq=0.0002,
            attn_s_per_ctx_token=0.0000002,
            lora_load_s=0.01,
        ),
    )
}
