"""A run process must find every module it may import already loaded by its zygote.

Runs see a private /tmp and run under another uid, so a checkout under /tmp (CI clones there) or an
install the run's uid cannot read makes any import inside a run fail ("the harness did not start").
"""

from __future__ import annotations

import subprocess
import sys


def test_the_zygote_preloads_the_planner():
    # A fresh interpreter, as the zygote starts: importing the zygote module loads the planner
    # that a suite with in-process comparisons needs inside the run.
    code = "import sys, crucible_sandbox.zygote; print('crucible_sandbox.plan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
