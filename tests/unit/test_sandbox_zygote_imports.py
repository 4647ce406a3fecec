"""A run's processes must find every module of the sandbox they use already loaded by their zygote.

Runs see a root of their own without the sandbox's files (and run under other uids), so any
import of the sandbox inside a run would fail ("the harness did not start").
"""

from __future__ import annotations

import subprocess
import sys


def test_the_zygote_preloads_what_runs_execute():
    # A fresh interpreter, as the zygote starts: importing the zygote module loads the program's
    # and the judge's code and everything they import.
    modules = ["inrun.harness", "inrun.judge", "inrun.link", "inrun.runtime", "wire.values", "wire.channel"]
    code = (
        "import sys, crucible_sandbox.isolation.zygote\n"
        f"print(all('crucible_sandbox.' + m in sys.modules for m in {modules!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
