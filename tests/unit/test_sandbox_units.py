"""Pure parts of the sandbox: value transfer, plans, verdicts, frames, the link's two ends."""

from __future__ import annotations

import ast
import collections
import fractions
import marshal
import operator
import time

import pytest
from crucible_sandbox.inrun.link import NotJudged, ProgramObject, ProgramServer
from crucible_sandbox.judging import plan, verdict
from crucible_sandbox.judging.cell_clock import CellClock
from crucible_sandbox.judging.output import compare_output, judge_cells
from crucible_sandbox.judging.verdict import ProcessOutcome, judge_calls, judge_judged, worst
from crucible_sandbox.wire import channel, values


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
        bytearray(b"ab"),
        [1, (2, {3})],
        {"a": [1]},
        frozenset({1}),
        collections.Counter("aab"),
        collections.OrderedDict(a=1),
        collections.deque([1]),
        fractions.Fraction(1, 3),
        range(1, 10, 2),
        int,
        len,
    ],
    ids=lambda v: type(v).__name__,
)
def test_values_round_trip(value) -> None:
    back = values.decode(values.encode(value))
    assert back == value and type(back) is type(value)


def test_values_keep_types_apart() -> None:
    assert values.decode(values.encode((1, 2))) != [1, 2]
    assert type(values.decode(values.encode({1}))) is set
    assert values.decode(values.encode(collections.Counter({2: 3}))) == collections.Counter({2: 3})


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
    # With `other`, what is not data becomes what `other` makes of it (the program's references).
    assert values.encode([AlwaysEqual()], other=lambda x: ["ref", 7, "AlwaysEqual"]) == [
        "list",
        [["ref", 7, "AlwaysEqual"]],
    ]


def _deep(levels: int) -> list:
    tree: list = ["list", []]
    for _ in range(levels):
        tree = ["list", [tree]]
    return tree


@pytest.mark.parametrize(
    "bad",
    [
        ["int", "zz"],
        ["nope"],
        [],
        ["list", 5],
        ["Fraction", "0x1", "0x0"],  # a zero denominator
        ["set", [["list", []]]],  # an unhashable member
        ["float", "0x1p99999999"],
        ["builtin", "__import__x"],
        ["ref", 1, "T"],  # no references where none are allowed
        ["str", 5],
        7,
        None,
        _deep(200),
    ],
)
def test_values_decode_raises_only_value_error(bad) -> None:
    with pytest.raises(ValueError):
        values.decode(bad)


def test_a_signalling_nan_decodes_and_fails_to_compare() -> None:
    nan = values.decode(values.encode(__import__("decimal").Decimal("sNaN")))
    call = plan.Call("f", (), {}, "==", 1)
    assert verdict._holds(call, nan) == (False, "comparing the values raised InvalidOperation")


# -- plans ----------------------------------------------------------------------------------------


def test_call_plans_take_calls_on_literals_only() -> None:
    p = plan.plan_calls(
        ["assert f(2, [1]) == (3, 4)", "assert f(x=1) != 0", "assert g(1)", "assert not g(2)"]
    )
    assert p is not None and p.module is None
    assert [(c.name, c.args, c.kwargs, c.op, c.expected) for c in p.calls] == [
        ("f", (2, [1]), {}, "==", (3, 4)),
        ("f", (), {"x": 1}, "!=", 0),
        ("g", (1,), {}, "truth", None),
        ("g", (2,), {}, "not", None),
    ]
    assert [s.op for s in p.sites] == ["==", "!=", None, None]
    for suite in (
        ["assert f(1.0 / 3) == 1"],  # a computed argument
        ["assert sorted(f(1)) == [1]"],  # the test's own expression around the call
        ["assert sum(1, 2) == 3"],  # a builtin's name: the program may or may not shadow it
        ["assert f(*xs) == 1"],
        ["x = 1\nassert f(x) == 1"],
        ["assert f(1) < 2"],
    ):
        assert plan.plan_calls(suite) is None, suite
    assert plan.plan_calls(["assert f(1) == 1"], setup="import math") is None


