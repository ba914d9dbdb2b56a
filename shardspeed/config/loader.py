"""`load_config`: read, validate and resolve a DeepSpeed-format config; one-line `ConfigError`s."""
from __future__ import annotations

import base64
import json
import logging
import os
import string
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from pydantic import BaseModel, ValidationError

from shardspeed.errors import ConfigError

from .base import ConfigModel, close_key, field_marker
from .batch import resolve_batch_sizes
from .models import ShardspeedConfig

logger = logging.getLogger("shardspeed.config")

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# What a value may be, by pydantic error type.
_EXPECTED = MappingProxyType({
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "string_type": "a string", "list_type": "a list", "dict_type": "an object ({...})",
    "model_type": "an object ({...})", "model_attributes_type": "an object ({...})",
})
_BOUNDS = MappingProxyType({"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")})
_EXPECTED_BY_KEY = MappingProxyType({"zero_optimization.stage": "0, 1, 2 or 3"})
#: How deep a config may nest (DeepSpeed's are 3-4 levels) and the range of its integers.
MAX_DEPTH = 64
_BASE64 = frozenset(string.ascii_letters + string.digits + "-_=")
_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def load_config(config: Union[Dict[str, Any], str, os.PathLike, ShardspeedConfig, None],
                world_size: int = 1) -> ShardspeedConfig:
    """Parse and validate a DeepSpeed-format config and resolve the batch trio for `world_size`
    data-parallel ranks.

    `config` is a dict (not modified), a path to a JSON file, or a `ShardspeedConfig` (re-resolved for
    `world_size` from the batch values the user originally gave). Every problem raises `ConfigError`
    with a one-line message naming the dotted key.
    """
    model = parse_config(config)
    given = model._given_batch
    assert given is not None
    train, micro, gas = resolve_batch_sizes(*given, world_size)
    resolved = model.model_copy(update={"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
                                        "gradient_accumulation_steps": gas})
    resolved._given_batch = given
    return resolved


def parse_config(config: Union[Dict[str, Any], str, os.PathLike, ShardspeedConfig, None]) -> ShardspeedConfig:
    """Read and validate a config without resolving the batch sizes (they depend on the data-parallel
    size, which the mesh sizes in the config decide: read `pipeline.stages` and
    `tensor_parallel.autotp_size` from this, then call `load_config(parsed, world_size=dp_size)`)."""
    if config is None:
        raise ConfigError("a config is required: pass a dict, a path to a JSON file, or a ShardspeedConfig")
    if isinstance(config, ShardspeedConfig):
        if config._given_batch is not None:
            return config
        model = config
    else:
        if isinstance(config, (str, os.PathLike)):
            config = read_json(config)
        if not isinstance(config, dict):
            raise ConfigError(f"a config must be a dict, a path or a ShardspeedConfig, got {type(config).__name__}")
        config = drop_unread_keys(config)
        model = validate(config)
        _warn_ignored(model, "")
    given = tuple(getattr(model, key) for key in _BATCH_KEYS)
    if given[0] is None and given[1] is None and not isinstance(config, ShardspeedConfig):
        auto = [key for key in _BATCH_KEYS[:2] if config.get(key) == "auto"]
        if auto:
            raise ConfigError(f"{' and '.join(repr(k) for k in auto)} {'is' if len(auto) == 1 else 'are'} "
                              "\"auto\" and cannot be derived: the caller (e.g. the Hugging Face Trainer) must "
                              "fill in train_batch_size or train_micro_batch_size_per_gpu")
    model = model.model_copy()
    model._given_batch = given
    return model


