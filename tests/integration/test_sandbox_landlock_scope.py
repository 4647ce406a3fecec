"""Where Landlock lets a run write: beneath its own directory, not beside it in the slot's (and its
judge nowhere).

Without a uid switch (the unprivileged container) a run shares the service's uid, which owns the
slot's directory: only Landlock keeps the run's writes in its own directory, which is removed
after it. Tested here in a forked process that enters a run the way the zygote's program process
does (`Isolation.enter_program`); as root, the file permissions would allow every write, so what
is refused is refused by Landlock.
"""

from __future__ import annotations

import os

import pytest
from crucible_sandbox.isolation import confine, landlock

pytestmark = pytest.mark.skipif(
    landlock.abi(confine._libc) < 1 or os.geteuid() != 0,
    reason="needs Landlock, and root to bypass file permissions",
)

# What the run tries, and whether it must succeed.
WRITES = {"own file": True, "beside, in the slot": False, "a directory in the slot": False, "/dev/null": True}


def _attempt(slot_dir: str, what: str) -> None:
    if what == "a directory in the slot":
        os.mkdir(os.path.join(slot_dir, "outlives-the-run.d"))
        return
    path = {"own file": "mine", "beside, in the slot": os.path.join(slot_dir, "outlives-the-run")}.get(
        what, what
    )
    with open(path, "w") as f:
        f.write("x")


def test_a_run_writes_only_beneath_its_own_directory(tmp_path) -> None:
    slot_dir = str(tmp_path / "slot")
    os.makedirs(slot_dir)
    cfg = confine.IsolationConfig(
        slot=0, work_root=str(tmp_path), want_cgroup=False, want_mount_namespace=False
    )
    caps = confine.Capabilities()
    caps.filesystem = "landlock"
    ruleset = landlock.Ruleset.build(confine._libc, slot_dir)
    assert ruleset is not None
    iso = confine.Isolation(cfg, caps, None, ruleset, slot_dir)
    results = {}
    for who, what in [*(("program", w) for w in WRITES), ("judge", "beside, in the slot")]:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                confine._libc.prctl(confine.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
                if who == "program":
                    iso.enter_program()
                else:
                    iso.enter_judge()
                _attempt(slot_dir, what)
                os._exit(0)
            except PermissionError:
                os._exit(13)
            except BaseException:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        results[who, what] = os.waitstatus_to_exitcode(status)
    ruleset.close()
    want = {("program", what): 0 if allowed else 13 for what, allowed in WRITES.items()}
    assert results == {**want, ("judge", "beside, in the slot"): 13}
    assert all(name.startswith("run-") for name in os.listdir(slot_dir)), os.listdir(slot_dir)
