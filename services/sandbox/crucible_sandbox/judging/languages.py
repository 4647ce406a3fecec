"""The languages beside Python: how a program in each is compiled and run inside a run's processes.

Python runs in the program's process itself (see `inrun.harness`). Every other language runs as a
command the program's process starts (see `inrun.command`), in the same isolation and under the
same limits. A compiled language has a compile step of its own: the compiler is a command too, run
by a process of its own with the compile limits (`compile_time_s`, `compile_memory_mb`); the files
it leaves in `out/` are the artifact, cached by a hash of the source, the language, the command
and the compile limits (`judging.artifacts`). A run then gets the artifact: an executable is started from memory
(`memfd_create` + `execveat`, since the scratch directories are mounted `noexec`); Java's classes
are written to the run's directory.

Toolchains are found on the runs' `PATH` (`/usr/local/bin:/usr/bin:/bin`) from Debian packages
(`make toolchains`); `available()` says which are present and `GET /health` lists them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import TypedDict

RUN_PATH = "/usr/local/bin:/usr/bin:/bin"
# Runtimes that reserve address space far beyond what they use (the JVM's heap and class space,
# V8's code range, Go's page summaries) get this much on top of the run's memory as their
# address-space limit; their resident memory is still held by the run's memory limit.
RESERVE_MB = 1024
_ANY_CLASS = re.compile(r"\bclass\s+([A-Za-z_$][A-Za-z0-9_$]*)")
_JAVA_CLASS = re.compile(r"public\s+(?:final\s+|abstract\s+)*class\s+([A-Za-z_$][A-Za-z0-9_$]*)")
# The JVM: one GC thread, one JIT thread, small reserved spaces, no shared perf file in /tmp.
_JVM = [
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:CICompilerCount=1",
    "-XX:ReservedCodeCacheSize=32m",
    "-XX:CompressedClassSpaceSize=32m",
    "-XX:MaxMetaspaceSize=128m",
    "-XX:-UsePerfData",
    "-Xss16m",
]


class Language(TypedDict):
    name: str
    aliases: list[str]
    tool: str  # the executable whose presence makes the language available
    package: str  # the Debian package that provides it
    source: str  # the file the program is written to ({cls}: Java's public class)
    compile: list[str] | None  # the compile command ({src}, {cls}), None for interpreted languages
    run: list[str]  # the run command; "{exe}": the compiled executable, started from memory
    reserve_mb: int  # added to the address-space limit (see RESERVE_MB)
    env: dict[str, str]


LANGUAGES: dict[str, Language] = {
    "cpp": {
        "name": "cpp",
        "aliases": ["c++"],
        "tool": "g++",
        "package": "g++",
        "source": "main.cpp",
        "compile": ["g++", "-std=gnu++17", "-O2", "-pipe", "-o", "out/main", "{src}"],
        "run": ["{exe}"],
        "reserve_mb": 0,
        "env": {},
    },
    "java": {
        "name": "java",
        "aliases": [],
        "tool": "javac",
        "package": "openjdk-17-jdk-headless",
        "source": "{cls}.java",
        "compile": [
            "javac",
            *(f"-J{o}" for o in _JVM[:3]),
            "-J-Xmx512m",
            "-encoding",
            "UTF-8",
            "-d",
            "out",
            "{src}",
        ],
        "run": ["java", *_JVM, "-Xmx{heap}m", "-cp", ".", "{cls}"],
        "reserve_mb": RESERVE_MB,
        "env": {},
    },
    "nodejs": {
        "name": "nodejs",
        "aliases": ["javascript", "js", "node"],
        "tool": "node",
        "package": "nodejs",
        "source": "main.js",
        "compile": None,
        "run": ["node", "--max-old-space-size={heap}", "{src}"],
        "reserve_mb": RESERVE_MB,
        # No OpenSSL configuration file to read (where Landlock denies /etc/ssl, a denied read is fatal).
        "env": {"OPENSSL_CONF": "/dev/null"},
    },
    "go": {
        "name": "go",
        "aliases": ["golang"],
        "tool": "go",
        "package": "golang-go",
        "source": "main.go",
        "compile": ["go", "build", "-o", "out/main", "{src}"],
        "run": ["{exe}"],
        "reserve_mb": RESERVE_MB,
        "env": {
            "GOCACHE": "{tmp}/.gocache",
            "GOPATH": "{tmp}/.gopath",
            "GO111MODULE": "off",
            "CGO_ENABLED": "0",
            "GOTOOLCHAIN": "local",
        },
    },
    "rust": {
        "name": "rust",
        "aliases": [],
        "tool": "rustc",
        "package": "rustc",
        "source": "main.rs",
        "compile": [
            "rustc",
            "--edition",
            "2021",
            "-C",
            "opt-level=2",
            "-C",
            "strip=symbols",
            "-o",
            "out/main",
            "{src}",
        ],
        "run": ["{exe}"],
        "reserve_mb": 0,
        "env": {},
    },
    "bash": {
        "name": "bash",
        "aliases": ["sh"],
        "tool": "bash",
        "package": "bash",
        "source": "main.sh",
        "compile": None,
        "run": ["bash", "{src}"],
        "reserve_mb": 0,
        "env": {},
    },
}
_BY_ALIAS = {alias: lang for lang in LANGUAGES.values() for alias in [lang["name"], *lang["aliases"]]}


def resolve(name: str) -> Language | None:
    """The language a request names (`cpp`, `c++`, `javascript`, ...), or None."""
    return _BY_ALIAS.get(name.lower())


def tool_path(lang: Language) -> str | None:
    return shutil.which(lang["tool"], path=RUN_PATH)


def available() -> list[str]:
    """Languages whose toolchain is installed, Python first."""
    return ["python", *(name for name, lang in LANGUAGES.items() if tool_path(lang))]


def java_class(source: str) -> str:
    """The class to run: the public one (the file must be named after it), else the class that
    declares `main`, else `Main`.

    >>> java_class("public final class Solution { public static void main(String[] a) {} }")
    'Solution'
    >>> java_class("class Helper {} class Prog { public static void main(String[] a) {} }")
    'Prog'
    """
    found = _JAVA_CLASS.search(source)
    if found:
        return found.group(1)
    main = source.find("static void main")
    classes = [(m.start(), m.group(1)) for m in _ANY_CLASS.finditer(source)]
    before = [name for position, name in classes if main < 0 or position < main]
    return before[-1] if before else "Main"


def expand(argv: list[str], source_name: str, cls: str, heap_mb: int) -> list[str]:
    return [a.format(src=source_name, cls=cls, heap=heap_mb, exe="{exe}") for a in argv]


def artifact_key(lang: Language, source: str, limits: tuple[float, int] = (0.0, 0), scope: str = "") -> str:
    """The compile cache's key: source, language, the exact compile command, the toolchain's
    binary (its real path and modification time: an upgraded compiler misses the cache) and the
    compile step's limits (seconds, MiB): a program compiled under generous limits is not served
    to a request whose limits it would have exceeded, and a compile cannot make its artifact
    depend on limits (`include_str!("/proc/self/limits")`) that another request did not ask for;
    and the cache scope (the tenant): one tenant's compile is never another's cache hit."""
    tool = tool_path(lang) or ""
    try:
        real = os.path.realpath(tool)
        stamp = [real, os.stat(real).st_mtime_ns]
    except OSError:
        stamp = [tool, 0]
    text = json.dumps([lang["name"], lang["compile"], lang["env"], stamp, list(limits), source, scope])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def environment(lang: Language) -> dict[str, str]:
    """The command's environment; "{tmp}" is the run's scratch directory (see `inrun.command`)."""
    return {"PATH": RUN_PATH, "HOME": "{tmp}", "TMPDIR": "{tmp}", "LANG": "C.UTF-8", **lang["env"]}


def heap_mb(memory_mb: int) -> int:
    """The managed heap of the JVM and V8: most of the run's memory, the rest for the runtime itself."""
    return max(16, memory_mb - min(memory_mb // 4, 128))


# A program per language that reads two integers and prints their sum: the smoke test of each
# toolchain (bench/sandbox.py languages, the deployment check in deploy/compose_test.py).
SUM_OF_TWO = {
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "cpp": "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n",
    "java": (
        "import java.util.*;\npublic class Main { public static void main(String[] x) {\n"
        "  Scanner s = new Scanner(System.in); System.out.println(s.nextLong() + s.nextLong()); } }\n"
    ),
    "nodejs": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(a + b);\n",
    "go": 'package main\nimport "fmt"\nfunc main() { var a, b int64; fmt.Scan(&a, &b); fmt.Println(a + b) }\n',
    "rust": (
        "use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();\n"
        '  let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect(); println!("{}", v[0] + v[1]); }\n'
    ),
    "bash": "read a b\necho $((a + b))\n",
}