def read_json(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read a config file: JSON, or hjson as DeepSpeed also reads (comments, unquoted keys and strings,
    trailing commas; needs the optional `hjson` package, tried only when the text is not JSON). A string that
    names no file but is a URL-safe base64 encoding of such a config (DeepSpeed's third form) is decoded. A
    missing or unreadable file, bad syntax, duplicate keys, text that is not UTF-8, or nesting too deep for the
    parser raise `ConfigError`."""
    name = os.fspath(path)
    what = f"config file '{name}'"
    if os.path.isdir(name):
        raise ConfigError(f"{what} is a directory: give the path of a JSON file")
    text = None if os.path.isfile(name) else _base64_config(name)
    if text is not None:
        what = "the base64 config string"
    elif not os.path.isfile(name):
        raise ConfigError(f"{what} does not exist")
    try:
        if text is None:
            with open(name, encoding="utf-8") as f:
                text = f.read()
        data = _parse_text(what, text)
    except _DuplicateKey as e:
        raise ConfigError(f"{what} has the key '{e.args[0]}' twice in one object") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}; save it as UTF-8") from None
    except RecursionError:
        raise ConfigError(f"{what} is nested too deeply for a config (at most {MAX_DEPTH} levels)") from None
    except OSError as e:
        raise ConfigError(f"{what} cannot be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a JSON object, not {type(data).__name__}")
    return data


def _base64_config(text: str) -> Optional[str]:
    """The config a URL-safe base64 string encodes (DeepSpeed accepts one in place of a path), or None when
    ``text`` is not base64 of UTF-8 text starting with '{'."""
    if not text or len(text) % 4 or any(c not in _BASE64 for c in text):
        return None
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def _parse_text(what: str, text: str) -> Any:
    """JSON; when the text is not JSON, hjson (DeepSpeed's reader) if it is installed."""
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        where = f"{e.msg} at line {e.lineno}, column {e.colno}"
    try:
        import hjson  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        raise ConfigError(f"{what} is not valid JSON: {where} (DeepSpeed also reads hjson files: "
                          "`pip install hjson` to load one)") from None
    try:
        return hjson.loads(text, object_pairs_hook=_reject_duplicates, parse_int=_parse_int)
    except (ValueError, OverflowError) as e:  # HjsonDecodeError is a ValueError; a huge unquoted number overflows
        detail = (f"{e.msg} at line {e.lineno}, column {e.colno}" if isinstance(e, hjson.HjsonDecodeError)
                  else "a number is out of range" if isinstance(e, OverflowError) else str(e))
        raise ConfigError(f"{what} is not valid JSON: {where} (nor hjson: {detail})") from None


class _DuplicateKey(Exception):
    pass


class _LongNumber(str):
    """A JSON integer too long to be a config value, kept as its text so that `check_shape` can name its key
    (Python refuses to convert integers of more than 4300 digits, and none that long fits 64 bits)."""


def _parse_int(text: str) -> Any:
    return int(text) if len(text) <= 24 else _LongNumber(text)


def check_shape(data: Dict[str, Any]) -> None:
    """Refuse, naming the dotted key, a config nested more than `MAX_DEPTH` levels deep or holding an integer
    outside the signed 64-bit range (no size, count or seed is larger; torch's sizes are int64). Iterative, so
    a hostile depth cannot exhaust Python's stack."""
    todo: List[Tuple[str, Any, int]] = [("", data, 0)]
    while todo:
        path, value, depth = todo.pop()
        if depth > MAX_DEPTH:
            shown = path if len(path) <= 80 else f"{path[:80]}..."
            raise ConfigError(f"'{shown}' is nested more than {MAX_DEPTH} levels deep (a DeepSpeed config has "
                              "3 or 4 levels)")
        if isinstance(value, dict):
            todo.extend((_join(path, str(k)), v, depth + 1) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            todo.extend((f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value))
        elif isinstance(value, _LongNumber) or (
                isinstance(value, int) and not isinstance(value, bool) and not _INT64[0] <= value <= _INT64[1]):
            text = str(value)
            shown = text if len(text) <= 40 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
            raise ConfigError(f"{path} = {shown} is out of range: it must be between -2**63 and 2**63 - 1")


def _reject_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def validate(data: Dict[str, Any]) -> ShardspeedConfig:
    """`ShardspeedConfig.model_validate` with pydantic's errors turned into one `ConfigError`."""
    check_shape(data)
    try:
        return ShardspeedConfig.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        message = format_error(errors[0])
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        raise ConfigError(message) from None


def format_error(error: Mapping[str, Any]) -> str:
    """One line for one pydantic error: the dotted key, the value given and what it may be."""
    path = _dotted(error["loc"])
    kind, ctx, msg = error["type"], error.get("ctx") or {}, error["msg"]
    if kind == "unknown_key":
        return f"unknown key '{_join(path, ctx['key'].strip(chr(39)))}'{ctx['hint']}"
    if "key" in ctx:  # our own messages quote a key relative to the block: make it absolute
        return msg.replace(f"'{ctx['key']}'", f"'{_join(path, ctx['key'])}'", 1)
    if kind == "duplicate_alias":
        return msg.replace(f"'{ctx['alias']}'", f"'{_join(path, ctx['alias'])}'", 1).replace(
            f"'{ctx['name']}'", f"'{_join(path, ctx['name'])}'", 1)
    if kind == "missing":
        return f"'{path}' is required"
    value = _show(error.get("input"))
    if path in _EXPECTED_BY_KEY and (kind in _BOUNDS or kind in _EXPECTED):
        return f"{path} = {value} is invalid: it must be {_EXPECTED_BY_KEY[path]}{_strict_hint(kind, error)}"
    if kind in _EXPECTED:
        return f"{path} = {value} is invalid: it must be {_EXPECTED[kind]}{_strict_hint(kind, error)}"
    if kind in _BOUNDS:
        bound_key, sign = _BOUNDS[kind]
        return f"{path} = {value} is invalid: it must be {sign} {ctx.get(bound_key)}"
    if kind == "literal_error":
        return f"{path} = {value} is invalid: it must be one of {ctx.get('expected')}"
    if kind == "dtype":
        return f"{path} = {value} is invalid: it {msg}"
    return f"{path}: {msg}" if path else msg


def _strict_hint(kind: str, error: Mapping[str, Any]) -> str:
    """For a strict field given a string: say to write the number itself."""
    return " (a JSON number, not a string)" if kind == "int_type" and isinstance(error.get("input"), str) else ""


def _dotted(loc: Tuple[Any, ...]) -> str:
    parts: List[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" in item or item in ("int", "str", "float", "bool", "none"):
            continue  # a union member tag, not a key
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def drop_unread_keys(config: Dict[str, Any]) -> Dict[str, Any]:
    """``config`` without the top-level keys DeepSpeed's parser never reads, with one warning naming them:
    dotted keys (``"zero_optimization.reduce_bucket_size"``, as TRL writes: they set nothing, in DeepSpeed
    too) and names that are no misspelling of a key. A close misspelling (``"gradient_clippin"``) stays an
    error, and so does an unknown key inside a block (as in DeepSpeed's ``zero_optimization``)."""
    read = ShardspeedConfig.read_keys()
    known = set(read)
    dotted = [k for k in config if isinstance(k, str) and k not in known and "." in k]
    foreign = [k for k in config if isinstance(k, str) and k not in known and "." not in k
               and close_key(k, ShardspeedConfig.accepted_keys()) is None]
    if not dotted and not foreign:
        return config
    parts = []
    if dotted:
        parts.append(f"{', '.join(repr(k) for k in dotted)} (a dotted key sets nothing; nest it to set it, e.g. "
                     f"{{\"{dotted[0].split('.')[0]}\": {{\"{dotted[0].split('.', 1)[1]}\": ...}}}})")
    if foreign:
        parts.append(f"{', '.join(repr(k) for k in foreign)} (not a DeepSpeed key)")
    logger.warning("ignoring top-level config keys DeepSpeed does not read either: %s", "; ".join(parts))
    return {k: v for k, v in config.items() if k not in dotted and k not in foreign}


def _warn_ignored(model: BaseModel, path: str) -> None:
    """Log a warning for each accepted-but-ignored key set to a non-default value, and each block's own note
    (``ignored_note``: e.g. ``offload_param`` below stage 3)."""
    cls = type(model)
    note = getattr(model, "ignored_note", None)
    if note:
        logger.warning("%s%s", f"{path}: " if path else "", note)
    for name, info in cls.model_fields.items():
        value = getattr(model, name)
        if isinstance(value, ConfigModel):
            _warn_ignored(value, _join(path, name))
        elif field_marker(cls, name, "ignored") and name in model.model_fields_set and \
                value != info.get_default(call_default_factory=True):
            logger.warning("'%s' = %s is accepted for DeepSpeed compatibility but shardspeed ignores it",
                           _join(path, name), _show(value))


__all__ = ["load_config", "parse_config", "read_json", "validate", "drop_unread_keys", "check_shape", "format_error", "resolve_batch_sizes"]
