"""Prompt builders, code extraction and answer-to-code for every prompt style."""

from __future__ import annotations

import ast

import pytest
from crucible_shared.sandbox import StdioCase, StdioTests
from crucible_trainer.tasks import (
    DataSpec,
    Task,
    answer_to_code,
    build_completion_prompt,
    build_messages,
    extract_code,
    load_tasks,
    sanitize,
    stop_sequences,
)


@pytest.fixture(scope="module")
def mbpp_task() -> Task:
    return load_tasks(DataSpec(ids=[11]))[0]


@pytest.fixture(scope="module")
def humaneval_task() -> Task:
    return load_tasks(DataSpec(dataset="humaneval", ids=[10]))[0]


@pytest.fixture(scope="module")
def stdio_task() -> Task:
    tests = StdioTests(cases=[StdioCase(input="1 2\n", output="3\n")])
    return Task(task_id="sum", dataset="stdio", prompt="Print the sum of two integers.", tests=tests)


# --- prompts -------------------------------------------------------------------------------------


def test_chat_prompt_shows_one_mbpp_test(mbpp_task: Task) -> None:
    system, user = build_messages(mbpp_task)
    assert system["role"] == "system" and user["role"] == "user"
    assert mbpp_task.prompt in user["content"]
    assert mbpp_task.shown_test in user["content"]
    # Only the shown test: the others stay hidden.
    assert all(t not in user["content"] for t in mbpp_task.tests.asserts[1:])


def test_chat_prompt_for_humaneval_holds_the_signature(humaneval_task: Task) -> None:
    user = build_messages(humaneval_task)[1]["content"]
    assert "def make_palindrome(string: str) -> str:" in user
    assert "```python" in user


def test_chat_prompt_for_stdio_asks_for_a_program(stdio_task: Task) -> None:
    assert "standard input" in build_messages(stdio_task)[1]["content"]


def test_completion_prompts(mbpp_task: Task, humaneval_task: Task, stdio_task: Task) -> None:
    mbpp = build_completion_prompt(mbpp_task)
    assert mbpp.startswith('"""\n') and mbpp.endswith('"""\n') and mbpp_task.shown_test in mbpp
    assert build_completion_prompt(humaneval_task) == humaneval_task.prompt
    assert "standard input" in build_completion_prompt(stdio_task)
    assert stop_sequences(mbpp_task, chat=True) is None
    assert "\ndef" in stop_sequences(humaneval_task, chat=False)
    assert "\ndef" not in stop_sequences(mbpp_task, chat=False)


# --- extraction ----------------------------------------------------------------------------------

