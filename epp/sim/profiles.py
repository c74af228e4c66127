"""Hardware profiles: how fast a replica computes and how much KV it holds.

Numbers are rough public figures for an 8B-class model (Llama-3-8B, bf16, 128 KiB of KV per
token) so that relative behaviour is right: prefill is ~100x cheaper per token than a decode
step, decode slows as the batch and its context grow, and H100 is ~1.6x an A100. `cpu-tiny`
is measured: it is the real vLLM 0.32 CPU setup of tests/contract/ (tiny random-weight model,
float32, 8 MiB KV cache = 128 blocks of 32 tokens, max_num_seqs 4), and its timing constants
are fitted by tests/contract/calibrate.py (table in docs/simulator.md, "Calibration against
real vLLM").
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
    # Fixed cost of every request outside the engine's steps: the API server parsing it, the
    # hop to the engine process and back, building the response. Paid before the request
    # reaches the scheduler (so it is in TTFT and e2e latency, not in queue time).
    request_overhead_s: float = 0.0


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
            # 8 MiB / (K+V x 2 layers x 2 KV heads x 64 dims x 4 bytes (float32) x 32 tokens);
            # vLLM reports 128 and keeps block 0 as its null block.
            num_gpu_blocks=128,
            max_num_seqs=4,
            max_num_batched_tokens=2048,
            # Fitted to a real vLLM 0.32 on a shared 2-core box (see the module docstring): a
            # decode step costs ~4 ms whatever the batch (the tiny model is overhead-bound),
            # an uncached prompt token ~57 us, and each request ~5 ms outside the steps.
            step_overhead_s=0.0039,
            prefill_s_per_token=0.000057,
            decode_s_per_seq=0.00012,
            attn_s_per_ctx_token=0.0000002,
            lora_load_s=0.01,
            request_overhead_s=0.005,
        ),
    )
}
