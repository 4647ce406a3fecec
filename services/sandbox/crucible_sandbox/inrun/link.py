"""The link between a run's judge and its program: the judge asks, the program computes.

The judge runs the test code and never holds an object of the program. When the tests use a name
the program defines, the judge asks the program's process for it over a Unix socket; what comes
back is plain data (see `wire.values`), or a *reference* to an object that stays in the program's
process and that the judge sees as a `ProgramObject`. Calling a `ProgramObject`, reading its
attributes, iterating it, taking its length, item, `str`, `int` or `float`: each is one request,
run in the program's process, whose answer is again data or a reference. Comparing it, taking its
truth value or testing membership in it is refused (`NotJudged`): those are the judgement, and
deciding them with the program's own `__eq__` or `__bool__` would let the program decide.

Requests (judge -> program), JSON frames:

    {"seq": n, "op": "global", "name": "f"}                     a global of the program
    {"seq": n, "op": "call", "ref": r, "args": [...], "kwargs": {...}, "budget": s}
    {"seq": n, "op": "getattr" | "setattr" | "iter" | "len" | "getitem" | "str" | "repr"
               | "int" | "float" | "index", "ref": r, ...}
    {"op": "end"}

Answers (program -> judge): `{"seq": n, "ok": <value>}` (with `"back"`: the new contents of list,
dict, set or bytearray arguments the call changed), `{"seq": n, "raise": {exception}}`,
`{"seq": n, "timeout": true}`, `{"seq": n, "missing": true}`, `{"seq": n, "module": name}`.
Before any request the program says `{"t": "loaded", "names": [...]}` or `{"t": "crash"}`.

The program's process is untrusted: whatever it writes on the socket is decoded as data, and
anything malformed ends the link (the current test errs, later ones do not run).
"""

from __future__ import annotations

import builtins
import importlib
import operator
import types
from collections import deque
from collections.abc import Callable
from typing import Any

from crucible_sandbox.inrun import runtime
from crucible_sandbox.inrun.runtime import TestTimeout
from crucible_sandbox.wire.channel import read_frame, write_frame
from crucible_sandbox.wire.values import Unencodable, decode, encode

LINK_FRAME = 64 << 20  # the largest answer the judge reads
MAX_NAMES = 10_000


class NotJudged(BaseException):
    """A test needed something that cannot be decided outside the program."""


class ProgramLost(BaseException):
    """The program's process ended, stopped answering, or wrote something that is not an answer."""


# -- the program's side ------------------------------------------------------------------------