CHATTY = """Sure! Here is the function:

```python
def add(a, b):
    return a + b
```

This function adds two numbers. Example usage:

```python
print(add(1, 2))  # 3
```
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (CHATTY, "def add(a, b):\n    return a + b"),
        ("```py\nx = 1\n```", "x = 1"),
        ("```\ndef f():\n    return 1\n```", "def f():\n    return 1"),
        # A shell block first, then the Python one.
        ("Run:\n```bash\npip install x\n```\n```python\ndef f():\n    pass\n```", "def f():\n    pass"),
        # Cut off by max_tokens: no closing fence.
        ("```python\ndef f(x):\n    return [", "def f(x):\n    return ["),
        # <code> tags, also around a fenced block.
        (
            "<analysis>off by one</analysis>\n<code>\ndef f():\n    return 2\n</code>",
            "def f():\n    return 2",
        ),
        ("<code>```python\ndef f():\n    return 3\n```</code>", "def f():\n    return 3"),
        # Raw code with chatter before and after.
        (
            "Here is my answer.\ndef f(x):\n    return x * 2\nThis doubles x.",
            "def f(x):\n    return x * 2",
        ),
        ("import math\ndef f():\n    return math.pi", "import math\ndef f():\n    return math.pi"),
        ("I do not know.", ""),
        ("for _ in range(int(input())):\n    print(1)", "for _ in range(int(input())):\n    print(1)"),
    ],
)
def test_extract_code(text: str, expected: str) -> None:
    assert extract_code(text) == expected


def test_extract_code_prefers_the_block_defining_the_entry_point() -> None:
    text = "```python\ndef helper():\n    pass\n```\n```python\ndef solve():\n    return helper()\n```"
    assert extract_code(text, entry_point="solve").startswith("def solve")
    assert extract_code(text).startswith("def helper")


def test_sanitize_keeps_definitions_only() -> None:
    code = (
        "import re\nLIMIT = 10\n\n@staticmethod\ndef f(x):\n    return x\n\nclass A:\n    pass\n\n"
        "print(f(1))\nassert f(2) == 3\nif __name__ == '__main__':\n    f(3)\nf(4)"
    )
    cleaned = sanitize(code)
    assert (
        cleaned == "import re\n\nLIMIT = 10\n\n@staticmethod\ndef f(x):\n    return x\n\nclass A:\n    pass"
    )
    assert sanitize("def f(:\n  pass") == "def f(:\n  pass"  # a syntax error stays visible


def test_answer_to_code_per_style(mbpp_task: Task, humaneval_task: Task, stdio_task: Task) -> None:
    reply = "```python\ndef remove_Occ(s, ch):\n    return s\n\nassert remove_Occ('a', 'a') == ''\n```"
    assert answer_to_code(mbpp_task, reply, chat=True) == "def remove_Occ(s, ch):\n    return s"
    assert "assert" in answer_to_code(mbpp_task, reply, chat=True, clean=False)
    # A base model continuing HumanEval's prompt.
    body = "    return string + string[::-1]\n"
    assert answer_to_code(humaneval_task, body, chat=False) == humaneval_task.prompt + body
    # A chat reply holding only the body also continues the prompt.
    continued = answer_to_code(humaneval_task, f"```python\n{body}```", chat=True)
    assert "def make_palindrome" in continued and continued.rstrip().endswith(body.strip())
    # stdin/stdout programs keep their top level.
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert answer_to_code(stdio_task, program, chat=True) == "a, b = map(int, input().split())\nprint(a + b)"
    assert answer_to_code(mbpp_task, "I cannot help with that.", chat=True) == ""


def test_humaneval_chat_answer_gets_the_preamble(humaneval_task: Task) -> None:
    code = answer_to_code(
        humaneval_task, "```python\ndef make_palindrome(string):\n    return string\n```", chat=True
    )
    program = humaneval_task.program(code)
    ast.parse(program)
    assert "def is_palindrome" in program


def test_sanitize_drops_assignments_that_call_the_solution() -> None:
    code = "import re\nPATTERN = re.compile('a+')\n\ndef f(x):\n    return x\n\nf = f([1, 2])\nresult = f(3)"
    assert sanitize(code) == "import re\n\nPATTERN = re.compile('a+')\n\ndef f(x):\n    return x"


def test_sanitize_and_extraction_count_lines_as_python_does() -> None:
    """A form feed (whitespace to Python) or U+2028 inside a string is no line end to the parser:
    the lines kept are the ones its line numbers name, and the program still runs the same."""
    code = 'import os\n\x0c\ndef f():\n    return "a\u2028b"\n\nprint(f())'
    kept = sanitize(code)
    assert kept == 'import os\n\ndef f():\n    return "a\u2028b"'
    namespace: dict = {}
    exec(compile(kept, "<answer>", "exec"), namespace)
    assert namespace["f"]() == "a\u2028b"
    assert extract_code(f"```python\n{code}\n```") == code


def test_continuation_stops_at_a_fence_or_stop_string(humaneval_task: Task) -> None:
    body = "    return string\n"
    fenced = answer_to_code(humaneval_task, body + "```\nThis returns it.", chat=False)
    assert fenced.rstrip() == (humaneval_task.prompt + body).rstrip()
    assert (
        answer_to_code(humaneval_task, body + "\ndef other():\n    pass", chat=False)
        == humaneval_task.prompt + body
    )
    assert answer_to_code(humaneval_task, "```\n\nThe function returns...", chat=False) == ""
    assert answer_to_code(humaneval_task, "", chat=False) == ""


def test_model_code_with_bad_escapes_parses_without_warnings() -> None:
    """Sampled programs are full of invalid escape sequences; parsing them must stay quiet."""
    import warnings

    from crucible_trainer.tasks.extract import extract_code, sanitize

    code = 'import re\ndef f(s):\n    return re.findall("\\d+", s)\nprint(f("a1"))\n'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "print" not in sanitize(code)
        assert extract_code(f"```python\n{code}```").startswith("import re")
