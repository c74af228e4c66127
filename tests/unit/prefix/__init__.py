"""Precise prefix cache: KV-event subscriber, index, tokenization and scorer."""
