"""What the model sees, and how its answer becomes a program.

Two prompt styles:

* **chat** (`build_messages`, instruct models): a short system message and the problem, with
  MBPP's one shown test so the function name is known, asking for a ```python block.
* **completion** (`build_completion_prompt`, base models): MBPP and stdin/stdout problems as a
  docstring the model answers with code; HumanEval's prompt as is, for the model to continue.

`answer_to_code` turns a completion into the candidate code the sandbox runs (together with the
task's preamble, see `Task.program`); `stop_sequences` are the stops a completion-style request
should use.
"""

from __future__ import annotations

import re

from .extract import defines, extract_code, sanitize
from .task import Task

SYSTEM = "You are an expert Python programmer. Answer with the complete code in one ```python block."
# Other languages (stdin/stdout problems): the name told to the model and the fence tag it writes.
LANGUAGE_NAMES = {
    "cpp": ("C++", "cpp"),
    "java": ("Java", "java"),
    "nodejs": ("JavaScript (Node.js)", "javascript"),
    "go": ("Go", "go"),
    "rust": ("Rust", "rust"),
    "bash": ("Bash", "bash"),
}


def _language(task: Task) -> tuple[str, str]:
    return LANGUAGE_NAMES.get(task.language, ("Python", "python"))


# Where a base model's answer is over (bigcode-evaluation-harness conventions).
FUNCTION_STOPS = ["\nclass", "\nassert", '\n"""', "\nprint", "\nif __name__", "\n```", "\n<|"]
CONTINUATION_STOPS = ["\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```", "\n<|"]
PROGRAM_STOPS = ['\n"""', "\n```", "\n<|"]


def build_messages(task: Task) -> list[dict[str, str]]:
    """Chat messages asking an instruct model to solve `task`."""
    name, tag = _language(task)
    system = SYSTEM if tag == "python" else SYSTEM.replace("Python", name).replace("```python", f"```{tag}")
    return [{"role": "system", "content": system}, {"role": "user", "content": problem_statement(task)}]


def problem_statement(task: Task) -> str:
    """The problem as told to a chat model (also the start of the refinement prompt)."""
    if task.prompt_is_code:
        return (
            "Complete the following Python function. Write the whole function, signature included.\n\n"
            f"```python\n{task.prompt.strip()}\n```"
        )
    if task.tests.kind == "stdio":
        return (
            f"{task.prompt.strip()}\n\n"
            f"Write a complete {_language(task)[0]} program that reads the input from standard input and prints "
            "the answer to standard output."
        )
    text = task.prompt.strip()
    starter = str(task.metadata.get("starter_code") or "").rstrip()
    if task.shown_test:
        text += f"\nYour code should pass this test:\n\n```python\n{task.shown_test.strip()}\n```"
    elif starter:
        # TACO / APPS call-based problems: the signature (often `class Solution`) to complete.
        text += f"\nComplete this code:\n\n```python\n{starter}\n```"
    elif task.entry_point:
        text += f"\nThe function must be called `{task.entry_point}`."
    return text


def build_completion_prompt(task: Task) -> str:
    """A plain-text prompt for base models; the model's continuation is the code."""
    if task.prompt_is_code:
        return task.prompt
    if task.tests.kind == "stdio" and task.language != "python":
        name, tag = _language(task)
        return f"{task.prompt.strip()}\nA {name} program that reads standard input and writes standard output:\n```{tag}\n"
    if task.tests.kind == "stdio":
        return f'"""\n{task.prompt.strip()}\nRead from standard input and write to standard output.\n"""\n'
    shown = f"\n{task.shown_test.strip()}" if task.shown_test else ""
    return f'"""\n{task.prompt.strip()}{shown}\n"""\n'


def stop_sequences(task: Task, chat: bool) -> list[str] | None:
    """Default stop strings for a request about `task` (chat models stop on their own)."""
    if chat:
        return None
    if task.prompt_is_code:
        return CONTINUATION_STOPS
    if task.tests.kind == "stdio":
        return PROGRAM_STOPS
    return FUNCTION_STOPS


def answer_to_code(task: Task, text: str, *, chat: bool, clean: bool = True) -> str:
    """The candidate code in a model's answer (`chat`: a chat reply; else a completion of the prompt).

    `clean` drops top-level example calls and asserts (`sanitize`) from function answers; stdin/stdout
    programs are never cleaned. Returns "" when the answer holds no code.
    """
    if task.language != "python":
        return other_language_code(text, chat=chat)
    if not chat and task.prompt_is_code:
        # The continuation ends where a code fence or a stop string starts, even at its very start
        # (a server only sees a stop string once it follows generated text).
        body = re.split(
            r"^```|" + "|".join(re.escape(s) for s in CONTINUATION_STOPS), text, maxsplit=1, flags=re.M
        )[0]
        return task.prompt + body if body.strip() else ""
    code = extract_code(text, task.entry_point)
    body_only = code.startswith((" ", "\t")) and not defines(code, task.entry_point or "")
    if chat and task.prompt_is_code and task.entry_point and body_only:
        # A reply holding only the function's body: it continues the prompt.
        code = task.prompt + code
    if clean and task.tests.kind != "stdio":
        code = sanitize(code)
    return code if code.strip() else ""


def other_language_code(text: str, *, chat: bool) -> str:
    """A program in another language: the first fenced block of a chat answer (any tag), else the
    text itself; a completion ends at its closing fence (the prompt opened the block).

    >>> other_language_code("Here:\\n```cpp\\nint main() {}\\n```\\nDone.", chat=True)
    'int main() {}'
    """
    if not chat:
        return text.split("```", 1)[0].strip("\n") if text.strip() else ""
    match = re.search(r"^\s*```[\w+#.-]*[ \t]*\n(.*?)(?:^\s*```|\Z)", text, flags=re.M | re.S)
    code = match.group(1) if match else text
    return code.strip("\n") if code.strip() else ""
