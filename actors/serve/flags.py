"""`k3ray serve` flags generated from the settings (serve/config.py): one `--kebab-case` flag per
field, typed by its annotation (Literal: choices; bool: --x / --no-x), its help the field's
description and default, one help section per group. A flag's value is None unless given, so
only the flags given reach the settings; an absent one takes the field's default."""

from __future__ import annotations

import argparse
import re
import shlex
import types
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from k3ray.actors.serve.config import LaunchSettings, ServeArgs

LAUNCH_GROUP = "launch"
_NULL_MEANING = re.compile(r";? ?\bnull = ([^;]*)")  # a description's "null = <what no value means>"


def groups() -> dict[str, type[BaseModel]]:
    """Help section / nested key -> its settings class: the launcher's, then ServeArgs' groups."""
    nested = {name: info.annotation for name, info in ServeArgs.model_fields.items()}
    return {LAUNCH_GROUP: LaunchSettings, **nested}


def fields() -> dict[str, tuple[str, FieldInfo]]:
    """Flag destination (the field name) -> (its group, the field); field names are unique across groups."""
    out: dict[str, tuple[str, FieldInfo]] = {}
    for group, cls in groups().items():
        for name, info in cls.model_fields.items():
            assert name not in out, f"{name} is a field of both {out[name][0]} and {group}"
            out[name] = (group, info)
    return out


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    sections = {group: parser.add_argument_group(group, _one_line(cls.__doc__)) for group, cls in groups().items()}
    for name, (group, info) in fields().items():
        sections[group].add_argument(flag(name), dest=name, default=None, **_argument_kind(info),
                                     help=_help(info))


def given(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags given, nested as group -> field -> value (a group with none given is left out)."""
    namespace = vars(args)
    out: dict[str, dict[str, Any]] = {}
    for name, (group, _) in fields().items():
        if namespace[name] is not None:
            out.setdefault(group, {})[name] = namespace[name]
    return out


def launch_settings(args: argparse.Namespace) -> LaunchSettings:
    return LaunchSettings.model_validate(given(args).get(LAUNCH_GROUP, {}))


def serve_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The app's args of the flags given (ServeArgs' nested groups, unvalidated)."""
    return {group: values for group, values in given(args).items() if group != LAUNCH_GROUP}


def command_flags(args: argparse.Namespace) -> list[str]:
    """The flags given, written back in field order: one shell-quoted `--flag value` per entry."""
    words: list[str] = []
    for values in given(args).values():
        for name, value in values.items():
            if isinstance(value, bool):
                words.append(flag(name) if value else "--no-" + flag(name)[2:])
            else:
                words.append(f"{flag(name)} {shlex.quote(str(value))}")
    return words


def scalar(value: Any) -> str:
    """A value as a YAML scalar (null, true, 0.5, PACK): the help's and the Serve config's form."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).removesuffix("\n").removesuffix("\n...")


def _argument_kind(info: FieldInfo) -> dict[str, Any]:
    kind = _without_none(info.annotation)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        return {"choices": choices, "type": type(choices[0])}
    assert kind in (int, float, str), f"no flag type for {info.annotation}"
    return {"type": kind}


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (kind,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return kind
    return annotation


def _help(info: FieldInfo) -> str:
    """The description and its default; an unset (null) default as the description's `null = X` says."""
    assert info.description, "every setting needs a description (its help)"
    if info.default is not None:
        return f"{info.description} (default: {scalar(info.default)})".replace("%", "%%")
    meaning = _NULL_MEANING.search(info.description)
    assert meaning, f"a setting without a default says what null means ('null = ...'): {info.description!r}"
    rest = (info.description[: meaning.start()] + info.description[meaning.end():]).rstrip("; ")
    return f"{rest} (default: {meaning.group(1)})".replace("%", "%%")


def _one_line(doc: str | None) -> str:
    assert doc, "every settings group needs a docstring (its help section)"
    return " ".join(doc.split())