class ProgramServer:
    """Answers the judge's requests in the program's process (which runs the candidate's code)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self.objects: dict[int, Any] = {}  # referenced objects, kept alive by id

    def _ref(self, value: Any) -> list[Any]:
        self.objects[id(value)] = value
        return ["ref", id(value), runtime.text(type(value).__qualname__, 100)]

    def _object(self, ref: Any, type_name: Any = None) -> Any:
        try:
            return self.objects[ref]
        except (KeyError, TypeError):
            raise ReferenceError(f"no object {ref!r} in the program") from None

    def encode(self, value: Any) -> Any:
        return encode(value, other=self._ref)

    def decode(self, tree: Any) -> Any:
        return decode(tree, ref=self._object)

    def hello(self) -> dict[str, Any]:
        names = [
            n for n in self.namespace if type(n) is str and not (n.startswith("__") and n.endswith("__"))
        ]
        return {"t": "loaded", "names": names[:MAX_NAMES]}

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run one request under the test's remaining time; never raises."""
        seq = request.get("seq")
        try:
            try:
                runtime.arm(float(request.get("budget") or 0))
                try:
                    reply = self._do(request)
                except TestTimeout:
                    raise
                except BaseException as exc:  # the program raised: described under the same timer
                    reply = {"raise": runtime.exception_info(exc)}
            finally:
                runtime.disarm()
        except TestTimeout:  # also one that fired late, while the answer was being made
            reply = {"timeout": True}
        reply["seq"] = seq
        return reply

    def _do(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "global":
            name = request.get("name")
            if type(name) is not str or name not in self.namespace:
                return {"missing": True}
            value = self.namespace[name]
            if type(value) is types.ModuleType and type(value.__name__) is str:
                return {"module": value.__name__}
            return {"ok": self.encode(value)}
        target = self._object(request.get("ref"))
        if op == "call":
            args = [self.decode(a) for a in request.get("args", [])]
            kwargs = {str(k): self.decode(v) for k, v in request.get("kwargs", {}).items()}
            result = target(*args, **kwargs)
            reply: dict[str, Any] = {"ok": self.encode(result)}
            back = self._changed(request, args, kwargs)
            if back:
                reply["back"] = back
            return reply
        if op == "setattr":
            setattr(target, str(request.get("name")), self.decode(request.get("value")))
            return {"ok": ["none"]}
        if op == "getattr":
            return {"ok": self.encode(getattr(target, str(request.get("name"))))}
        if op == "getitem":
            return {"ok": self.encode(target[self.decode(request.get("key"))])}
        unary: dict[str, Callable[[Any], Any]] = {
            "iter": list,
            "len": len,
            "str": str,
            "repr": repr,
            "int": int,
            "float": float,
            "index": operator.index,
        }
        if op in unary:
            return {"ok": self.encode(unary[op](target))}
        raise ValueError(f"unknown request {op!r}")

    def _changed(self, request: dict[str, Any], args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments a call changed in place, re-encoded (the judge updates its own copies)."""
        sent: dict[Any, Any] = dict(enumerate(request.get("args", [])))
        sent.update(request.get("kwargs", {}))
        back = {}
        for key, value in [*enumerate(args), *kwargs.items()]:
            if type(value) in (list, dict, set, bytearray, deque):
                try:
                    now = self.encode(value)
                except Unencodable:
                    continue
                if now != sent.get(key):
                    back[str(key)] = now
        return back


# -- the judge's side --------------------------------------------------------------------------


def _refuse(what: str):
    def refused(self: ProgramObject, *args: Any) -> Any:
        if what == "==" and args and args[0] is self:
            return True
        if what == "!=" and args and args[0] is self:
            return False
        raise NotJudged(
            f"a {self._type} of the program is not plain data: `{what}` on it is not judged outside the program"
        )

    return refused


class ProgramObject:
    """An object that lives in the program's process, as the judge sees it (see the module doc)."""

    __slots__ = ("_link", "_ref", "_type")

    def __init__(self, link: Link, ref: Any, type_name: Any) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_type", runtime.text(type_name, 100) or "object")

    def __getattr__(self, name: str) -> Any:
        # Python looks special methods up on the type, so this sees only attributes the tests
        # name themselves (`f.__annotations__` included).
        return self._link.request("getattr", self._ref, name=name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._link.request("setattr", self._ref, name=name, value=value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._link.request("call", self._ref, args=args, kwargs=kwargs)

    def __iter__(self) -> Any:
        return iter(self._exact("iter", list))

    def __len__(self) -> int:
        return self._exact("len", int)

    def __getitem__(self, key: Any) -> Any:
        return self._link.request("getitem", self._ref, key=key)

    def __str__(self) -> str:
        return self._exact("str", str)

    def __repr__(self) -> str:
        try:
            return self._exact("repr", str)
        except BaseException:
            return f"<{self._type} object of the program>"

    def __int__(self) -> int:
        return self._exact("int", int)

    def __float__(self) -> float:
        return self._exact("float", float)

    def __index__(self) -> int:
        return self._exact("index", int)

    def __copy__(self) -> ProgramObject:
        return self

    def __deepcopy__(self, memo: Any) -> ProgramObject:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("objects of the program cannot be pickled")

    def __hash__(self) -> int:
        return object.__hash__(self)

    __eq__ = _refuse("==")
    __ne__ = _refuse("!=")
    __lt__ = _refuse("<")
    __le__ = _refuse("<=")
    __gt__ = _refuse(">")
    __ge__ = _refuse(">=")
    __bool__ = _refuse("truth value")
    __contains__ = _refuse("in")

    def _exact(self, op: str, kind: type) -> Any:
        value = self._link.request(op, self._ref)
        if type(value) is not kind:
            raise NotJudged(f"`{op}` of a {self._type} of the program gave no plain {kind.__name__}")
        return value


class Link:
    """The judge's end of the link: sends requests, turns answers into values or exceptions."""

    def __init__(self, fd: int) -> None:
        self.fd, self.seq = fd, 0
        self.objects: dict[Any, ProgramObject] = {}
        self.lost: str | None = None
        self.deadline = float("inf")  # of the current test (set by the checker)

    def hello(self) -> list[str] | None:
        """The program's global names once it has loaded; None if it failed to load."""
        try:
            message = read_frame(self.fd, LINK_FRAME)
        except (ValueError, RecursionError, OSError):
            message = None
        if (
            not isinstance(message, dict)
            or message.get("t") != "loaded"
            or not isinstance(message.get("names"), list)
        ):
            self.lost = "the program failed to load"
            return None
        return [n for n in message["names"][:MAX_NAMES] if type(n) is str]

    def end(self) -> None:
        try:
            write_frame(self.fd, {"op": "end"})
        except OSError:
            pass

    # -- values crossing --------------------------------------------------------------------
    def _proxy(self, ref: Any, type_name: Any) -> ProgramObject:
        if type(ref) is not int:
            raise ValueError("a reference that is not one")
        proxy = self.objects.get(ref)
        if proxy is None:
            proxy = self.objects[ref] = ProgramObject(self, ref, type_name)
        return proxy

    def _reference(self, value: Any) -> list[Any]:
        if type(value) is ProgramObject and object.__getattribute__(value, "_link") is self:
            return ["ref", object.__getattribute__(value, "_ref"), ""]
        raise NotJudged(
            f"the test passes the program a {type(value).__qualname__}, which cannot cross to its process"
        )

    def _send_value(self, value: Any) -> Any:
        try:
            return encode(value, other=self._reference)
        except Unencodable as e:
            raise NotJudged(f"the test passes the program a value that cannot cross to it ({e})") from None

    # -- requests ---------------------------------------------------------------------------
    def request(self, op: str, ref: Any = None, **fields: Any) -> Any:
        if self.lost:
            raise ProgramLost(self.lost)
        budget = self.deadline - runtime.now()
        if budget <= 0:
            raise TestTimeout()
        message: dict[str, Any] = {"seq": self.seq + 1, "op": op, "budget": min(budget, 3600.0)}
        if ref is not None:
            message["ref"] = ref
        args = fields.pop("args", None)
        kwargs = fields.pop("kwargs", None)
        if args is not None:
            message["args"] = [self._send_value(a) for a in args]
            message["kwargs"] = {k: self._send_value(v) for k, v in kwargs.items()}
        for key, value in fields.items():
            message[key] = value if key == "name" else self._send_value(value)
        self.seq += 1
        reply = self._exchange(message)
        if "ok" in reply:
            value = self._receive(reply["ok"])
            if args is not None and isinstance(reply.get("back"), dict):
                self._write_back(reply["back"], args, kwargs)
            return value
        if reply.get("timeout") is True:
            raise TestTimeout()
        if isinstance(reply.get("raise"), dict):
            raise program_exception(reply["raise"])
        if reply.get("missing") is True:
            raise KeyError(fields.get("name"))
        if type(reply.get("module")) is str and op == "global":
            try:
                return importlib.import_module(reply["module"])
            except Exception:
                raise NotJudged(
                    f"the program's module {reply['module'][:100]!r} cannot be imported here"
                ) from None
        self.lost = "the program sent something that is not an answer"
        raise ProgramLost(self.lost)

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        answered = False
        try:
            write_frame(self.fd, message)
            reply = read_frame(self.fd, LINK_FRAME)
            if reply is None:
                self.lost = "the program's process ended"
                raise ProgramLost(self.lost)
            if not isinstance(reply, dict) or reply.get("seq") != message["seq"]:
                # The program answers each request once: anything else was written by it.
                self.lost = "the program wrote on the judge's channel"
                raise ProgramLost(self.lost)
            answered = True
            return reply
        except (ValueError, RecursionError, OSError):
            self.lost = "the program sent something that is not an answer"
            raise ProgramLost(self.lost) from None
        finally:
            if not answered and self.lost is None:
                # Interrupted (the judge's own timer): the program is still busy with the request.
                self.lost = "the program stopped answering"

    def _receive(self, tree: Any) -> Any:
        try:
            return decode(tree, ref=self._proxy)
        except ValueError:
            self.lost = "the program sent a malformed value"
            raise ProgramLost(self.lost) from None

    def _write_back(self, back: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Apply in-place changes the program made to the test's list, dict, set or bytearray arguments."""
        for key, tree in back.items():
            target: Any = args[int(key)] if key.isdigit() and int(key) < len(args) else kwargs.get(key)
            new = self._receive(tree)
            if type(target) is not type(new):
                continue
            if type(target) in (list, bytearray):
                target[:] = new
            elif type(target) in (dict, set, deque):
                target.clear()
                target.update(new) if type(target) is not deque else target.extend(new)


def program_exception(info: dict[str, Any]) -> BaseException:
    """The exception a program's request raised, as the judge raises it.

    Builtin exception types are rebuilt as themselves (a test may catch a `ValueError`); the
    program's own description travels with it for the verdict.
    """
    name = runtime.text(info.get("exc"), 100) or "Exception"
    message = runtime.text(info.get("msg"), 500)
    detail = message[len(name) + 2 :] if message.startswith(name + ": ") else ""
    cls = getattr(builtins, name, None)
    exc: BaseException
    try:
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            raise TypeError(name)
        exc = cls(detail) if detail else cls()
    except Exception:
        exc = ProgramError(message)
    exc.crucible_program = {  # type: ignore[attr-defined]
        "exc": name,
        "msg": message,
        "tb": runtime.text(info.get("tb"), 4000),
        "memory": info.get("memory") is True,
    }
    return exc


class ProgramError(Exception):
    """An exception of the program's own type (not a builtin one)."""
