"""Turn a test suite into a plan: which statements form each test, and how each one is judged.

Plans are built by the trusted worker, which keeps them to judge the run. There are two kinds:

* **Calls** (`plan_calls`, `plan_check_calls`): every test is one `assert f(<literals>) == <literal>`
  (or `!=`, or a bare `assert f(...)` / `assert not f(...)`), as in all but a handful of MBPP
  tasks and many HumanEval ones. The program's process receives only the function's name and its
  arguments, as data; it sends back the value; the worker compares it with the literal, which it
  evaluated itself without running any code (`ast.literal_eval`).
* **Judged** (`plan_asserts`, `plan_check`): anything else. The tests run in the run's *judge*
  process, which never holds the program (see `inrun.judge`); every `assert` becomes a call to the
  judge's checker `__ck`, a parameter of the generated test function:

      assert f(2) == 4          ->   __ck.check(0, lambda: f(2), lambda: 4)
      assert is_even(3)         ->   __ck.check(1, lambda: is_even(3), None)

  so the checker sees the operands, compares them itself and reports actual and expected values.
  Each test's statements are wrapped so that one test failing never stops the next one.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, cast

CK = "__ck"
_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}
_BUILTIN_NAMES = frozenset(dir(builtins))


@dataclass
class Site:
    """One assert statement."""

    node: ast.Assert | None
    op: str | None  # comparison operator, or None for a plain truth test
    _source: str | None = None

    @property
    def source(self) -> str:
        """The assert's source, normalised (computed on demand: only failures need it)."""
        if self._source is None:
            self._source = ast.unparse(self.node) if self.node is not None else "assert"
        return self._source


