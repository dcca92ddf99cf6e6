"""Method specs and the registry they name: the one place a spec becomes a method.

``get_method(spec, budget=... | ratio=..., **options)`` builds a configured method from a name or a
spec with options (``"keepkv:key_rule=votes:refresh_every=16"``, read by ``MethodSpec``);
``available_methods()`` lists the names. This module imports no method, so methods that hold other
methods by spec (``codec=``, Quest's ``compress_with=``, GVote's ``select_with=``) import it without an
import circle; ``REGISTRY`` is filled by the package (``kvcompress.methods``), which Python runs
before any of its modules, with every method in the order ``available_methods`` lists them.
"""

from __future__ import annotations

import ast
import shlex
import typing
from dataclasses import dataclass, fields

REGISTRY: dict[str, type] = {}  # name -> method class; kvcompress.methods fills it


def available_methods() -> list[str]:
    """Registry names of every implemented method."""
    return list(REGISTRY)


def get_method(spec: str, **options):
    """Build a method from its spec and keyword options: ``get_method("snapkv", budget=128, window=32)``,
    ``get_method("snapkv:window=16", ratio=0.25)``. The spec grammar is ``MethodSpec``'s; a spec and a
    keyword may not both set one option (or both give a size)."""
    return MethodSpec.parse(spec).build(**options)


@dataclass(frozen=True)
class MethodSpec:
    """A method's spec read once: its registry ``name`` and the ``options`` written after it.

    Grammar: ``name[:option=value]...``. Values are Python literals (numbers, True, None, 'text',
    (1, 2)); ``inf`` is float("inf"); anything else is kept as text. A value holding colons (another
    method's spec) goes in quotes: ``quest:compress_with="snapkv:ratio=0.5"``. This is the only place a
    spec becomes a method: ``get_method``, ``generate``, ``kvc.LLM``, the command line, eval grids and the
    server all come here."""

    name: str
    options: dict
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a method spec is a method's name, optionally with options (snapkv:window=16), got {text!r}; "
                             f"available methods: {', '.join(available_methods())}")
        name, *parts = _split_spec(text)
        key = name.strip().lower()
        if key not in REGISTRY:
            where = f" in the spec {text!r}" if parts else ""
            raise ValueError(f"unknown method {name.strip()!r}{where}; available methods: {', '.join(available_methods())}")
        options = {}
        for part in parts:
            option, sep, value = part.partition("=")
            if not sep or not option.strip():
                raise ValueError(f"bad option {part!r} in the spec {text!r}: write name:option=value, e.g. keepkv:key_rule=votes")
            if option.strip() in options:
                raise ValueError(f"the spec {text!r} sets {option.strip()} twice: set it once")
            options[option.strip()] = _literal(value.strip())
        return cls(key, options, text.strip())

    @property
    def sized(self) -> bool:
        """Whether the spec gives its own size (``snapkv:budget=16``)."""
        return "budget" in self.options or "ratio" in self.options

    @property
    def takes_size(self) -> bool:
        """Whether the method is sized by a budget or ratio (``full``, GVote and coders size themselves)."""
        return REGISTRY[self.name].needs_budget

    def build(self, **options):
        """The method, with ``options`` added to the spec's (a ``budget``/``ratio`` of None counts as not given);
        every option checked against its declared type."""
        options = {k: v for k, v in options.items() if not (k in ("budget", "ratio") and v is None)}
        if self.sized and ("budget" in options or "ratio" in options):
            raise ValueError(f"{self.text!r} gives its own size and budget=/ratio= (or --budget/--ratio) gives another: "
                             "give the size once")
        twice = sorted(set(self.options) & set(options))
        if twice:
            raise ValueError(f"{self.text!r} sets {', '.join(twice)} and so does a keyword option: set each option once")
        options = {**self.options, **options}
        cls = REGISTRY[self.name]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{self.name} has no option {', '.join(unknown)}; its options are: {', '.join(sorted(known))}")
        hints = typing.get_type_hints(cls)
        return cls(**{name: _typed(self.name, name, value, hints[name]) for name, value in options.items()})


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


__all__ = ["REGISTRY", "MethodSpec", "available_methods", "get_method", "split_method_list"]
