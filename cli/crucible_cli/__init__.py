"""The `crucible` command line: a slim package (no torch, transformers or peft).

Submitting and following jobs, listing, cancelling and retrying them, and running programs in
the sandbox talk HTTP only, so a laptop can drive a GPU cluster with `pip install crucible-cli`.
Commands that run the services or the trainer here (`up`, `demo`, `train --local`, local
`eval`) import them when they run and say what to install when they are missing.
"""
