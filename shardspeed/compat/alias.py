"""``deepspeed.X.Y`` is ``shardspeed.X.Y``: an import finder that hands out shardspeed's own modules.

The ``deepspeed`` package in :func:`site_path` installs :class:`_Alias` on ``sys.meta_path``. Importing
``deepspeed.runtime.engine`` then returns the module object ``shardspeed.runtime.engine`` (registered under both
names), so classes, process-wide settings and ``isinstance`` are shared, never copied. A DeepSpeed module or
name that shardspeed does not mirror fails where it is used with one line
("shardspeed's deepspeed compatibility does not provide deepspeed.X.Y"), never silently.

``DEEPSPEED_VERSION`` is what ``importlib.metadata.version("deepspeed")`` and ``deepspeed.__version__`` answer:
the DeepSpeed release whose surface the integrations gate on and that shardspeed provides (accelerate and
transformers need >= 0.9.3, Lightning >= 0.16.0, TRL's ZeRO-3 generation path >= 0.16.4, accelerate's ALST
>= 0.18.2), with shardspeed's version as the local label so that the two are never confused.
"""
from __future__ import annotations

import dis
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Callable, Optional

from ..errors import NotProvidedError, NotProvidedImportError, NotProvidedModuleError

DEEPSPEED_VERSION = "0.18.2+shardspeed.0.1.0"
_PREFIX, _TARGET = "deepspeed.", "shardspeed."


def site_path() -> str:
    """The folder to put first on ``PYTHONPATH`` so that ``import deepspeed`` resolves to shardspeed."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def active() -> bool:
    """Whether ``import deepspeed`` in this process finds shardspeed's package (not an installed DeepSpeed)."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) or ""
    return bool(origin) and os.path.realpath(origin).startswith(os.path.realpath(site_path()) + os.sep)


def deepspeed_name(name: str) -> str:
    """``shardspeed.X.Y`` as DeepSpeed spells it (``deepspeed.X.Y``)."""
    return "deepspeed" + name[len("shardspeed"):] if name.split(".")[0] == "shardspeed" else name


def not_provided(what: str) -> NotProvidedError:
    """The one-line error for a DeepSpeed name shardspeed does not provide (``what`` in either spelling)."""
    return NotProvidedError(f"shardspeed's deepspeed compatibility does not provide {deepspeed_name(what)}")


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def _missing_name(what: str) -> Exception:
    """:func:`not_provided`, or the same line as an ImportError when the lookup is a ``from m import name``
    statement's (the frame above the chain of module ``__getattr__`` calls is at ``IMPORT_FROM``): Python turns
    an AttributeError there into its own "cannot import name", losing the line; ``hasattr`` still gets an
    AttributeError."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_name == "__getattr__" or frame.f_globals.get("__name__") == __name__):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is not None and 0 <= frame.f_lasti < len(frame.f_code.co_code) \
            and frame.f_code.co_code[frame.f_lasti] == _IMPORT_FROM:
        return NotProvidedImportError(str(not_provided(what)))
    return not_provided(what)


def module_getattr(module_name: str, fallback: Optional[ModuleType] = None) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for a DeepSpeed-mirroring module: a name it lacks is looked up on
    ``fallback`` (if any), then as a submodule, else fails with the one line. Dunder probes get a plain
    AttributeError."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if fallback is not None:
            try:
                return getattr(fallback, name)
            except (AttributeError, NotProvidedImportError):
                pass
        try:
            return importlib.import_module(f"{module_name}.{name}")
        except NotProvidedModuleError:
            pass
        except ModuleNotFoundError as exc:
            if exc.name != f"{module_name}.{name}":
                raise
        raise _missing_name(f"{module_name}.{name}")

    return __getattr__


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed.X`` as the already-imported ``shardspeed.X``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(_PREFIX):
            return None
        ours = _TARGET + fullname[len(_PREFIX):]
        try:
            module = importlib.import_module(ours)
        except ModuleNotFoundError as exc:
            if exc.name is not None and ours.startswith(exc.name) and exc.name.startswith(_TARGET):
                raise NotProvidedModuleError(f"shardspeed's deepspeed compatibility does not provide {fullname}",
                                             name=fullname) from None
            raise
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=getattr(module, "__file__", None),
                                              is_package=hasattr(module, "__path__"))
        spec.loader_state = ours
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return sys.modules[spec.loader_state]

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is shardspeed's, imported by :meth:`find_spec`."""

    def get_code(self, fullname: str) -> Any:
        """The code of the shardspeed module, for ``python -m deepspeed.X`` (runpy runs it as ``__main__``)."""
        ours = _TARGET + fullname[len(_PREFIX):]
        spec = importlib.util.find_spec(ours)
        loader = getattr(spec, "loader", None)
        return loader.get_code(ours) if loader is not None and hasattr(loader, "get_code") else None


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once per process); the ``deepspeed`` package calls it."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
