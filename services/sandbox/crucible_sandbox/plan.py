"""Turn a test suite into a plan: which statements form each test, and each assert site.

Plans are built by the trusted worker, which keeps them to judge the run and compiles the code
the run executes. When every test is one `assert` statement (all of MBPP), the plan just lists
each assert's operands and the harness evaluates them one by one (`plan_single_asserts`).
Otherwise the tests are instrumented: every `assert` becomes a call to the checker `__ck`, a
*parameter* of the generated test function, so a candidate cannot swap it by rebinding a global:

    assert f(2) == 4          ->   __ck.check(0, lambda: f(2), None)   # 4: trusted, kept outside
    assert is_even(3)         ->   __ck.check(1, lambda: is_even(3), None)
    assert g(x) < 3           ->   __ck.check(2, lambda: g(x), lambda: 3)

Each test's statements are wrapped so that one test failing never stops the next one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

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


@dataclass
class Site:
    """One assert statement."""

    node: ast.Assert | None
    op: str | None  # comparison operator, or None for a plain truth test
    rhs: ast.expr | None  # the right-hand side, for comparisons
    trusted: bool = False  # expected value computed before the candidate runs
    _source: str | None = None
    lhs: ast.expr | None = None  # the left-hand side (or the whole test), for single-assert plans

    @property
    def source(self) -> str:
        """The assert's source, normalised (computed on demand: only failures need it)."""
        if self._source is None:
            self._source = ast.unparse(self.node) if self.node is not None else "assert"
        return self._source


@dataclass
class Plan:
    """Instrumented test code plus what the trusted side needs to judge it."""

    tests: list[str]  # display source of each test
    module: ast.Module | None  # defines the test function(s), see `entry`; None for single asserts
    entry: str  # name of the function the harness calls
    sites: list[Site] = field(default_factory=list)
    site_test: list[int] = field(default_factory=list)  # test index of each site


class _AssertRewriter(ast.NodeTransformer):
    def __init__(
        self, plan: Plan, test_index: int, top_level: set[int], allow_trust: bool, distrust: frozenset[int]
    ) -> None:
        self.plan, self.test_index, self.top_level, self.allow_trust = (
            plan,
            test_index,
            top_level,
            allow_trust,
        )
        self.distrust = distrust

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node  # asserts inside helper functions keep plain semantics

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_Lambda = visit_FunctionDef  # type: ignore[assignment]

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        site_id = len(self.plan.sites)
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            op = _OPS[type(test.ops[0])]
            lhs, rhs = test.left, test.comparators[0]
            trusted = (
                self.allow_trust
                and op == "=="
                and id(node) in self.top_level
                and site_id not in self.distrust
            )
            site = Site(node, op, rhs, trusted)
            # A trusted site's expected value is computed before the candidate runs and kept
            # outside its process, so the instrumented code does not contain it at all.
            loc = _loc(node)
            args = [_thunk(lhs, loc), ast.Constant(None, **loc) if trusted else _thunk(rhs, loc)]
        else:
            site = Site(node, None, None)
            loc = _loc(node)
            args = [_thunk(test, loc), ast.Constant(None, **loc)]
        self.plan.sites.append(site)
        self.plan.site_test.append(self.test_index)
        return _ck_call("check", [ast.Constant(site_id, **loc), *args], loc)


# New nodes get their locations when built (compile needs them): walking the finished tree to
# fill them in afterwards was most of the time spent building a plan.
_NOWHERE = {"lineno": 1, "col_offset": 0, "end_lineno": 1, "end_col_offset": 0}


def _loc(ref: ast.AST) -> dict[str, int]:
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
    """`__ck.begin(i); try: <body> except BaseException as e: __ck.fail(i, e) finally: __ck.end(i)`."""
    loc = _loc(body[0]) if body else _NOWHERE
    exc = "__crucible_exc"
    handler = ast.ExceptHandler(
        type=ast.Name("BaseException", ast.Load(), **loc),
        name=exc,
        body=[_ck_call("fail", [ast.Constant(index, **loc), ast.Name(exc, ast.Load(), **loc)], loc)],
        **loc,
    )
    guarded = ast.Try(
        body=body or [ast.Pass(**loc)],
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
    extra = {"type_params": []} if "type_params" in ast.FunctionDef._fields else {}
    return ast.FunctionDef(
        name=name,
        args=args,
        body=body or [ast.Pass(**loc)],
        decorator_list=[],
        returns=None,
        **extra,
        **loc,
    )


def plan_asserts(asserts: list[str], distrust: frozenset[int] = frozenset()) -> Plan:
    """Each entry is one test; top-level `assert L == R` sites get a trusted expected value.

    Raises SyntaxError (with `filename` set to `<test N>`) when a test does not parse.
    """
    plan = Plan(tests=list(asserts), module=ast.Module(body=[], type_ignores=[]), entry="__crucible_tests__")
    body: list[ast.stmt] = []
    for i, source in enumerate(asserts):
        tree = ast.parse(source, filename=f"<test {i}>")
        top = {id(s) for s in tree.body if isinstance(s, ast.Assert)}
        stmts = [_AssertRewriter(plan, i, top, True, distrust).visit(s) for s in tree.body]
        body.extend(_guard(i, stmts))
    plan.module.body.append(_function(plan.entry, [CK], body))
    return plan


def plan_single_asserts(asserts: list[str]) -> Plan | None:
    """A plan without instrumented code, or None unless every test is one `assert` statement.

    Such a test is one site: its operands are compiled on their own and the harness evaluates
    them itself, which is far cheaper than compiling an instrumented module. Sites are the
    same as `plan_asserts` would make (`assert L == R` trusted, anything else checked in-process).
    Raises SyntaxError (with `filename` set to `<test N>`) when a test does not parse.
    """
    plan = Plan(tests=list(asserts), module=None, entry="")
    for i, source in enumerate(asserts):
        tree = ast.parse(source, filename=f"<test {i}>")
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
            return None
        node = tree.body[0]
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            op = _OPS[type(test.ops[0])]
            site = Site(node, op, test.comparators[0], trusted=op == "==", lhs=test.left)
        else:
            site = Site(node, None, None, lhs=test)
        plan.sites.append(site)
        plan.site_test.append(i)
    return plan


def plan_check(check_source: str) -> Plan:
    """Each top-level statement of `check`'s body that contains an assert is one test.

    Other top-level statements (imports, helper assignments) run unguarded-by-test but still
    guarded, so an error there is reported on the next test. Raises SyntaxError, or ValueError
    when there is no `check` function.
    """
    tree = ast.parse(check_source, filename="<check>")
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise ValueError("the check code defines no function named `check`")
    fn = checks[-1]
    if not fn.args.args:
        raise ValueError("`check` must take the candidate function as its first parameter")
    plan = Plan(tests=[], module=tree, entry="check")
    body: list[ast.stmt] = []
    pending: list[ast.stmt] = []
    for stmt in fn.body:
        if not any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            pending.append(stmt)  # set-up statement: runs inside the next test's guard
            continue
        index = len(plan.tests)
        plan.tests.append(ast.unparse(stmt))
        stmts = [*pending, _AssertRewriter(plan, index, set(), False, frozenset()).visit(stmt)]
        pending = []
        body.extend(_guard(index, stmts))
    body.extend(pending)
    if not plan.tests:
        raise ValueError("`check` contains no assert statements")
    fn.args.args.append(ast.arg(CK, **_loc(fn)))
    fn.body = body
    return plan
