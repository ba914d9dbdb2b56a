"""Reference models used by the examples, tests and benchmarks."""

from shardspeed.models.gpt import GPT, GPTConfig, PRESETS

__all__ = ["GPT", "GPTConfig", "PRESETS"]
