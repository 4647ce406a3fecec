"""What crosses the sandbox's boundaries: length-prefixed frames and specs (`channel`), values as
data (`values`).

Where the writer may be hostile (a run's program, or the judge it talks to), the readers here
are total: malformed input is rejected with ValueError and nothing else, sizes and depths are
capped, and types are checked exactly, so no code of a value's own runs while it is read. Nothing
here imports the rest of the sandbox: every process loads it, a run's included.
"""
