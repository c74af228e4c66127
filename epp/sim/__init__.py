"""A vLLM fleet simulator: OpenAI endpoints, vLLM metrics and KV events over a modelled engine
(paged prefix cache, continuous batching, preemption, LoRA slots). See docs/simulator.md."""
