"""Every error shardspeed raises on purpose derives from ShardspeedError.

Each message says what was wrong and what to change; callers may catch the base class.
"""


class ShardspeedError(Exception):
    """Base class of the errors shardspeed raises on purpose."""


class ConfigError(ShardspeedError, ValueError):
    """The configuration is invalid: the message names the key and what it may be."""


class RequiredArgumentError(ConfigError, AssertionError):
    """A required argument is missing (also an AssertionError: DeepSpeed asserts these, and its callers' tests
    expect that type)."""


class DistributedError(ShardspeedError, RuntimeError):
    """A collective failed, timed out, or ranks disagree (e.g. a rank died or diverged)."""


class CheckpointError(ShardspeedError, RuntimeError):
    """A checkpoint is missing, incomplete or inconsistent with the running job."""


class LossScaleError(ShardspeedError, RuntimeError):
    """Dynamic loss scaling cannot continue (overflow at the minimum scale)."""


class NotProvidedError(ShardspeedError, AttributeError):
    """A DeepSpeed name that shardspeed's ``deepspeed`` compatibility does not provide (an AttributeError, so
    ``hasattr`` probes still answer False)."""


class NotProvidedModuleError(ShardspeedError, ModuleNotFoundError):
    """A DeepSpeed module that shardspeed's ``deepspeed`` compatibility does not provide."""


class NotProvidedImportError(ShardspeedError, ImportError):
    """``from deepspeed import X`` for a name shardspeed's ``deepspeed`` compatibility does not provide (Python
    would replace the AttributeError with its own "cannot import name" and lose the line)."""