def test_check_call_plans() -> None:
    check = "METADATA = {'a': 1}\n\ndef check(candidate):\n    '''doc'''\n    assert candidate([1], 2) == True, 'msg'\n    assert candidate([3], 4) == False\n"
    p = plan.plan_check_calls(check, "f")
    assert p is not None and [(c.name, c.args, c.expected) for c in p.calls] == [
        ("f", ([1], 2), True),
        ("f", ([3], 4), False),
    ]
    assert p.tests == ["assert candidate([1], 2) == True, 'msg'", "assert candidate([3], 4) == False"]
    assert (
        plan.plan_check_calls(
            "def check(candidate):\n    for i in range(3):\n        assert candidate(i) == i\n", "f"
        )
        is None
    )
    assert plan.plan_check_calls("import math\ndef check(c):\n    assert c(1) == 1\n", "f") is None
    assert plan.plan_check_calls("def check(c):\n    assert c(1) == helper(1)\n", "f") is None


def test_judged_plans_check_every_assert_in_the_judge() -> None:
    p = plan.plan_asserts(
        ["assert f(2) == 4", "assert g(1)", "x = h()\nassert x != 3", "for i in [1]:\n    assert f(i) == i"]
    )
    assert [s.op for s in p.sites] == ["==", None, "!=", "=="]
    assert p.site_test == [0, 1, 2, 3]
    source = ast.unparse(p.module)
    assert "assert" not in source and "__ck.check(0, lambda: f(2), lambda: 4)" in source
    assert "__ck.ok(0)" in source  # a test is passed only once its body ran to the end
    compile(p.module, "<tests>", "exec")
    src = "def check(candidate):\n    import math\n    assert candidate(1) == 2\n    for i in range(3):\n        assert candidate(i) > -1\n"
    p = plan.plan_check(src)
    assert len(p.tests) == 2 and p.site_test == [0, 1]
    compile(p.module, "<check>", "exec")
    with pytest.raises(ValueError):
        plan.plan_check("def helper(c):\n    assert c\n")


def _constants(code) -> list:
    """Every constant in a code object and the code objects nested in it."""
    out = []
    for const in code.co_consts:
        out.extend(_constants(const) if hasattr(const, "co_consts") else [const])
    return out


def test_the_program_receives_no_expected_value() -> None:
    from crucible_sandbox.judging.compile import compile_tests

    # A call plan: the program's process gets names and arguments, never 12345.
    p, calls = compile_tests(
        {"kind": "asserts", "asserts": ["assert f(2) == 12345", "assert g(7) != 54321"], "setup": ""}
    )
    assert [(name, eval(arguments)) for name, arguments in calls] == [("f", ((2,), {})), ("g", ((7,), {}))]
    assert not {12345, 54321} & set(_constants(calls[0][1]) + _constants(calls[1][1]))
    # A judged plan: everything about the tests goes to the judge only (the worker sends the
    # program's process its program and nothing else).
    p, judged = compile_tests({"kind": "asserts", "asserts": ["x = 2\nassert f(x) == 12345"], "setup": ""})
    assert p.calls is None and isinstance(judged, bytes)
    assert 12345 in _constants(marshal.loads(judged)["module"])


def test_plan_cache_compiles_each_suite_once() -> None:
    from crucible_sandbox.judging.compile import PlanCache

    cache = PlanCache(entries=1)
    a = {"kind": "asserts", "asserts": ["assert f(1) == 1"], "setup": ""}
    first = cache.get(a)
    assert cache.get(dict(a)) is first
    cache.get({"kind": "asserts", "asserts": ["assert f(2) == 2"], "setup": ""})
    assert cache.get(a) is not first  # evicted: the cache holds one entry


# -- verdicts -------------------------------------------------------------------------------------

STARTED = {"t": "started"}


def _proc(*frames, **kw) -> ProcessOutcome:
    return ProcessOutcome(frames=list(frames), exit_code=kw.pop("exit_code", 0), **kw)


