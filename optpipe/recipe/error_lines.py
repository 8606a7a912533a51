"""One line per recipe mistake: the YAML path, what was expected, and the nearest valid key."""
from __future__ import annotations

import difflib
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from optpipe.recipe.model_specs import MODEL_KINDS


def describe_validation_error(exc: ValidationError, schema: type[BaseModel], data: Any, prefix: str = "") -> str:
    """The first pydantic error as one sentence: path, what was wrong, and a suggestion."""
    err = _most_specific(exc.errors())
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    where = ".".join(([prefix] if prefix else []) + loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(schema, err["loc"][:-1], data)
        hint = _suggest(loc[-1], allowed)
        known = f"; valid keys here: {', '.join(sorted(allowed))}" if allowed else ""
        return f"{where}: unknown key{hint}{known}"
    if err["type"] == "missing":
        return f"{where}: required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a check across sections: its message names the keys, and the input is the whole recipe
        return f"{prefix}: {msg}" if prefix else msg
    return f"{where}: {msg} (got {_short(err.get('input'))})"


def suggest(word: str, choices) -> str:
    return _suggest(word, choices)


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _most_specific(errors: list[dict]) -> dict:
    # Prefer unknown keys and missing keys: they are the usual typo, and the clearest fix.
    for kind in ("extra_forbidden", "missing"):
        for err in errors:
            if err["type"] == kind:
                return err
    return errors[0]


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and (part in MODEL_KINDS or _is_angle_tag(part) or part.startswith("function-"))


def _is_angle_tag(part: str) -> bool:
    # A discriminated union's tag written `<like-this>` (optpipe.recipe.search_spec), not a key of the YAML.
    return part.startswith("<") and part.endswith(">")


def _allowed_keys(schema: type[BaseModel], loc: tuple, data: Any = None) -> set[str]:
    """The field names valid at `loc`, walking the schema: model fields, then list/dict items."""
    current: Any = schema
    for part in loc:
        if part in MODEL_KINDS:
            current = MODEL_KINDS[part]
        elif get_origin(current) in (list, dict):
            current = _unwrap_optional(get_args(current)[-1])
        elif isinstance(current, type) and issubclass(current, BaseModel):
            field = next((f for n, f in current.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return set()
            current = _unwrap_optional(field.annotation)
        else:
            return set()
    if isinstance(current, type) and issubclass(current, BaseModel):
        return {f.alias or n for n, f in current.model_fields.items() if n != "base_dir"}
    return set()


def _unwrap_optional(annotation):
    if get_origin(annotation) is Union:
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
