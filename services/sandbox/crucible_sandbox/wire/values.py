"""Values as data: encode a value made in one process into plain JSON, rebuild it in another.

Only values built from Python's own types travel as data: None, bool, int, float, complex, str,
bytes, bytearray, list, tuple, dict, set, frozenset, range, a few standard-library types whose
equality is well defined (Fraction, Decimal, deque, Counter, OrderedDict, defaultdict, namedtuples)
and the builtin functions and types by name (`int`, `len`). Types are checked exactly
(`type(x) is int`), so a subclass with its own `__eq__` or `__repr__` cannot pass for a plain value,
and encoding never runs code of the value's own.

Anything else is refused (`Unencodable`), or, where the caller passes `other`, stands in the tree
as whatever `other` returns: the program process gives such objects a reference
(`["ref", id, type name]`) that the judge turns into a proxy (see `inrun.link`). Decoding is total:
malformed input of any kind raises ValueError, never anything else.

>>> decode(encode([1, (2.5, "a"), {3: None}, range(3)]))
[1, (2.5, 'a'), {3: None}, range(0, 3)]
"""

from __future__ import annotations

import builtins
import collections
import decimal
import fractions
from collections.abc import Callable
from typing import Any

MAX_NODES = 200_000
MAX_DEPTH = 64


class Unencodable(Exception):
    """The value is not built only from types the other side can rebuild."""


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and cls.__eq__ is tuple.__eq__


def builtin_name(value: Any) -> str | None:
    """The name of a builtin function or type that `value` is, else None (never runs its code)."""
    try:
        name = value.__name__ if type(value) in (type, type(len)) else None
    except Exception:
        return None
    return name if type(name) is str and getattr(builtins, name, None) is value else None


def encode(value: Any, other: Callable[[Any], Any] | None = None) -> Any:
    """Return a JSON-able tagged tree for `value`; `Unencodable` for what `other` does not take."""
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
        if t is list:
            return ["list", [enc(v, depth + 1) for v in x]]
        if t is tuple or _is_namedtuple(t):
            return ["tuple", [enc(v, depth + 1) for v in x]]
        if t is dict or t is collections.defaultdict:
            return ["dict", [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
        if t is set or t is frozenset:
            return [t.__name__, [enc(v, depth + 1) for v in x]]
        if t is complex:
            return ["complex", x.real.hex(), x.imag.hex()]
        if t is bytes or t is bytearray:
            return [t.__name__, x.hex()]
        if t is collections.OrderedDict or t is collections.Counter:
            return [t.__name__, [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
        if t is collections.deque:
            return ["deque", [enc(v, depth + 1) for v in x]]
        if t is fractions.Fraction:
            return ["Fraction", hex(x.numerator), hex(x.denominator)]
        if t is decimal.Decimal:
            return ["Decimal", str(x)]
        if t is range:
            return ["range", hex(x.start), hex(x.stop), hex(x.step)]
        name = builtin_name(x)
        if name is not None:
            return ["builtin", name]
        if other is None:
            raise Unencodable(f"values of type {t.__qualname__} are not plain data")
        return other(x)

    return enc(value, 0)


_PAIRS = {"dict": dict, "OrderedDict": collections.OrderedDict, "Counter": collections.Counter}
_SEQS = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "deque": collections.deque,
}


def decode(tree: Any, ref: Callable[[Any, Any], Any] | None = None) -> Any:
    """Rebuild a value from `encode`'s output; `ref(id, type name)` rebuilds references.

    Raises ValueError, and only ValueError, on malformed input (unknown tags, zero denominators,
    unhashable set members, references where none are allowed, nesting past the limit...).
    """
    budget = [MAX_NODES]

    def dec(t: Any, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0 or depth > MAX_DEPTH:
            raise ValueError("value too large or nested too deeply")
        tag = t[0]
        if tag == "none":
            return None
        if tag == "bool":
            return bool(t[1])
        if tag == "int":
            return int(t[1], 16)
        if tag == "float":
            return float.fromhex(t[1])
        if tag == "str":
            if type(t[1]) is not str:
                raise ValueError("a str that is not one")
            return t[1]
        if tag in _SEQS:
            return _SEQS[tag](dec(v, depth + 1) for v in t[1])
        if tag in _PAIRS:
            return _PAIRS[tag](dict((dec(k, depth + 1), dec(v, depth + 1)) for k, v in t[1]))
        if tag == "complex":
            return complex(float.fromhex(t[1]), float.fromhex(t[2]))
        if tag == "bytes":
            return bytes.fromhex(t[1])
        if tag == "bytearray":
            return bytearray.fromhex(t[1])
        if tag == "Fraction":
            return fractions.Fraction(int(t[1], 16), int(t[2], 16))
        if tag == "Decimal":
            return decimal.Decimal(t[1])
        if tag == "range":
            return range(int(t[1], 16), int(t[2], 16), int(t[3], 16))
        if tag == "builtin":
            value = getattr(builtins, t[1])
            if builtin_name(value) != t[1]:
                raise ValueError(f"not a builtin: {t[1]!r}")
            return value
        if tag == "ref" and ref is not None:
            return ref(t[1], t[2])
        raise ValueError(f"unknown value tag {tag!r}")

    try:
        return dec(tree, 0)
    except ValueError:
        raise
    except Exception as e:  # whatever a forged tree makes the constructors above raise
        raise ValueError(f"malformed value: {type(e).__name__}: {e}"[:300]) from None


def short_repr(value: Any, limit: int = 300) -> str:
    """repr capped to `limit` characters (middle elided), never raising."""
    try:
        text = repr(value)
        if type(text) is not str:
            raise TypeError("__repr__ returned a non-string")
    except BaseException as e:  # a program's __repr__ may raise anything
        text = f"<unprintable {type(value).__qualname__}: {type(e).__name__}>"
    if len(text) > limit:
        half = limit // 2 - 2
        text = f"{text[:half]} ... {text[-half:]}"
    return text
