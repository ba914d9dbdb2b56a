"""The command line's one error type, shared by :mod:`.args` and :mod:`.ds_options`."""


class UsageError(ValueError):
    """A command line that cannot be turned into a torchrun command line."""
