"""The base of every config block: strict keys, aliases, "auto" handling and field markers.

Each block is a frozen pydantic model. Before pydantic validates a block, `ConfigModel` renames
DeepSpeed's aliases to the canonical field names, rejects unknown keys (with a suggestion), rejects
removed or unsupported features with a specific message, and resolves `"auto"` values where the field
says how. Errors raised here are `PydanticCustomError`s; `shardspeed.config.loader` turns them (and
pydantic's own errors) into one-line `ConfigError`s that name the dotted key.
"""
from __future__ import annotations

import difflib
import json
from typing import Any, ClassVar, Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

# A field's `json_schema_extra` may carry these markers:
#   "auto":    what "auto" means for the field: AUTO_DEFAULT (use the default) or {"value": v}.
#              Without it, "auto" is an error telling the caller to fill the value in.
#   "ignored": True when shardspeed accepts the key for compatibility but does not act on it
#              (a warning is logged when it is set to a non-default value).
#   "unsupported": True when only the default value is accepted (another value is an error).
#   "not_implemented": what the key asks for, when shardspeed does not implement it yet: any value other
#              than the default is refused with "'<key>' ... is not implemented yet" (checked by
#              ConfigModel for every block, so a config carrying the key at its default still loads).
#   "default_doc": how the default is shown in docs/config.md when it is computed.
AUTO_DEFAULT = "default"


def field(default: Any = None, description: str = "", *, auto: Any = None, ignored: bool = False,
          unsupported: bool = False, default_doc: str | None = None, not_implemented: str | None = None,
          **kwargs: Any) -> Any:
    """A pydantic `Field` carrying shardspeed's markers (see the module docstring)."""
    extra: Dict[str, Any] = {}
    if auto is not None:
        extra["auto"] = auto
    if ignored:
        extra["ignored"] = True
    if unsupported:
        extra["unsupported"] = True
    if default_doc is not None:
        extra["default_doc"] = default_doc
    if not_implemented is not None:
        extra["not_implemented"] = not_implemented
    if "default_factory" in kwargs:
        return Field(description=description, json_schema_extra=extra or None, **kwargs)
    return Field(default, description=description, json_schema_extra=extra or None, **kwargs)


def field_marker(model_cls: type[BaseModel], name: str, marker: str) -> Any:
    """The value of `marker` in the field's json_schema_extra, or None."""
    extra = model_cls.model_fields[name].json_schema_extra
    return extra.get(marker) if isinstance(extra, dict) else None


class ConfigModel(BaseModel):
    """Base of every config block: unknown keys are errors, aliases are renamed, "auto" resolved."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True,
                              protected_namespaces=(), arbitrary_types_allowed=False)

    #: Other spellings DeepSpeed accepts for a key: alias -> canonical field name.
    ALIASES: ClassVar[Dict[str, str]] = {}
    #: Keys that are refused with a specific message (removed or unsupported features).
    REJECTED: ClassVar[Dict[str, str]] = {}

    @classmethod
    def accepted_keys(cls) -> List[str]:
        """Every key this block accepts: field names and aliases."""
        return list(cls.model_fields) + list(cls.ALIASES)

    @model_validator(mode="after")
    def _refuse_not_implemented(self) -> Any:
        """A key marked `not_implemented` set to anything but its default is an error, not a no-op."""
        cls = type(self)
        for name, info in cls.model_fields.items():
            what = field_marker(cls, name, "not_implemented")
            if what is None:
                continue
            default = info.get_default(call_default_factory=True)
            value = getattr(self, name)
            if value != default:
                raise PydanticCustomError(
                    "not_implemented", "'{key}' = {value}: {what} is not implemented yet in shardspeed; remove "
                    "the key or set it to {default}",
                    {"key": name, "value": _json(value), "what": what, "default": _json(default)})
        return self

    @model_validator(mode="before")
    @classmethod
    def _normalize_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic reports the wrong type
        data = dict(data)  # never mutate the caller's dict
        for key in list(data):
            if not isinstance(key, str):
                raise PydanticCustomError("unknown_key", "unknown key {key}", {"key": repr(key), "hint": ""})
            if key in cls.REJECTED:
                raise PydanticCustomError("rejected_key", "'{key}': {reason}",
                                          {"key": key, "reason": cls.REJECTED[key]})
        for alias, name in cls.ALIASES.items():
            if alias in data:
                if name in data:
                    raise PydanticCustomError(
                        "duplicate_alias", "'{alias}' and '{name}' are the same setting; give only one",
                        {"alias": alias, "name": name})
                data[name] = data.pop(alias)
        for key in data:
            if key not in cls.model_fields:
                close = close_key(key, cls.accepted_keys())
                hint = f"; did you mean '{close}'?" if close else ""
                raise PydanticCustomError("unknown_key", "unknown key '{key}'{hint}", {"key": key, "hint": hint})
        for key, value in list(data.items()):
            if isinstance(value, str) and value == "auto":
                rule = field_marker(cls, key, "auto")
                if rule == AUTO_DEFAULT:
                    del data[key]
                elif isinstance(rule, dict):
                    data[key] = rule["value"]
                elif rule != "keep":
                    raise PydanticCustomError(
                        "auto_unresolved",
                        "'{key}' is \"auto\", which shardspeed cannot derive: the caller (e.g. the Hugging "
                        "Face Trainer) must fill in a value before passing the config", {"key": key})
        return data


def close_key(key: str, accepted: List[str]) -> Optional[str]:
    """The accepted key ``key`` is most likely a misspelling of, or None."""
    close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
    return close[0] if close else None


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
