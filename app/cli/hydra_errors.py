"""Hydra's composition errors as the app's one sentence: an unknown option lists the real options (not
the schemas stored beside them), and an unknown key names the closest one instead of Hydra's hint
to add it with ``+``, which the app then refuses. Torch-free."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from hydra.errors import ConfigCompositionException, MissingConfigException

SCHEMA_SUFFIX = "_schema"


def closest_key(key: str, schema: Any) -> str | None:
    """The field of the dataclass ``schema`` (a class or an instance) nearest to the last part of the
    dotted ``key``, as a full dotted key: ``trainer.batchsize`` -> ``trainer.batch_size``."""
    if not dataclasses.is_dataclass(schema):
        return None
    prefix, _, name = key.rpartition(".")
    fields = [f.name for f in dataclasses.fields(schema)]
    match = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return f"{prefix}.{match[0]}" if prefix and match else match[0] if match else None


def unknown_key_sentence(key: str, schema: Any, added: bool = False) -> str:
    """``unknown configuration key K; did you mean C?`` (``added``: it came with Hydra's ``+``)."""
    near = closest_key(key, schema)
    how = f" (added with +{key}=...)" if added else ""
    hint = f"did you mean {near}? " if near else ""
    return f"unknown configuration key {key}{how}; {hint}python -m app --cfg job lists the keys."


def composition_sentence(err: ConfigCompositionException) -> str:
    """One sentence for what Hydra refused while composing the config."""
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        options = [o for o in (err.options or []) if not o.endswith(SCHEMA_SUFFIX)]
        if options:
            return f"{group}={option} is not an option of {group}; choose one of {', '.join(options)}."
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    if str(err).startswith("Could not override") and full_key and type(cause).__name__ in (
            "ConfigAttributeError", "ConfigKeyError"):
        return unknown_key_sentence(str(full_key), getattr(cause, "object_type", None))
    first = str(err).strip().splitlines()[0].rstrip(".")
    detail = str(cause).strip().splitlines()[0].rstrip(".") if cause is not None and str(cause).strip() else ""
    return f"{first}: {detail}." if detail else f"{first}."
