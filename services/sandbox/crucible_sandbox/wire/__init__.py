"""What crosses the sandbox's boundaries: length-prefixed frames and specs (`channel`), values as
data (`values`), and the shapes of the messages between the sandbox's own processes (`messages`,
types only: a run's processes never load it).

Where the writer may be hostile (a run's program, writing its report or answering the judge), the
readers here are total: malformed input is rejected with ValueError and nothing else, sizes and
depths are capped, and types are checked exactly, so no code of a value's own runs while it is
read. Nothing here imports the rest of the sandbox: every process loads it, a run's included.
"""
