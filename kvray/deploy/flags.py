"""Command-line flags derived from a settings model (`EngineConfig`, `ServeConfig`): one
flag per field, --field-name (plus the field's `cli_aliases`), typed and documented from
the field's declaration; `nargs: "+"` in its `json_schema_extra` makes the flag take
several values (as vLLM's does: the model's validator reads the list). An unset flag is
left out of the parsed values, so the model's own default applies: no default is written
twice. An optional field whose default is not None takes `none` to unset it.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Literal

from pydantic import BaseModel


def _strip_optional(annotation: Any) -> Any:
    """`X | None` -> X (None is every optional field's default, never a flag value)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _or_none(kind: Any) -> Any:
    """`kind`'s parser that also reads `none` as None."""

    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def sized_int(text: str) -> int:
    """A token count as vLLM's flags read one: an integer, or one with a suffix, decimal in
    lower case (32k = 32000, 1.5k = 1500) and binary in upper case (32K = 32768, whole
    numbers only)."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", text)
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _BINARY:
        if "." in number:
            raise ValueError(f"{text!r}: a binary suffix takes a whole number")
        return int(number) * _BINARY[suffix]
    value = Decimal(number) * _DECIMAL[suffix]  # (exact: 1.001k is 1001)
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of tokens")
    return int(value)


sized_int.__name__ = "token count"  # argparse names the type in its errors


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    exclude: Iterable[str] = (),
    choices: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Add a flag for each field of `model` but `exclude`. `choices` names the allowed
    values of plain string fields whose values come from a registry."""
    skip = set(exclude)
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flags = [f"--{name.replace('_', '-')}", *extra.get("cli_aliases", [])]  # type: ignore[list-item]
        kind = _strip_optional(field.annotation)
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        default = field.get_default(call_default_factory=True)
        help_text = field.description or ""
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:  # a repeatable flag: tuple[Literal[...], ...]
            item = typing.get_args(kind)[0]
            kw.update(action="append", choices=list(typing.get_args(item)) or None)
            help_text += " (repeatable)"
            if extra.get("nargs") == "+":  # also several values after one flag
                kw.update(action="extend", nargs="+")
        elif typing.get_origin(kind) is Literal:
            kw["choices"] = list(typing.get_args(kind))
            if aliases := extra.get("value_aliases"):  # other names of some choices
                kw["type"] = _aliased(aliases)  # type: ignore[arg-type]
                help_text += " (also " + ", ".join(aliases) + ")"  # type: ignore[arg-type]
        else:
            kw["type"] = sized_int if kind is int and extra.get("sized") else kind
            if extra.get("nargs") == "+":  # several values, as vLLM's flag takes: a list
                kw["nargs"] = "+"
            if kind is not field.annotation and default is not None:  # X | None, set
                kw["type"] = _or_none(kw["type"])
                help_text += "; 'none' unsets it"
            if choices and name in choices:
                kw["choices"] = list(choices[name])
        if default not in (None, ()):
            help_text += f" (default: {default})"
        parser.add_argument(*flags, help=help_text, **kw)


def _aliased(aliases: Mapping[str, str]) -> Any:
    """A flag's parser that reads each alias as the value it names (argparse checks the
    choices after this)."""

    def parse(text: str) -> str:
        return aliases.get(text, text)

    parse.__name__ = "value"
    return parse


def model_from_flags(model: type[BaseModel], args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of `model` from the flags the user gave (validated by the model)."""
    given = {k: v for k, v in vars(args).items() if k in model.model_fields}
    return model(**{**given, **overrides})