@dataclass
class Call:
    """A test that is one call of the program on literal arguments, checked against a literal."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    op: str  # "==", "!=", "truth" or "not"
    expected: Any = None
    # The arguments as the test's code builds them, `(args, kwargs)`: a set literal compiles to a
    # frozenset constant, whose order a program may see, so they are not rebuilt from the values.
    arguments: CodeType | None = None


@dataclass
class Plan:
    """How a suite is run and judged."""

    tests: list[str]  # display source of each test
    sites: list[Site] = field(default_factory=list)
    site_test: list[int] = field(default_factory=list)  # test index of each site
    module: ast.Module | None = None  # the judge's instrumented code (judged plans)
    entry: str = ""  # the function the judge calls (judged plans)
    calls: list[Call] | None = None  # one per test (call plans)
    names: list[list[str]] | None = None  # the names each test reads (judged `asserts` plans)


class _AssertRewriter(ast.NodeTransformer):
    def __init__(self, plan: Plan, test_index: int) -> None:
        self.plan, self.test_index = plan, test_index

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node  # asserts inside helper functions keep plain semantics

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_Lambda = visit_FunctionDef  # type: ignore[assignment]

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        site_id = len(self.plan.sites)
        test = node.test
        loc = _loc(node)
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            site = Site(node, _OPS[type(test.ops[0])])
            args: list[ast.expr] = [_thunk(test.left, loc), _thunk(test.comparators[0], loc)]
        else:
            site = Site(node, None)
            args = [_thunk(test, loc), ast.Constant(None, **loc)]
        self.plan.sites.append(site)
        self.plan.site_test.append(self.test_index)
        return _ck_call("check", [ast.Constant(site_id, **loc), *args], loc)


# New nodes get their locations when built (compile needs them): walking the finished tree to
# fill them in afterwards was most of the time spent building a plan.
_NOWHERE = {"lineno": 1, "col_offset": 0, "end_lineno": 1, "end_col_offset": 0}


def _loc(ref: ast.stmt | ast.expr) -> dict[str, Any]:
    """The source location of `ref`, to give to nodes built in its place."""
    return {
        "lineno": ref.lineno,
        "col_offset": ref.col_offset,
        "end_lineno": ref.end_lineno or ref.lineno,
        "end_col_offset": ref.end_col_offset or ref.col_offset,
    }


def _ck_call(name: str, args: list[ast.expr], loc: dict[str, int]) -> ast.Expr:
    """`__ck.<name>(*args)` as a statement."""
    func = ast.Attribute(value=ast.Name(CK, ast.Load(), **loc), attr=name, ctx=ast.Load(), **loc)
    return ast.Expr(ast.Call(func=func, args=args, keywords=[], **loc), **loc)


def _no_args() -> ast.arguments:
    return ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], defaults=[])


def _thunk(expr: ast.expr, loc: dict[str, int]) -> ast.Lambda:
    return ast.Lambda(args=_no_args(), body=expr, **loc)


def _guard(index: int, body: list[ast.stmt]) -> list[ast.stmt]:
    """`__ck.begin(i); try: <body>; __ck.ok(i) except BaseException as e: __ck.fail(i, e) finally: __ck.end(i)`.

    A test is passed only once `ok` ran: one interrupted anywhere else never reads as passed.
    """
    loc = _loc(body[0]) if body else _NOWHERE
    body = [*body, _ck_call("ok", [ast.Constant(index, **loc)], loc)]
    exc = "__crucible_exc"
    handler = ast.ExceptHandler(
        type=ast.Name("BaseException", ast.Load(), **loc),
        name=exc,
        body=[_ck_call("fail", [ast.Constant(index, **loc), ast.Name(exc, ast.Load(), **loc)], loc)],
        **loc,
    )
    guarded = ast.Try(
        body=body,
        handlers=[handler],
        orelse=[],
        finalbody=[_ck_call("end", [ast.Constant(index, **loc)], loc)],
        **loc,
    )
    return [_ck_call("begin", [ast.Constant(index, **loc)], loc), guarded]


def _function(name: str, params: list[str], body: list[ast.stmt]) -> ast.FunctionDef:
    loc = _loc(body[0]) if body else _NOWHERE
    args = ast.arguments(
        posonlyargs=[],
        args=[ast.arg(p, **loc) for p in params],
        vararg=None,
        kwonlyargs=[],
        kw_defaults=[],
        defaults=[],
    )
    extra: dict[str, Any] = {"type_params": []} if "type_params" in ast.FunctionDef._fields else {}
    return ast.FunctionDef(
        name=name,
        args=args,
        body=body or [ast.Pass(**loc)],
        decorator_list=[],
        returns=None,
        **extra,
        **loc,
    )


def plan_asserts(asserts: list[str]) -> Plan:
    """Each entry is one test, run by the judge. Raises SyntaxError (`filename` `<test N>`)."""
    names: list[list[str]] = []
    plan = Plan(
        tests=list(asserts),
        module=ast.Module(body=[], type_ignores=[]),
        entry="__crucible_tests__",
        names=names,
    )
    body: list[ast.stmt] = []
    for i, source in enumerate(asserts):
        tree = ast.parse(source, filename=f"<test {i}>")
        names.append(read_names(tree))
        stmts = [_AssertRewriter(plan, i).visit(s) for s in tree.body]
        body.extend(_guard(i, stmts))
    assert plan.module is not None
    plan.module.body.append(_function(plan.entry, [CK], body))
    return plan


def read_names(tree: ast.AST) -> list[str]:
    """The names code reads (the judge decides with them whose `len` or `sum` a test means)."""
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)})


def plan_check(check_source: str) -> Plan:
    """Each top-level statement of `check`'s body that contains an assert is one test.

    Other top-level statements (imports, helper assignments) run inside the next test's guard, so
    an error there is reported on that test. Raises SyntaxError, or ValueError when there is no
    `check` function.
    """
    tree = ast.parse(check_source, filename="<check>")
    fn = _check_function(tree)
    plan = Plan(tests=[], module=tree, entry="check")
    body: list[ast.stmt] = []
    pending: list[ast.stmt] = []
    for stmt in fn.body:
        if not any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            pending.append(stmt)  # set-up statement: runs inside the next test's guard
            continue
        index = len(plan.tests)
        plan.tests.append(ast.unparse(stmt))
        stmts = [*pending, _AssertRewriter(plan, index).visit(stmt)]
        pending = []
        body.extend(_guard(index, stmts))
    body.extend(pending)
    if not plan.tests:
        raise ValueError("`check` contains no assert statements")
    fn.args.args.append(ast.arg(CK, **_loc(fn)))
    fn.body = body
    return plan


def _check_function(tree: ast.Module) -> ast.FunctionDef:
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise ValueError("the check code defines no function named `check`")
    fn = checks[-1]
    if not fn.args.args:
        raise ValueError("`check` must take the candidate function as its first parameter")
    return fn


# -- call plans -------------------------------------------------------------------------------

_NO_VALUE = object()


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_VALUE


def _call(node: ast.expr, callee: str | None) -> Call | None:
    """`name(<literals>, key=<literal>)`, or None. `callee`: the only name allowed, if any."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    name = node.func.id
    if (callee is None and name in _BUILTIN_NAMES) or (callee is not None and name != callee):
        return None
    args = [_literal(a) for a in node.args]
    kwargs = {k.arg: _literal(k.value) for k in node.keywords}
    if None in kwargs or any(v is _NO_VALUE for v in (*args, *kwargs.values())):
        return None  # `**kwargs`, `*args` or a computed argument
    keys: list[ast.expr | None] = [ast.Constant(k.arg) for k in node.keywords]
    both = ast.Tuple(
        [ast.Tuple(node.args, ast.Load()), ast.Dict(keys, [k.value for k in node.keywords])], ast.Load()
    )
    arguments = compile(
        ast.fix_missing_locations(ast.Expression(both)), "<arguments>", "eval", dont_inherit=True
    )
    return Call(name, tuple(args), cast(dict[str, Any], kwargs), op="truth", arguments=arguments)


