"""Dataclass configs as TOML: :func:`read_toml` (``aligndp train --config``) and
:func:`to_toml` (the ``run.toml`` a run writes), which read back into the same values.

Reading uses the standard library's ``tomllib`` (``tomli``, the same parser, on Python 3.10);
writing needs no library: a config is flat bools, ints, floats and strings.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from typing import Literal

__all__ = ["field_type", "read_toml", "to_toml", "to_toml_value"]


def field_type(hint: object) -> type:
    """The Python type a field's value has: str for a Literal, X for ``X | None``."""
    if typing.get_origin(hint) is Literal:
        return str
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


def read_toml(path: str, cls: type) -> dict[str, object]:
    """The fields of dataclass ``cls`` a TOML file gives (keys as fields or flags), each
    checked for its type; a key that is no field is refused, naming the closest one."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path} is not valid TOML: {e}") from None
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in hints:
            close = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"--config {path}: unknown key {key!r}{hint}")
        kinds = [field_type(hints[name])]
        if kinds[0] is float:
            kinds.append(int)
        if not isinstance(value, tuple(kinds)) or (isinstance(value, bool) and bool not in kinds):
            raise ValueError(
                f"--config {path}: {key} = {value!r} is a {type(value).__name__}; write a "
                f"{kinds[0].__name__}, e.g. {key} = {to_toml_value(_example(cls, name))}"
            )
        values[name] = float(value) if kinds[0] is float else value
    return values


def to_toml(config: object, *, header: str, leave_out: tuple[str, ...] = ()) -> str:
    """Dataclass ``config`` as the TOML that :func:`read_toml` reads back into the same values
    (fields that are None, and those named in ``leave_out``, left out), under ``# header``."""
    lines = [f"# {header}"]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is not None and field.name not in leave_out:
            lines.append(f"{field.name} = {to_toml_value(value)}")
    return "\n".join(lines) + "\n"


def to_toml_value(value: object) -> str:
    """One TOML value: a bool, int, float (repr round-trips) or a basic string (JSON's escapes
    are TOML's)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False, allow_nan=False)


def _example(cls: type, name: str) -> object:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default not in (None, dataclasses.MISSING):
        return field.default
    kind = field_type(typing.get_type_hints(cls)[name])
    return {str: "text", int: 1, float: 1.0, bool: True}[kind]
