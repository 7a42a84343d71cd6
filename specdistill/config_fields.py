"""Config fields that carry their own meaning and allowed values, and the one walker that checks them.

`specdistill/config.py` declares every setting with `setting(default, help, choices=..., ge=...)`; `check_fields`
reads those declarations off a dataclass tree, so a setting's allowed values live beside it and nowhere else.
"""

from __future__ import annotations

import typing
from dataclasses import field, fields, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


def setting(default: Any, help: str = "", *, choices=None, ge=None, gt=None, le=None, lt=None,
            nonempty: bool | str = False) -> Any:
    """A dataclass field with its meaning (`help`) and allowed values beside it, which `check_fields` checks:
    `choices` and the bounds `ge`/`gt`/`le`/`lt` (for a list: each item), `nonempty` for a list (a string: a hint
    the message adds). A null passes wherever the annotation allows one. Choice fields are typed `str`:
    OmegaConf 2.3 refuses `typing.Literal` annotations in structured configs."""
    meta = {"help": help, "choices": None if choices is None else tuple(choices), "ge": ge, "gt": gt, "le": le,
            "lt": lt, "nonempty": nonempty}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"config field `{field_name}`: {message}")


def check_fields(node, prefix: str = "") -> None:
    """Walk a config dataclass tree and check each field against the allowed values its `setting` declares."""
    hints = typing.get_type_hints(type(node))
    for f in fields(node):
        name, value = prefix + f.name, getattr(node, f.name)
        if is_dataclass(value):
            check_fields(value, name + ".")
            continue
        nullable = type(None) in typing.get_args(hints[f.name])
        if value is None and nullable:
            continue
        meta = f.metadata
        if meta.get("nonempty") and not value:
            hint = meta["nonempty"]
            check(False, name, "is empty" + (f"; {hint}" if isinstance(hint, str) else ""))
        for item in value if isinstance(value, list) else [value]:
            if meta.get("choices") is not None:
                check(item in meta["choices"], name, f"got {item!r}, expected one of {list(meta['choices'])}")
            _check_bounds(item, meta, name, nullable)


def _check_bounds(value, meta, name: str, nullable: bool) -> None:
    """`value` within the field's `ge`/`gt`/`le`/`lt`; the message gives the value found and the interval."""
    ge, gt, le, lt = (meta.get(key) for key in ("ge", "gt", "le", "lt"))
    if ge is None and gt is None and le is None and lt is None:
        return
    low, high = (ge if gt is None else gt), (le if lt is None else lt)
    fits = value is not None and (ge is None or value >= ge) and (gt is None or value > gt)
    fits = fits and (le is None or value <= le) and (lt is None or value < lt)
    if low is None:
        expected = f"{'<=' if lt is None else '<'} {high}"
    elif high is None:
        expected = f"{'>=' if gt is None else '>'} {low}"
    else:
        expected = f"in {'[' if gt is None else '('}{low}, {high}{']' if lt is None else ')'}"
    check(fits, name, f"got {value!r}, expected {'null or ' if nullable else ''}a number {expected}")
