"""Options said once: a config dataclass field declares its help, choices and spellings, and the
command line's flags and ``LLM()``'s keywords are derived from it (vLLM's ``EngineArgs``).

A field made with :func:`option` is a user option; a field holding a dataclass is a group of
options; any other field is internal (set by the program, never by a flag). An option's name
is its field's name unless the field's name needs its class for context in one flat namespace
(``SpeculativeConfig.method`` is the option ``speculative``). The name is, at once, the flag
(``--`` and the name with dashes), the keyword and the ``argparse`` destination.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# The value types an option may have (a field typed ``X | None`` is an option of type X).
_VALUE_TYPES = (bool, int, float, str)


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None,
           aliases: Sequence[str] = (), flags: Sequence[str] = (), metavar: str | None = None,
           name: str | None = None) -> Any:
    """A dataclass field that is a user option.

    ``help`` is the flag's help; ``choices`` the values allowed (also checked by the class's
    ``__post_init__``); ``aliases`` older names, each both a flag and a keyword;
    ``flags`` short command-line spellings only (``-tp``); ``name`` the option's name where
    the field's own lacks context."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None,
            "aliases": tuple(aliases), "flags": tuple(flags), "metavar": metavar, "name": name}
    return dataclasses.field(default=default, metadata={"option": meta})


@dataclass(frozen=True)
class Option:
    """One user option, read from its dataclass field."""

    name: str
    owner: type
    field: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    aliases: tuple[str, ...]
    flags: tuple[str, ...]
    metavar: str | None

    @property
    def flag(self) -> str:
        """The option's command-line flag."""
        return "--" + self.name.replace("_", "-")

    @property
    def spellings(self) -> list[str]:
        """Every command-line spelling: the flag, the aliases' flags, the short flags."""
        return [self.flag, *("--" + a.replace("_", "-") for a in self.aliases), *self.flags]


def _value_type(cls: type, field: str, hint: Any) -> type:
    """The value type of a field typed ``X`` or ``X | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and len(args) == 1:
        hint = args[0]
    if hint not in _VALUE_TYPES:
        raise TypeError(f"option {cls.__name__}.{field} has type {hint!r}; an option is one "
                        f"of {[t.__name__ for t in _VALUE_TYPES]}, or None")
    return hint


def _groups(cls: type) -> Iterable[tuple[dataclasses.Field, Any]]:
    """``cls``'s fields with their resolved type hints."""
    hints = typing.get_type_hints(cls)
    return ((f, hints[f.name]) for f in dataclasses.fields(cls))


def options_of(cls: type) -> list[Option]:
    """The user options of dataclass ``cls`` and of the dataclasses it holds, in field order;
    TypeError where two options share a name."""
    found: list[Option] = []
    for f, hint in _groups(cls):
        if dataclasses.is_dataclass(hint):
            found += options_of(hint)
            continue
        meta = f.metadata.get("option")
        if meta is None:
            continue
        found.append(Option(
            name=meta["name"] or f.name, owner=cls, field=f.name,
            type=_value_type(cls, f.name, hint), default=f.default, help=meta["help"],
            choices=meta["choices"], aliases=meta["aliases"], flags=meta["flags"],
            metavar=meta["metavar"]))
    names = [n for o in found for n in (o.name, *o.aliases)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TypeError(f"options of {cls.__name__} share the names {twice}")
    return found


def add_arguments(group: argparse._ActionsContainer, options: Iterable[Option]) -> None:
    """One argument per option: its spellings, its help, its default, its type or choices; a
    bool option is ``--x/--no-x``."""
    for o in options:
        kwargs: dict[str, Any] = {"dest": o.name, "default": o.default, "help": o.help}
        if o.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = o.type
            if o.choices is not None:
                kwargs["choices"] = o.choices
        if o.metavar is not None:
            kwargs["metavar"] = o.metavar
        group.add_argument(*o.spellings, **kwargs)


def canonical_keywords(given: Mapping[str, Any], options: Iterable[Option],
                       where: str) -> dict[str, Any]:
    """``given`` keyword values by option name (aliases replaced); TypeError naming a keyword
    that is no option (with the closest names) or an option given twice, under ``where``."""
    by_name = {n: o.name for o in options for n in (o.name, *o.aliases)}
    out: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, value in given.items():
        name = by_name.get(key)
        if name is None:
            close = difflib.get_close_matches(key, list(by_name), n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise TypeError(f"{where} got an unexpected keyword argument {key!r}{hint}")
        if name in out:
            raise TypeError(f"{where} got {keys[name]!r} and {key!r}, two names of the option "
                            f"{name!r}")
        out[name], keys[name] = value, key
    return out


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """An instance of dataclass ``cls`` from option values by option name; an option not in
    ``values`` keeps its field's default. A class with a ``from_options`` classmethod is built
    by it, from its options' values by option name (where one option implies another)."""
    from_options = getattr(cls, "from_options", None)
    kwargs: dict[str, Any] = {}
    for f, hint in _groups(cls):
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = build(hint, values)
            continue
        meta = f.metadata.get("option")
        if meta is None:
            continue
        name = meta["name"] or f.name
        if name in values:
            kwargs[name if from_options is not None else f.name] = values[name]
    return from_options(**kwargs) if from_options is not None else cls(**kwargs)
