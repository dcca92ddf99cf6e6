"""Method specs: the one place a spec becomes a policy.

``get_method(spec, budget=... | ratio=..., **options)`` builds a policy from a spec and keyword options;
``available_methods()`` lists the method names (presets). A spec is a method name or a part, then ``+``
and more parts, each with options:

    snapkv                                   a preset (presets.py)
    snapkv:window=16:ratio=0.25              a preset's options go to the parts that have them
    kvzip+adaptive:alpha=0.3+kivi:bits=4     parts replace the preset's of their role (parts.py)
    snapkv:ratio=0.5+quest:read_ratio=0.1    an eviction, and a read rule with its own size

Part names: ``PARTS`` (filled by the package, like ``PRESETS``, with every part in the order
``available_parts`` lists them). This module imports no part, so that it stays the parser.
"""

from __future__ import annotations

import ast
import re
import shlex
import typing
from dataclasses import dataclass, fields, replace

from .policy import PRESETS, Policy, no_size_reason

REGISTRY = PRESETS  # method name -> Preset
PARTS: dict[str, type] = {}  # part name -> part class; kvcompress.methods fills it
SIZE = ("budget", "ratio")


def available_methods() -> list[str]:
    """Every method name (preset)."""
    return list(PRESETS)


def available_parts() -> list[str]:
    """Every part name, by role."""
    return list(PARTS)


def get_method(spec: str, **options) -> Policy:
    """Build a policy from its spec and keyword options: ``get_method("snapkv", budget=128, window=32)``,
    ``get_method("kvzip+adaptive", ratio=0.25)``. Keyword options go where the spec's first element's go; a
    spec and a keyword may not both set one option (or both give a size)."""
    return MethodSpec.parse(spec).build(**options)


@dataclass(frozen=True)
class Element:
    """One ``name:option=value:...`` of a spec."""

    name: str
    options: dict


@dataclass(frozen=True)
class MethodSpec:
    """A spec read once: its elements (a preset or a part, then parts), each with its options.

    Grammar: ``element(+part)*``, ``element = name[:option=value]...``. Values are Python literals (numbers,
    True, None, 'text', (1, 2)); ``inf`` is float("inf"); anything else is kept as text. A value holding
    colons or pluses goes in quotes: ``retention:checkpoint="runs/gates:v2"``. This is the only place a spec
    becomes a policy: ``get_method``, ``generate``, ``kvc.LLM``, the command line, eval grids and the server
    all come here."""

    elements: tuple[Element, ...]
    text: str = ""

    @property
    def name(self) -> str:
        return self.elements[0].name

    @property
    def options(self) -> dict:
        return self.elements[0].options

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a method spec is a method's name, optionally with options (snapkv:window=16) and parts "
                             f"(kvzip+adaptive), got {text!r}; available methods: {', '.join(available_methods())}")
        elements = []
        for i, piece in enumerate(_split_parts(text)):
            name, *parts = _split_spec(piece)
            key = name.strip().lower()
            if key not in (PRESETS if i == 0 else {}) and key not in PARTS:
                where = f" in the spec {text!r}" if len(text.strip()) > len(name.strip()) else ""
                known = (f"available methods: {', '.join(available_methods())}; parts: " if i == 0 else "parts: ")
                raise ValueError(f"unknown {'method' if i == 0 else 'part'} {name.strip()!r}{where}; {known}"
                                 f"{', '.join(available_parts())}")
            elements.append(Element(key, _options(parts, text)))
        return cls(tuple(elements), text.strip())

    @property
    def sized(self) -> bool:
        """Whether the spec gives its own size (``snapkv:budget=16``)."""
        return any(name in element.options for element in self.elements for name in SIZE)

    @property
    def takes_size(self) -> bool:
        """Whether the policy is sized by a budget or ratio (``full``, GVote and codecs size themselves)."""
        return not no_size_reason(self._parts({})[0])

    def build(self, **options) -> Policy:
        """The policy, with ``options`` added to the first element's (a ``budget``/``ratio`` of None counts as not
        given); every option checked against its part's declared type."""
        options = {k: v for k, v in options.items() if not (k in SIZE and v is None)}
        if self.sized and any(k in options for k in SIZE):
            raise ValueError(f"{self.text!r} gives its own size and budget=/ratio= (or --budget/--ratio) gives another: "
                             "give the size once")
        twice = sorted(set(self.options) & set(options))
        if twice:
            raise ValueError(f"{self.text!r} sets {', '.join(twice)} and so does a keyword option: set each option once")
        parts, preset, size = self._parts(options)
        return Policy(**parts, **size, preset=preset)

    def _parts(self, keywords: dict) -> tuple[dict, str | None, dict]:
        """(the parts by role, the preset's name or None, the size given) with ``keywords`` on the first element."""
        first, *rest = self.elements
        size: dict = {}
        options = _take_size({**first.options, **keywords}, size, self.text)
        if first.name in PRESETS:
            parts, preset = PRESETS[first.name].parts(), first.name
            parts = _route(first.name, parts, options)
        else:
            parts, preset = {}, None
            rest = [Element(first.name, options), *rest]
        for element in rest:
            part = _part(element.name, _take_size(dict(element.options), size, self.text))
            parts[part.role] = part
        return parts, preset, size