def test_call_values_are_judged_by_the_worker() -> None:
    p = plan.plan_calls(["assert add(2, 2) == 4"])
    # Whatever the program claims, its value is what counts.
    lying = {"t": "test", "i": 0, "status": "passed", "value": values.encode(5)}
    out = judge_calls(p, _proc(STARTED, lying, {"t": "done"}))
    assert out["status"] == "failed" and out["tests"][0]["message"] == "assert add(2, 2) == 4 -> got 5"
    assert (out["tests"][0]["actual"], out["tests"][0]["expected"]) == ("5", "4")
    honest = {"t": "test", "i": 0, "value": values.encode(4)}
    assert judge_calls(p, _proc(STARTED, honest, {"t": "done"}))["status"] == "passed"
    # A claimed pass without a value is no pass; a value that is not data is not judged.
    assert judge_calls(p, _proc(STARTED, {"t": "test", "i": 0, "status": "passed"}))["status"] == "error"
    other = judge_calls(p, _proc(STARTED, {"t": "test", "i": 0, "other": {"type": "Y", "repr": "<Y>"}}))
    assert other["status"] == "failed" and other["tests"][0]["judged_outside"] is False
    # Garbage after `started` is the program's: an error, never a sandbox error.
    assert judge_calls(p, _proc(STARTED, malformed=True))["status"] == "error"
    zero = {"t": "test", "i": 0, "value": ["Fraction", "0x1", "0x0"]}
    assert judge_calls(p, _proc(STARTED, zero, {"t": "done"}))["status"] == "error"
    # No `started`: the sandbox failed, unless the run was ended for a limit.
    assert judge_calls(p, _proc(exit_code=70))["status"] == "sandbox_error"
    assert judge_calls(p, _proc(killed="report"))["status"] == "output_exceeded"


def test_status_mapping() -> None:
    p = plan.plan_calls(["assert f() == 1", "assert f() == 2", "assert f() == 3"])

    def ok(i):
        return {"t": "test", "i": i, "value": values.encode(i + 1)}

    # Died during test 1 (e.g. os._exit(0)): test 1 is an error, test 2 never ran.
    out = judge_calls(p, _proc(STARTED, ok(0)))
    assert [t["status"] for t in out["tests"]] == ["passed", "error", "not_run"]
    assert out["status"] == "error" and out["passed"] == 1
    assert judge_calls(p, _proc(STARTED, ok(0), killed="timeout"))["status"] == "timeout"
    assert judge_calls(p, _proc(STARTED, killed="output"))["status"] == "output_exceeded"
    assert judge_calls(p, _proc(STARTED, ok(0), ok(1), ok(2), killed="memory"))["status"] == "memory_exceeded"
    crash = {"t": "crash", "exc": "MemoryError", "msg": "MemoryError", "tb": "", "memory": True}
    assert judge_calls(p, _proc(STARTED, crash))["status"] == "memory_exceeded"
    syntax = verdict.syntax_error(
        {"t": "syntax", "exc": "IndentationError", "msg": "IndentationError: x"}, p.tests
    )
    assert syntax["status"] == "syntax_error" and syntax["exception_type"] == "IndentationError"
    assert worst([]) == "passed"


def test_judged_verdicts_come_from_the_judge() -> None:
    p = plan.plan_check("def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) == 3\n")
    judge = _proc(
        STARTED,
        {"t": "test", "i": 0, "status": "passed", "judged": True, "helpers": ["poly"]},
        {
            "t": "test",
            "i": 1,
            "status": "failed",
            "judged": False,
            "why": "not plain data",
            "fail": {"site": 1, "actual": "<Y>"},
        },
        {"t": "done", "lost": None},
    )
    # The program's own report claims nothing that counts.
    program = _proc(STARTED, {"t": "test", "i": 1, "status": "passed"})
    out = judge_judged(p, program, judge)
    assert [t["status"] for t in out["tests"]] == ["passed", "failed"]
    assert out["tests"][0]["program_helpers"] == ["poly"]
    assert out["tests"][1]["judged_outside"] is False and "not plain data" in out["tests"][1]["message"]
    crash = {"t": "crash", "exc": "ValueError", "msg": "ValueError: x", "tb": "tb"}
    failed = judge_judged(p, _proc(STARTED, crash), _proc(STARTED, {"t": "program_failed"}, {"t": "done"}))
    assert failed["status"] == "error" and failed["exception_type"] == "ValueError"
    assert judge_judged(p, _proc(STARTED), _proc(exit_code=70))["status"] == "sandbox_error"


