"""The trusted judge: the worker process of each slot, outside every run.

* `worker`: the slot's loop: takes a run from the server, has its zygote's processes run it,
  reads their pipes (capped) and answers with the verdict; it forks nothing per run;
* `compile`: what the worker compiles before a run, so a run's processes parse nothing: the
  candidate (a syntax error costs no process) and the tests (`plan`, kept here to judge by);
* `plan`: which statements form each test, and whether a test is a call on literals (judged
  here) or needs the run's judge process;
* `verdict`: how a run's processes ended, and the verdict of a test suite from it; `output`: the
  verdict of stdin/stdout cases and of runs without tests.

Trusts: the server's requests and its own plans. Does not trust: anything the program's process
wrote (its report, stdout, stderr): once its `started` frame is in, garbage there is a verdict
about the program. The judge process's verdicts are taken (the program's code never enters that
process, see `inrun.judge`), but its report is parsed as untrusted bytes all the same. No code of
a request runs here: the candidate and the tests are compiled, never executed; expected values are
read with `ast.literal_eval`.
"""
