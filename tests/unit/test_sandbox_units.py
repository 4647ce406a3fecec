"""Pure parts of the sandbox: value transfer, assert rewriting, verdicts, the stdio comparator."""

from __future__ import annotations

import ast
import collections
import doctest
import fractions

import pytest
from crucible_sandbox import plan, values, verdict
from crucible_sandbox.verdict import ProcessOutcome, compare_output, judge_tests, worst


@pytest.mark.parametrize("module", [values, verdict])
def test_doctests(module) -> None:
    assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(10**5000),
        1.5,
        float("inf"),
        2j,
        "é",
        b"\x00",
        [1, (2, {3})],
        {"a": [1]},
        frozenset({1}),
        collections.Counter("aab"),
        collections.OrderedDict(a=1),
        collections.deque([1]),
        fractions.Fraction(1, 3),
    ],
    ids=lambda v: type(v).__name__,
)
def test_values_round_trip(value) -> None:
    assert values.decode(values.encode(value)) == value


def test_values_keep_types_apart() -> None:
    assert values.decode(values.encode((1, 2))) != [1, 2]
    assert type(values.decode(values.encode({1}))) is set


def test_values_refuse_subclasses_and_custom_types() -> None:
    class Sneaky(int):
        def __eq__(self, other):
            return True

    class AlwaysEqual:
        def __eq__(self, other):
            return True

    for value in (Sneaky(1), AlwaysEqual(), [AlwaysEqual()], {1: AlwaysEqual()}):
        with pytest.raises(values.Unencodable):
            values.encode(value)


def test_values_decode_rejects_garbage() -> None:
    for bad in (["int", "zz"], ["nope"], [], ["list", 5]):
        with pytest.raises(ValueError):
            values.decode(bad)


def test_assert_rewriting_marks_trusted_sites() -> None:
    p = plan.plan_asserts(
        ["assert f(2) == 4", "assert g(1)", "x = h()\nassert x != 3", "for i in [1]:\n    assert f(i) == i"]
    )
    assert [(s.op, s.trusted) for s in p.sites] == [("==", True), (None, False), ("!=", False), ("==", False)]
    assert p.site_test == [0, 1, 2, 3]
    source = ast.unparse(p.module)
    assert "assert" not in source
    # The trusted site's expected value is not in the instrumented code at all.
    assert "__ck.check(0, lambda: f(2), None)" in source
    compile(p.module, "<tests>", "exec")


def test_check_rewriting_one_test_per_top_level_assert() -> None:
    src = "def check(candidate):\n    import math\n    assert candidate(1) == 2\n    for i in range(3):\n        assert candidate(i) > -1\n"
    p = plan.plan_check(src)
    assert len(p.tests) == 2 and p.site_test == [0, 1]
    assert not any(s.trusted for s in p.sites)
    compile(p.module, "<check>", "exec")
    with pytest.raises(ValueError):
        plan.plan_check("def helper(c):\n    assert c\n")


def _proc(*frames, **kw) -> ProcessOutcome:
    return ProcessOutcome(frames=list(frames), exit_code=kw.pop("exit_code", 0), **kw)


def test_trusted_site_is_judged_outside_the_program() -> None:
    p = plan.plan_asserts(["assert add(2, 2) == 4"])
    expected = {"t": "expected", "values": {"0": values.encode(4)}}
    # The program claims `passed` but its actual value is 5: the zygote says failed.
    lying = {"t": "test", "i": 0, "status": "passed", "actuals": {"0": {"value": values.encode(5)}}}
    out = judge_tests(p, _proc(expected, lying, {"t": "done"}))
    assert out["status"] == "failed"
    assert out["tests"][0]["message"] == "assert add(2, 2) == 4 -> got 5"
    assert (out["tests"][0]["actual"], out["tests"][0]["expected"]) == ("5", "4")
    honest = {"t": "test", "i": 0, "status": "passed", "actuals": {"0": {"value": values.encode(4)}}}
    assert judge_tests(p, _proc(expected, honest, {"t": "done"}))["status"] == "passed"
    # A claimed pass without the actual value is not a pass.
    empty = {"t": "test", "i": 0, "status": "passed", "actuals": {}}
    assert judge_tests(p, _proc(expected, empty))["status"] == "failed"


