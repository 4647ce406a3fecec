"""Encode values produced inside the sandbox into plain JSON, and decode them outside it.

Only values built from Python's own types travel: None, bool, int, float, complex, str, bytes,
list, tuple, dict, set, frozenset, plus a few stdlib types whose equality is well defined
(Fraction, Decimal, deque, Counter, OrderedDict, defaultdict, namedtuples). Types are checked
exactly (`type(x) is int`), so a subclass with its own `__eq__` or `__repr__` cannot pass for a
plain value. The trusted side rebuilds the value and compares it with `==` itself.

>>> decode(encode([1, (2.5, "a"), {3: None}]))
[1, (2.5, 'a'), {3: None}]
"""

from __future__ import annotations

import collections
import decimal
import fractions
from typing import Any

MAX_NODES = 200_000
MAX_DEPTH = 64


class Unencodable(Exception):
    """The value is not built only from types the trusted side can rebuild."""


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and cls.__eq__ is tuple.__eq__


def encode(value: Any) -> Any:
    """Return a JSON-able tagged tree for `value`, or raise `Unencodable`."""
    budget = [MAX_NODES]

    def enc(x: Any, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise Unencodable("value too large")
        if depth > MAX_DEPTH:
            raise Unencodable("value nested too deeply")
        t = type(x)
        if x is None:
            return ["none"]
        if t is bool:
            return ["bool", x]
        if t is int:
            return ["int", hex(x)]
        if t is float:
            return ["float", x.hex()]
        if t is str:
            return ["str", x]
        if t is complex:
            return ["complex", x.real.hex(), x.imag.hex()]
        if t is bytes:
            return ["bytes", x.hex()]
        if t is list:
            return ["list", [enc(v, depth + 1) for v in x]]
        if t is tuple or _is_namedtuple(t):
            return ["tuple", [enc(v, depth + 1) for v in x]]
        if t is set or t is frozenset:
            return [t.__name__, [enc(v, depth + 1) for v in x]]
        if t is dict or t is collections.defaultdict:
            return ["dict", [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
        if t is collections.OrderedDict or t is collections.Counter:
            return [t.__name__, [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
        if t is collections.deque:
            return ["deque", [enc(v, depth + 1) for v in x]]
        if t is fractions.Fraction:
            return ["Fraction", hex(x.numerator), hex(x.denominator)]
        if t is decimal.Decimal:
            return ["Decimal", str(x)]
        raise Unencodable(f"values of type {t.__qualname__} are not compared outside the program")

    return enc(value, 0)


_PAIRS = {"dict": dict, "OrderedDict": collections.OrderedDict, "Counter": collections.Counter}
_SEQS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "deque": collections.deque}


def decode(tree: Any) -> Any:
    """Rebuild a value from `encode`'s output. Raises ValueError on malformed input."""
    try:
        tag = tree[0]
        if tag == "none":
            return None
        if tag == "bool":
            return bool(tree[1])
        if tag == "int":
            return int(tree[1], 16)
        if tag == "float":
            return float.fromhex(tree[1])
        if tag == "str":
            return str(tree[1])
        if tag == "complex":
            return complex(float.fromhex(tree[1]), float.fromhex(tree[2]))
        if tag == "bytes":
            return bytes.fromhex(tree[1])
        if tag in _SEQS:
            return _SEQS[tag](decode(v) for v in tree[1])
        if tag in _PAIRS:
            return _PAIRS[tag](dict((decode(k), decode(v)) for k, v in tree[1]))
        if tag == "Fraction":
            return fractions.Fraction(int(tree[1], 16), int(tree[2], 16))
        if tag == "Decimal":
            return decimal.Decimal(tree[1])
    except (TypeError, IndexError, KeyError, AttributeError, decimal.InvalidOperation) as e:
        raise ValueError(f"malformed value: {e}") from None
    raise ValueError(f"unknown value tag {tag!r}")


def short_repr(value: Any, limit: int = 300) -> str:
    """repr capped to `limit` characters (middle elided), never raising."""
    try:
        text = repr(value)
    except BaseException as e:  # a candidate's __repr__ may raise anything
        text = f"<unprintable {type(value).__qualname__}: {type(e).__name__}>"
    if len(text) > limit:
        half = limit // 2 - 2
        text = f"{text[:half]} ... {text[-half:]}"
    return text
