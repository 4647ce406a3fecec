"""Code that executes inside a run's confined processes, forked by the zygote (see `isolation`).

* `harness`: the program's process, the only one that runs the candidate's code. It receives the
  compiled program and, for a call plan, each test's function name and literal arguments: never
  an expected value or the code that computes one. It decides nothing: everything it writes after
  its `started` frame is the program's doing.
* `judge`: the judge's process, for suites that are not calls on literals. It runs the tests and
  never the program, under a uid of its own: the program's values reach it as data and its
  objects as references (`link`); it compares with its own builtins and reports per test.
* `link`: the judge's requests and the program's answers between the two.
* `runtime`: per-test timers, rlimits, exceptions turned into frames (both processes).

Trusts: its spec, sent by the worker. The judge's side does not trust the program's answers
(decoded as data; anything malformed ends the link). A run's file system has none of the
sandbox's files, so all of this is imported by the zygote before any run and imports nothing the
zygote has not loaded (tests/unit/test_sandbox_zygote_imports.py).
"""