def _split_parts(text: str) -> list[str]:
    """Split a spec at the ``+`` before each part's name (outside quotes and brackets)."""
    def before_a_name(i: int) -> bool:
        return text[i] == "+" and i > 0 and re.match(r"\s*[A-Za-z_]", text[i + 1 :]) is not None

    return [piece.strip() for piece in _split_outside(text, before_a_name)]


def _split_outside(text: str, splits_at) -> list[str]:
    """``text`` cut at every index i outside quotes and brackets where ``splits_at(i)`` holds."""
    pieces, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and splits_at(i):
            pieces.append(text[start:i])
            start = i + 1
    return [*pieces, text[start:]]


def _options(parts: list[str], text: str) -> dict:
    options: dict = {}
    for part in parts:
        option, sep, value = part.partition("=")
        if not sep or not option.strip():
            raise ValueError(f"bad option {part!r} in the spec {text!r}: write name:option=value, e.g. keepkv:key_rule=votes")
        if option.strip() in options:
            raise ValueError(f"the spec {text!r} sets {option.strip()} twice: set it once")
        options[option.strip()] = _literal(value.strip())
    return options


def _take_size(options: dict, size: dict, text: str) -> dict:
    """``options`` without budget/ratio, which go to ``size`` (given once in the spec)."""
    for name in SIZE:
        if name in options:
            if size:
                raise ValueError(f"{text!r} gives the policy's size twice: give one budget= or ratio=")
            size[name] = options.pop(name)
    return options


def _route(method: str, parts: dict, options: dict) -> dict:
    """A preset's ``options`` given to every part of it that has them (typed), the parts rebuilt."""
    owners = {name: [role for role, part in parts.items() if name in {f.name for f in fields(part)}] for name in options}
    unknown = sorted(name for name, roles in owners.items() if not roles)
    if unknown:
        known = PRESETS[method].options()
        raise ValueError(f"{method} has no option {', '.join(unknown)}; its options are: {', '.join(known)}")
    out = dict(parts)
    for role, part in parts.items():
        mine = {name: value for name, value in options.items() if role in owners[name]}
        if mine:
            hints = typing.get_type_hints(type(part))
            out[role] = replace(part, **{name: _typed(method, name, value, hints[name]) for name, value in mine.items()})
    return out


def _part(name: str, options: dict):
    """The part named ``name`` with ``options`` (typed)."""
    cls = PARTS[name]
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"the {name} part has no option {', '.join(unknown)}; its options are: {', '.join(known) or 'none'}")
    hints = typing.get_type_hints(cls)
    return cls(**{option: _typed(name, option, value, hints[option]) for option, value in options.items()})


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
    ``snapkv,deltakv:full_layers=(1,2),retention:checkpoint="a,b"+kivi`` is three specs."""
    specs = _split_outside(text, lambda i: text[i] == ",")
    return [spec.strip() for spec in specs if spec.strip()]


def _split_spec(spec: str) -> list[str]:
    """Split at colons outside quotes: ``retention:checkpoint="runs/gates:v2"`` keeps its path whole."""
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


__all__ = ["PARTS", "REGISTRY", "Element", "MethodSpec", "available_methods", "available_parts", "get_method", "split_method_list"]