def test_status_mapping() -> None:
    p = plan.plan_asserts(["assert f() == 1", "assert f() == 2", "assert f() == 3"])
    exp = {"t": "expected", "values": {str(i): values.encode(i + 1) for i in range(3)}}

    def ok(i):
        return {
            "t": "test",
            "i": i,
            "status": "passed",
            "actuals": {str(i): {"value": values.encode(i + 1)}},
        }

    # Died during test 1 (e.g. os._exit(0)): test 1 is an error, test 2 never ran.
    out = judge_tests(p, _proc(exp, ok(0)))
    assert [t["status"] for t in out["tests"]] == ["passed", "error", "not_run"]
    assert out["status"] == "error" and out["passed"] == 1
    assert judge_tests(p, _proc(exp, ok(0), killed="timeout"))["status"] == "timeout"
    assert judge_tests(p, _proc(exp, killed="output"))["status"] == "output_exceeded"
    assert judge_tests(p, _proc({"t": "syntax", "msg": "SyntaxError: x"}))["status"] == "syntax_error"
    assert judge_tests(p, _proc(exit_code=70))["status"] == "sandbox_error"
    crash = {"t": "crash", "exc": "MemoryError", "msg": "MemoryError", "tb": "", "memory": True}
    assert judge_tests(p, _proc(exp, crash))["status"] == "memory_exceeded"
    assert worst([]) == "passed"


def test_stdio_comparator() -> None:
    assert compare_output("1 2\n3  \n\n", "1  2\n3") is None
    assert compare_output("1\n", "1\n2\n") == "output ended after 1 line(s); expected 2"
    assert compare_output("12\n", "1\n") == "line 1: expected '1', got '12'"
    assert compare_output("1\n2\n", "1\n") == "1 extra line(s) after the expected output"
    assert compare_output("", "") is None


def _constants(code) -> list:
    """Every constant in a code object and the code objects nested in it."""
    out = []
    for const in code.co_consts:
        out.extend(_constants(const) if hasattr(const, "co_consts") else [const])
    return out


def test_compiled_tests_keep_expected_values_out_of_the_test_code() -> None:
    from crucible_sandbox.worker import compile_tests

    # Every test one assert: operands compiled alone, no instrumented module.
    plan_, program = compile_tests(
        {"kind": "asserts", "asserts": ["assert f(2) == 12345", "assert g(1) < 777"], "setup": ""}
    )
    assert plan_.module is None and "module" not in program
    assert program["sites"] == [("==", True), ("<", False)]
    (lhs, rhs), (_, rhs2) = program["single"]
    assert rhs is None and 12345 not in _constants(lhs) and 12345 in _constants(program["expected"][0])
    assert 777 in _constants(rhs2)  # not trusted: compared in the run's process
    # A test with more than one statement: the instrumented module, still without 12345.
    plan_, program = compile_tests(
        {"kind": "asserts", "asserts": ["x = 2\nassert f(x) == 12345"], "setup": ""}
    )
    assert plan_.module is not None and "single" not in program
    assert 12345 not in _constants(program["module"])
    assert 12345 in _constants(program["expected"][0])


def test_single_assert_plans_match_instrumented_plans() -> None:
    asserts = ["assert f(2) == 4", "assert g(1)", "assert h() != 3", "assert a == b == c"]
    single, full = plan.plan_single_asserts(asserts), plan.plan_asserts(asserts)
    assert single is not None
    assert [(s.op, s.trusted) for s in single.sites] == [(s.op, s.trusted) for s in full.sites]
    assert single.site_test == full.site_test == [0, 1, 2, 3]
    assert [s.source for s in single.sites] == [s.source for s in full.sites]
    assert plan.plan_single_asserts(["x = 1\nassert f(x) == 1"]) is None
    assert plan.plan_single_asserts(["for i in [1]:\n    assert f(i)"]) is None


def test_plan_cache_compiles_each_suite_once() -> None:
    from crucible_sandbox.worker import PlanCache

    cache = PlanCache(entries=1)
    a = {"kind": "asserts", "asserts": ["assert f(1) == 1"], "setup": ""}
    first = cache.get(a)
    assert cache.get(dict(a)) is first
    cache.get({"kind": "asserts", "asserts": ["assert f(2) == 2"], "setup": ""})
    assert cache.get(a) is not first  # evicted: the cache holds one entry


def test_candidates_compile_without_the_harness_future_imports() -> None:
    from crucible_sandbox.harness import compile_candidate

    code, syntax = compile_candidate("def f(x: int) -> int:\n    return x\n")
    namespace: dict = {}
    exec(code, namespace)
    assert syntax is None and namespace["f"].__annotations__["x"] is int  # not the string 'int'
    code, syntax = compile_candidate("def f(:\n")
    assert code is None and syntax["t"] == "syntax" and "SyntaxError" in syntax["msg"]
