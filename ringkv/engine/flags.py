"""Settings written once: each field of a config dataclass carries its default, its ``--help``
text and its command line form (``knob``), and from the fields come the flags
(``add_arguments``) and the config of a parsed command line (``from_args``). ``EngineConfig``
(``ringkv generate`` / ``ringkv serve``) and ``serve.ServeConfig`` are written this way.

A field's flag is ``--`` and its name with dashes unless ``flag`` names another; ``cli=False``:
a Python-only setting (no flag). The flag's value type comes from the field's annotation
(``Optional[X]``: ``X``; ``int`` and ``float`` are parsed, anything else is a string; with
``nargs``, the element type of a sequence); a bool field is a switch (``store_true``, or
``store_false`` for one that defaults to True), unless it has ``choices`` (``compile_decode``:
``auto``, ``true``, ``false``; the flag alone is ``true``). ``unit``: the flag is a float count
of this many of the field's units (``GIB``: a flag in GiB for a field in bytes), converted once,
in ``from_args``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Callable, Optional, Sequence

GIB = 1 << 30  # a ``unit``: a size flag in GiB for a field in bytes


def knob(
    default,
    help: Optional[str],
    *,
    flag: Optional[str] = None,
    cli: bool = True,
    choices: Optional[Sequence[str]] = None,
    metavar: Optional[str] = None,
    nargs: Optional[str] = None,
    unit: Optional[int] = None,
    **extra,
):
    """A config field: its ``default``, its ``--help`` text and its command line form (see the
    module docstring); ``extra``: more metadata for the config's own use."""
    meta = dict(
        help=help,
        flag=flag,
        cli=cli,
        choices=choices,
        metavar=metavar,
        nargs=nargs,
        unit=unit,
        **extra,
    )
    return dataclasses.field(default=default, metadata=meta)


def flag(f: dataclasses.Field) -> str:
    """The command line flag of field ``f``."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def has_flag(f: dataclasses.Field) -> bool:
    """Whether field ``f`` is a command line flag (not a Python-only setting)."""
    return f.metadata.get("cli", False)


def _value_type(f: dataclasses.Field, hint) -> Optional[type]:
    """What argparse parses the flag's value(s) as: ``float`` for a ``unit`` flag, else the
    annotation's ``int`` or ``float`` (``Optional`` and, with ``nargs``, a sequence unwrapped);
    None for a string."""
    if f.metadata["unit"] is not None:
        return float
    kind = (typing.get_args(hint) or (hint,))[0]  # Optional[X]: X
    if f.metadata["nargs"]:
        kind = (typing.get_args(kind) or (kind,))[0]  # Sequence[X]: X
    return kind if kind in (int, float) else None


def add_arguments(
    cls, parser: argparse.ArgumentParser, keep: Callable[[dataclasses.Field], bool] = bool
) -> None:
    """Add the flags of ``cls``'s fields (those ``keep`` keeps) to ``parser``, in field order;
    each one's ``dest`` is its field's name and its default the field's."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not has_flag(f) or not keep(f):
            continue
        kw = dict(dest=f.name, default=f.default, help=f.metadata["help"])
        if isinstance(f.default, bool) and not f.metadata["choices"]:  # a switch
            kw["action"] = "store_false" if f.default else "store_true"
        else:
            kw["metavar"] = f.metadata["metavar"] or flag(f)[2:].upper().replace("-", "_")
            kind = _value_type(f, hints[f.name])
            if kind is not None:
                kw["type"] = kind
            if f.metadata["nargs"]:
                kw["nargs"] = f.metadata["nargs"]
            if f.metadata.get("const") is not None:  # nargs="?": the flag without a value
                kw["const"] = f.metadata["const"]
            if f.metadata["choices"]:
                kw["choices"] = list(f.metadata["choices"])
                del kw["metavar"]  # argparse shows the choices
        parser.add_argument(flag(f), **kw)


def values(cls, args: argparse.Namespace) -> dict:
    """The field values a parsed command line gives (the fields it has a flag for), each
    ``unit`` flag converted to the field's unit."""
    out = {}
    for f in dataclasses.fields(cls):
        if not has_flag(f) or not hasattr(args, f.name):
            continue
        v, unit = getattr(args, f.name), f.metadata["unit"]
        out[f.name] = v if unit is None or v is None else int(v * unit)
    return out


def from_args(cls, args: argparse.Namespace, **overrides):
    """The ``cls`` of a parsed command line (``values``; fields without a flag keep their
    defaults), with ``overrides`` applied."""
    return cls(**{**values(cls, args), **overrides})
