"""shardspeed's ``deepspeed`` package: ``import deepspeed`` without DeepSpeed.

This folder's parent is on ``sys.path`` only when asked (``shardspeed run --as-deepspeed``, or
``PYTHONPATH="$(shardspeed deepspeed-path):$PYTHONPATH"``). Every ``deepspeed.X`` is the module
``shardspeed.X`` (see ``shardspeed.compat.alias``); this top-level module carries DeepSpeed's version and
shardspeed's top-level names. Importing it initialises no accelerator and starts no process group.
"""
import shardspeed as _shardspeed
from shardspeed.compat import alias as _alias

_alias.install()

__version__ = _alias.DEEPSPEED_VERSION
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split("+")[0].split("."))
__git_hash__ = __git_branch__ = "[none]"  # DeepSpeed's values for a build without git information
__path__ = []  # submodules come from the finder, never from this folder
__shardspeed__ = _shardspeed.__version__

globals().update({name: getattr(_shardspeed, name) for name in _shardspeed.__all__ if name != "__version__"})

__getattr__ = _alias.module_getattr(__name__, fallback=_shardspeed)
