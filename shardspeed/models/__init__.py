"""Reference models used by the examples, tests and benchmarks."""

from shardspeed.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
