"""DeepSpeed's ``deepspeed.runtime.sequence_parallel`` for shardspeed (ALST: Ulysses, tiling); see
:mod:`.ulysses_sp` and docs/long-context.md."""
