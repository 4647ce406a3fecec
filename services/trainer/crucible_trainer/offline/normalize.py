"""Program identity and similarity for candidate sets: what "the same program" means.

Two candidates are duplicates when their code is equal after dropping comments, blank lines and
differences in spacing (Python's tokenizer decides what is a comment; indentation depth is kept,
it is part of the program; code that does not tokenize falls back to collapsing whitespace).
Similarity is the Jaccard index of the two programs' sets of token trigrams: cheap enough for
every pair of K candidates of every problem, and blind to formatting.
"""

from __future__ import annotations

import io
import re
import tokenize

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}


def code_tokens(code: str) -> list[str]:
    """The program's tokens without comments and layout; whitespace-split if it does not tokenize.

    >>> code_tokens("def f(x):  # add one\\n    return x+1\\n")
    ['def', 'f', '(', 'x', ')', ':', 'return', 'x', '+', '1']
    """
    try:
        return [
            t.string
            for t in tokenize.generate_tokens(io.StringIO(code).readline)
            if t.type not in _SKIP and t.string
        ]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.sub(r"#[^\n]*", "", code).split()


def normalize_code(code: str) -> str:
    """A key equal for programs that differ only in comments and whitespace.

    >>> a = normalize_code("def f(x):\\n    # add one\\n    return x + 1\\n")
    >>> a == normalize_code("def f(x):\\n  return x+1")
    True
    """
    if not code.strip():
        return ""
    # Indentation carries meaning in Python: keep one marker per logical line's depth.
    lines = []
    try:
        depth = 0
        for t in tokenize.generate_tokens(io.StringIO(code).readline):
            if t.type == tokenize.INDENT:
                depth += 1
            elif t.type == tokenize.DEDENT:
                depth -= 1
            elif t.type == tokenize.NEWLINE:
                lines.append("\n")
            elif t.type not in _SKIP and t.string:
                if not lines or lines[-1] == "\n":
                    lines.append(">" * depth)
                lines.append(t.string + " ")
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return " ".join(code_tokens(code))
    return "".join(lines).strip()


def trigrams(code: str) -> frozenset[tuple[str, ...]]:
    tokens = code_tokens(code)
    if len(tokens) < 3:
        return frozenset({tuple(tokens)}) if tokens else frozenset()
    return frozenset(tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2))


def similarity(a: frozenset, b: frozenset) -> float:
    """Jaccard index of two trigram sets (1.0 for two empty programs).

    >>> similarity(trigrams("x = 1"), trigrams("x  =  1  # same"))
    1.0
    """
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)
