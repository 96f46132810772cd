"""Hydra overrides on the raw command line (``key=value``, ``+key=value``, ``~key``), read and written
before Hydra parses them: the resume and torchrun rewrites, the run-folder claim and the sweeps."""

from __future__ import annotations

import re

_PLAIN = re.compile(r"[\w./:@+\-]+")


def override_key(arg: str) -> str:
    """The key an override sets (``+a.b=1`` -> ``a.b``)."""
    return arg.split("=", 1)[0].lstrip("+~")


def unquote(value: str) -> str:
    """A value as Hydra reads it when it is one quoted string (``'it\\'s'`` -> ``it's``)."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].replace("\\" + value[0], value[0]).replace("\\\\", "\\")
    return value


def quote(value: str, always: bool = False) -> str:
    """A Hydra override value that keeps any character of a path: quoted unless it is plain (or
    ``always``)."""
    if not always and _PLAIN.fullmatch(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