def test_stdio_comparator() -> None:
    assert compare_output("1 2\n3  \n\n", "1  2\n3") is None
    assert compare_output("1\n", "1\n2\n") == "output ended after 1 line(s); expected 2"
    assert compare_output("12\n", "1\n") == "line 1: expected '1', got '12'"
    assert compare_output("1\n2\n", "1\n") == "1 extra line(s) after the expected output"
    assert compare_output("", "") is None


def test_results_carry_no_lone_surrogates() -> None:
    dirty = {"message": "a\ud800", "tests": [{"msg": "\udfff"}], "n": 1}
    assert verdict.clean_text(dirty) == {"message": "a\ufffd", "tests": [{"msg": "\ufffd"}], "n": 1}
    assert channel.encode_frame({"s": "\ud800"})  # frames carry them escaped


def test_split_frames_keeps_what_parsed_before_garbage() -> None:
    good = channel.encode_frame({"t": "started"})
    frames, malformed = channel.split_frames(bytearray(good + b"\x00\x00\x00\x03{{{" + good))
    assert (frames, malformed) == ([{"t": "started"}], True)
    frames, malformed = channel.split_frames(bytearray(good + b"\x7f\xff\xff\xff"))
    assert (frames, malformed) == ([{"t": "started"}], True)
    frames, malformed = channel.split_frames(bytearray(good * 5), limit=2)
    assert (len(frames), malformed) == (2, True)


# -- the link -------------------------------------------------------------------------------------


def test_program_objects_refuse_to_be_compared_or_truth_tested() -> None:
    proxy = ProgramObject(None, 1, "Yes")  # type: ignore[arg-type]
    assert proxy == proxy  # identity needs nothing of the program
    for attempt in (
        lambda: proxy == 4,
        lambda: [proxy] == [4],
        lambda: operator.eq(4, proxy),  # the reflected comparison
        lambda: proxy < 1,
        lambda: bool(proxy),
        lambda: 1 in proxy,
        lambda: proxy in [1, 2],
    ):
        with pytest.raises(NotJudged):
            attempt()


def test_program_server_answers_with_data_or_references() -> None:
    class Node:
        def __init__(self, v):
            self.v, self.left = v, None

    def grow(xs):
        xs.append(len(xs))
        return sorted(xs)

    server = ProgramServer({"Node": Node, "grow": grow, "depth": lambda n: 1 + (n.left is not None)})
    node_ref = server.answer({"seq": 1, "op": "global", "name": "Node", "budget": 5})["ok"]
    assert node_ref[0] == "ref"
    root = server.answer(
        {"seq": 2, "op": "call", "ref": node_ref[1], "args": [["int", "0x1"]], "kwargs": {}, "budget": 5}
    )
    assert root["ok"][0] == "ref" and root["ok"][2].endswith("Node")
    leaf = server.answer(
        {"seq": 3, "op": "call", "ref": node_ref[1], "args": [["int", "0x2"]], "kwargs": {}, "budget": 5}
    )
    server.answer(
        {"seq": 4, "op": "setattr", "ref": root["ok"][1], "name": "left", "value": leaf["ok"], "budget": 5}
    )
    depth = server.answer({"seq": 5, "op": "global", "name": "depth", "budget": 5})["ok"]
    got = server.answer(
        {"seq": 6, "op": "call", "ref": depth[1], "args": [root["ok"]], "kwargs": {}, "budget": 5}
    )
    assert got == {"ok": ["int", "0x2"], "seq": 6}
    grow_ref = server.answer({"seq": 7, "op": "global", "name": "grow", "budget": 5})["ok"]
    arg = values.encode([3, 1])
    changed = server.answer(
        {"seq": 8, "op": "call", "ref": grow_ref[1], "args": [arg], "kwargs": {}, "budget": 5}
    )
    assert values.decode(changed["ok"]) == [1, 2, 3] and values.decode(changed["back"]["0"]) == [3, 1, 2]
    raised = server.answer(
        {"seq": 9, "op": "call", "ref": grow_ref[1], "args": [], "kwargs": {}, "budget": 5}
    )
    assert raised["raise"]["exc"] == "TypeError"
    assert server.answer({"seq": 10, "op": "global", "name": "nothing", "budget": 5}) == {
        "missing": True,
        "seq": 10,
    }