def _call_site(node: ast.Assert, callee: str | None) -> Call | None:
    """The call-and-literal form of one assert, or None."""
    test = node.test
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1 or type(test.ops[0]) not in (ast.Eq, ast.NotEq):
            return None
        call, expected = _call(test.left, callee), _literal(test.comparators[0])
        if call is None or expected is _NO_VALUE:
            return None
        call.op, call.expected = _OPS[type(test.ops[0])], expected
        return call
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        call = _call(test.operand, callee)
        if call is not None:
            call.op = "not"
        return call
    return _call(test, callee)


def plan_calls(asserts: list[str], setup: str = "") -> Plan | None:
    """A call plan, or None unless every test is one call-and-literal assert and there is no setup.

    The called name may not be a builtin's (a program may shadow `sum`; the judge resolves that).
    Raises SyntaxError (with `filename` set to `<test N>`) when a test does not parse.
    """
    if setup.strip():
        return None
    plan = Plan(tests=list(asserts), calls=[])
    for i, source in enumerate(asserts):
        tree = ast.parse(source, filename=f"<test {i}>")
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
            return None
        call = _call_site(tree.body[0], None)
        if call is None:
            return None
        _add_call(plan, i, tree.body[0], call)
    return plan


def plan_check_calls(check_source: str, entry_point: str) -> Plan | None:
    """A call plan for a `check` whose every statement is a call-and-literal assert on `candidate`.

    Module-level statements other than `check` must be literal assignments (HumanEval's
    `METADATA = {...}`). Tests are numbered as `plan_check` numbers them.
    """
    try:
        tree = ast.parse(check_source, filename="<check>")
        fn = _check_function(tree)
    except (SyntaxError, ValueError):
        return None
    for stmt in tree.body:
        if stmt is fn or _inert(stmt):
            continue
        return None
    if fn.decorator_list or len(fn.args.args) != 1 or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs:
        return None
    param = fn.args.args[0].arg
    plan = Plan(tests=[], calls=[])
    for stmt in fn.body:
        if isinstance(stmt, ast.Pass) or (
            isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        ):
            continue
        if not isinstance(stmt, ast.Assert):
            return None
        call = _call_site(stmt, param)
        if call is None:
            return None
        call.name = entry_point
        plan.tests.append(ast.unparse(stmt))
        _add_call(plan, len(plan.tests) - 1, stmt, call)
    return plan if plan.tests else None


def _inert(stmt: ast.stmt) -> bool:
    """A module-level statement that cannot matter to `check`: a docstring, or `NAME = <literal>`."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True
    return (
        isinstance(stmt, ast.Assign)
        and all(isinstance(t, ast.Name) and t.id != "check" for t in stmt.targets)
        and _literal(stmt.value) is not _NO_VALUE
    )


def _add_call(plan: Plan, index: int, node: ast.Assert, call: Call) -> None:
    assert plan.calls is not None
    plan.calls.append(call)
    plan.sites.append(Site(node, None if call.op in ("truth", "not") else call.op))
    plan.site_test.append(index)
