"""The method registry: one file per method, one name per method.

``get_method(name, budget=... | ratio=..., **options)`` builds a configured method;
``available_methods()`` lists the names. ``parse_method_spec("keepkv:key_rule=votes:refresh_every=16")``
reads the command line's form of a method with options.
"""

from __future__ import annotations

import ast
import shlex
import typing
from dataclasses import fields

from .adakv import AdaKV
from .base import Method, Needs, ScoreMethod
from .cam import CaM
from .d2o import D2O
from .deltakv import DeltaKV
from .full import Full
from .gvote import GVote
from .h2o import H2O
from .keepkv import KeepKV
from .kivi import KIVI
from .momentkv import MomentKV
from .omnikv import OmniKV
from .pyramidkv import PyramidKV
from .quest import Quest
from .retention import Retention
from .snapkv import SnapKV
from .streamingllm import StreamingLLM

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls for cls in (Full, StreamingLLM, H2O, SnapKV, PyramidKV, AdaKV, MomentKV, GVote, KeepKV, CaM, D2O, OmniKV, Quest, KIVI, DeltaKV, Retention)
}


def available_methods() -> list[str]:
    """Registry names of every implemented method."""
    return list(REGISTRY)


def get_method(name: str, **options) -> Method:
    """Build a method by registry name, e.g. ``get_method("snapkv", budget=128, window=32)``."""
    key = name.strip().lower()
    if key not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    cls = REGISTRY[key]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{key} has no option {', '.join(unknown)}; its options are: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _typed(key, name, value, hints[name]) for name, value in options.items()})


def _typed(method: str, name: str, value, hint):
    """``value`` checked against the option's declared type (a list becomes a tuple, a whole number a float
    where a float is asked for); a clear error naming the option, the value and the type otherwise."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    elif value is None:
        raise ValueError(f"{method}: option {name} cannot be None")
    if hint is bool:
        ok, expected = isinstance(value, bool), "True or False"
    elif hint is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    elif hint is float:
        ok, expected = isinstance(value, int | float) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif hint is str:
        ok, expected = isinstance(value, str), "text (a name in quotes from Python)"
    elif typing.get_origin(hint) is tuple:
        ok = isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        expected, value = "a tuple of whole numbers such as (2, 8, 17)", tuple(value) if ok else value
    else:
        return value
    if not ok:
        raise ValueError(f"{method}: option {name}={value!r} must be {expected}")
    return value


def parse_method_spec(spec: str) -> tuple[str, dict]:
    """``"name:option=value:..."`` → (name, options). Values are Python literals (numbers, True,
    None, 'text'); ``inf`` is float("inf"); anything else is kept as a string. A value holding
    colons (another method's spec) goes in quotes: ``quest:compress_with="snapkv:ratio=0.5"``."""
    name, *parts = _split_spec(spec)
    options = {}
    for part in parts:
        key, sep, text = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad method option {part!r} in {spec!r}: write name:option=value, e.g. keepkv:key_rule=votes")
        options[key.strip()] = _literal(text.strip())
    if name.strip().lower() not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    return name.strip().lower(), options


def split_method_list(text: str) -> list[str]:
    """Split a comma-separated list of method specs at the commas outside quotes and brackets:
    ``snapkv,deltakv:full_layers=(1,2),quest:compress_with="snapkv:ratio=0.5"`` is three specs."""
    specs, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            specs.append(text[start:i])
            start = i + 1
    specs.append(text[start:])
    return [spec.strip() for spec in specs if spec.strip()]


def _split_spec(spec: str) -> list[str]:
    """Split at colons outside quotes: ``quest:compress_with="snapkv:ratio=0.5"`` nests one spec in another."""
    lexer = shlex.shlex(spec.strip(), posix=True)
    lexer.whitespace, lexer.whitespace_split, lexer.commenters = ":", True, ""
    try:
        return list(lexer)
    except ValueError as error:
        raise ValueError(f"bad method spec {spec!r}: {error} (close every quote)") from None


def _literal(text: str):
    if text.lower() in ("inf", "+inf", "-inf"):
        return float(text)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def method_from_spec(spec: str, **size) -> Method:
    """A method from its command-line form plus a size (``budget=`` or ``ratio=``)."""
    name, options = parse_method_spec(spec)
    return get_method(name, **size, **options)


__all__ = ["REGISTRY", "Method", "Needs", "ScoreMethod", "available_methods", "get_method", "method_from_spec", "parse_method_spec"]