def test_candidates_compile_without_the_harness_future_imports() -> None:
    from crucible_sandbox.judging.compile import compile_candidate

    code, syntax = compile_candidate("def f(x: int) -> int:\n    return x\n")
    namespace: dict = {}
    exec(code, namespace)
    assert syntax is None and namespace["f"].__annotations__["x"] is int  # not the string 'int'
    code, syntax = compile_candidate("def f(:\n")
    assert code is None and syntax["t"] == "syntax" and "SyntaxError" in syntax["msg"]
    _, syntax = compile_candidate("def f():\nreturn 1\n")
    assert syntax["exc"] == "IndentationError"


def test_compile_cache_keeps_whole_entries_within_its_bounds(tmp_path) -> None:
    from crucible_sandbox.judging.artifacts import Artifacts

    cache = Artifacts(str(tmp_path), entries=3, max_bytes=2500)
    assert cache.get("a") is None
    for key in "abcd":
        cache.put(key, {"main": key.encode() * 1000})
        time.sleep(0.01)  # distinct modification times: the oldest goes first
    assert cache.get("a") is None and cache.get("b") is None  # 4 entries of 1000 bytes > 2500
    assert cache.get("d") == {"main": b"d" * 1000}
    (tmp_path / "compiled" / "junk").write_bytes(b"not marshal")
    assert cache.get("junk") is None


def test_cell_clock_follows_the_frames_and_bounds_forged_ones() -> None:
    clock = CellClock(count=3, cell_time=1.0, grace=0.5)
    stream = bytearray(channel.encode_frame({"t": "started"}))
    clock.feed(stream, now=0.0)
    assert clock.deadline == float("inf")  # the program before the cells has only the wall time
    stream += channel.encode_frame({"t": "cells"})
    clock.feed(stream, now=10.0)
    assert (clock.pending, clock.deadline) == (0, 11.5)
    assert not clock.expired(11.4) and clock.expired(11.5)
    whole = channel.encode_frame({"t": "cell", "i": 0})
    stream += whole[:3]  # a frame in pieces counts once it is whole
    clock.feed(stream, now=11.0)
    assert clock.pending == 0
    stream += whole[3:]
    clock.feed(stream, now=11.2)
    assert (clock.pending, clock.deadline) == (1, 12.7)
    # A stale, bogus or out-of-range index does not move the clock; a forged later one moves it
    # once, by one cell time, and the indexes it skipped can no longer move it.
    for frame in ({"t": "cell", "i": 0}, {"t": "cell", "i": "1"}, {"t": "cell", "i": 7}, [1]):
        stream += channel.encode_frame(frame)
    clock.feed(stream, now=12.0)
    assert (clock.pending, clock.deadline) == (1, 12.7)
    stream += channel.encode_frame({"t": "cell", "i": 1}) + channel.encode_frame({"t": "cells"})
    clock.feed(stream, now=12.5)
    assert (clock.pending, clock.deadline) == (2, 14.0)
    stream += channel.encode_frame({"t": "cell", "i": 2})
    clock.feed(stream, now=13.0)
    assert (clock.pending, clock.deadline) == (3, float("inf"))  # every cell reported
    broken = CellClock(count=2, cell_time=1.0, grace=0.0)
    garbage = bytearray(channel.encode_frame({"t": "cells"}) + b"\x00\x00\x00\x02{x")
    broken.feed(garbage + channel.encode_frame({"t": "cell", "i": 0}), now=1.0)
    assert (broken.pending, broken.deadline) == (0, 2.0)  # nothing after garbage moves it


def test_cells_after_the_one_the_worker_ended_are_not_run() -> None:
    frames = [{"t": "started"}, {"t": "cells"}] + [{"t": "cell", "i": i, "out": str(i)} for i in (0, 2)]
    proc = ProcessOutcome(frames=frames, killed="timeout", cell_timeout=1)
    cells = judge_cells(proc, 3)
    assert [c["status"] for c in cells] == ["ok", "timeout", "not_run"]
    assert cells[0]["stdout"] == "0" and cells[2]["stdout"] == ""  # a frame past it does not count
    assert verdict.process_status(proc) == "timeout"
