"""The HTTP process: routes (`api`), the logic behind them (`service`), `settings`, `metrics` and the
`pool` of worker processes it drives.

Trusts: its workers (their answers are still validated as a `RunResult`; a worker that dies or
answers garbage is restarted and its run answered `sandbox_error`). Does not trust: requests
(validated against the protocol models, sizes capped, test code parsed, limits capped by the
server's maxima). It never runs a request's code and never talks to a run's processes.

It holds the API keys: its memory and `/proc/<pid>/environ` are closed to processes of its own uid
(`isolation.confine.undumpable`), and its workers start with a minimal environment, so the keys
are not even in the memory of the processes that fork runs.
"""
