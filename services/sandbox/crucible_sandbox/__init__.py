"""Crucible sandbox service: executes untrusted, model-written Python against tests.

Its code is grouped by the side of a trust boundary it runs on (docs/sandbox.md, "Processes"):

* `server`: the HTTP process. Holds the settings and the API keys; checks requests, caches
  results, admits runs. Trusts its workers' answers; never runs a request's code.
* `judging`: the trusted judge, a worker process per slot, outside every run. Compiles the
  candidate, plans the tests, reads what a run's processes wrote and decides the verdict.
* `isolation`: the zygote and what confines a run (namespaces, a root of its own, Landlock,
  cgroups, uids, rlimits). Trusted, root in the full mode; it forks a run's processes and never
  runs their code itself. Its docstring says what is and is not isolated.
* `inrun`: the code that executes inside a run's confined processes: the program's (where the
  candidate's code runs, so nothing it writes is trusted) and the judge's (the tests, never the
  program).
* `wire`: what crosses the boundaries (frames, values as data, the shapes of the messages), read
  as if a hostile process wrote it.

Imports point one way, `server` -> `judging` -> `isolation` -> `inrun` -> `wire` (a package may
use those after it, never one before; tests/unit/test_sandbox_layout.py checks it). `__main__`
serves the API (`python -m crucible_sandbox`); `demo` runs a small MBPP demo through it.
"""
