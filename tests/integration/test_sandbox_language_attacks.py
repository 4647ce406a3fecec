"""Each language's classic attacks, in one batch beside benign runs, in both isolation modes.

Fork and memory bombs, filling the run's directory, reading files outside the run (the service's secrets, the repository's
data, the compile cache), sockets, `ptrace` of the process that reports for the run, signals to
it, forged report frames, and writes to the judge's paths (the compile cache, the repository, the
system). Zero escapes: every hostile run ends in a verdict about it, the benign runs beside it
pass, the service stays healthy, nothing a run wrote appears on the host, and no run process
outlives its run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import SECRET, UID_BASE
from tests.integration.test_sandbox_isolation import _uptime
from tests.servers import spawn

FULL = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "mbpp.jsonl"
WORK_ROOT = "/tmp/crucible-sandbox"
CACHE = f"{WORK_ROOT}/compiled"
MARK = f"crucible-escape-{os.getpid()}"
# Written by hostile runs if they could: none may exist afterwards.
TARGETS = [f"{CACHE}/{MARK}", str(REPO / MARK), f"/usr/lib/{MARK}"]
# Read by hostile runs if they could; a line saying READ is an escape.
SECRETS = ["/etc/shadow", str(DATA), f"{CACHE}/.", "/proc/1/environ"]
CONTAINED = {"timeout", "error", "memory_exceeded", "output_exceeded"}
LIMITS = {"wall_time_s": 3, "test_time_s": 3, "memory_mb": 256}


def _c_strings(items: list[str]) -> str:
    return ", ".join(f'"{p}"' for p in items)


CPP_READ = f"""#include <cstdio>
#include <fcntl.h>
#include <unistd.h>
int main() {{
  const char* paths[] = {{{_c_strings(SECRETS)}}};
  for (const char* p : paths) {{
    int fd = open(p, O_RDONLY);
    char b[64];
    if (fd >= 0 && read(fd, b, sizeof b) > 0) printf("READ %s\\n", p); else printf("denied %s\\n", p);
  }}
  const char* targets[] = {{{_c_strings(TARGETS)}}};
  for (const char* t : targets) {{
    int fd = open(t, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0 && write(fd, "x", 1) == 1) printf("WROTE %s\\n", t); else printf("denied %s\\n", t);
  }}
}}
"""
CPP_NET_PTRACE_KILL = r"""#include <cstdio>
#include <csignal>
#include <cstring>
#include <arpa/inet.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <unistd.h>
int main() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{}; a.sin_family = AF_INET; a.sin_port = htons(6379); a.sin_addr.s_addr = htonl(0x7f000001);
  printf(s >= 0 && connect(s, (sockaddr*)&a, sizeof a) == 0 ? "CONNECTED\n" : "no network\n");
  printf(ptrace(PTRACE_ATTACH, getppid(), 0, 0) == 0 ? "TRACED\n" : "no ptrace\n");
  char frame[] = "\0\0\0\x0c{\"t\":\"done\"}";
  for (int fd = 3; fd < 64; fd++) write(fd, frame, sizeof frame - 1);  // forge the harness's frames
  fflush(stdout);
  kill(getppid(), SIGKILL); kill(-1, SIGKILL);
  return 0;
}
"""
# The compiler is confined like the run: what it may include is what the run may read.
CPP_INCLUDE = f'#include "{DATA}"\n#include "/etc/shadow"\nint main() {{}}\n'
CPP_FORK_BOMB = "#include <unistd.h>\nint main() { for (;;) fork(); }\n"
CPP_MEMORY = "#include <cstdlib>\n#include <cstring>\nint main() { for (;;) { char* p = (char*)malloc(1 << 24); memset(p, 1, 1 << 24); } }\n"
JAVA_MEMORY = (
    "import java.util.*;\npublic class Main { public static void main(String[] a) {\n"
    "  List<byte[]> l = new ArrayList<>(); for (;;) l.add(new byte[1 << 20]); } }\n"
)
JAVA_READ = (
    "import java.nio.file.*;\npublic class Main { public static void main(String[] a) {\n"
    f"  for (String p : new String[]{{{_c_strings(SECRETS)}}}) {{\n"
    '    try { Files.readAllBytes(Path.of(p)); System.out.println("READ " + p); }\n'
    '    catch (Exception e) { System.out.println("denied " + p); } }\n'
    '  try { new java.net.Socket("127.0.0.1", 6379); System.out.println("CONNECTED"); }\n'
    '  catch (Exception e) { System.out.println("no network"); } } }\n'
)
GO_MEMORY = "package main\nfunc main() { var k [][]byte; for { b := make([]byte, 1<<24); for i := range b { b[i] = 1 }; k = append(k, b) } }\n"
GO_READ = (
    'package main\nimport ("fmt"; "net"; "os")\nfunc main() {\n'
    f"  for _, p := range []string{{{_c_strings(SECRETS)}}} {{\n"
    '    if _, err := os.ReadFile(p); err == nil { fmt.Println("READ", p) } else { fmt.Println("denied", p) } }\n'
    f'  if os.WriteFile("{TARGETS[0]}", []byte("x"), 0644) == nil {{ fmt.Println("WROTE") }}\n'
    '  if _, err := net.Dial("tcp", "127.0.0.1:6379"); err == nil { fmt.Println("CONNECTED") } else { fmt.Println("no network") }\n'
    "}\n"
)
RUST_MEMORY = "fn main() { let mut v: Vec<Vec<u8>> = Vec::new(); loop { v.push(vec![1u8; 1 << 24]); } }\n"
RUST_READ = (
    "fn main() {\n"
    f"  for p in [{_c_strings(SECRETS)}] {{\n"
    '    match std::fs::read(p) { Ok(_) => println!("READ {}", p), Err(_) => println!("denied {}", p) } }\n'
    f'  if std::fs::write("{TARGETS[1]}", b"x").is_ok() {{ println!("WROTE"); }}\n'
    '  match std::net::TcpStream::connect("127.0.0.1:6379") { Ok(_) => println!("CONNECTED"), Err(_) => println!("no network") }\n'
    "}\n"
)
NODE_MEMORY = "const a = []; for (;;) a.push(new Array(1 << 20).fill(1));\n"
NODE_READ = (
    "const fs = require('fs');\n"
    f"for (const p of [{_c_strings(SECRETS)}]) {{ try {{ fs.readFileSync(p); console.log('READ ' + p); }} catch (e) {{ console.log('denied ' + p); }} }}\n"
    f"try {{ fs.writeFileSync('{TARGETS[2]}', 'x'); console.log('WROTE'); }} catch (e) {{}}\n"
    "const s = require('net').connect(6379, '127.0.0.1', () => { console.log('CONNECTED'); process.exit(0); });\n"
    "s.on('error', () => { console.log('no network'); process.exit(0); });\n"
)
BASH_READ = (
    "".join(f"head -c1 {p} >/dev/null 2>&1 && echo READ {p} || echo denied {p}\n" for p in SECRETS)
    + "".join(f"echo x 2>/dev/null > {t} && echo WROTE {t}\n" for t in TARGETS)
    + "(exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null && echo CONNECTED || echo no network\n"
    + "kill -9 $PPID 2>/dev/null; echo still here\n"
)
BASH_FORK_BOMB = "f() { f | f & }; f\n"
# The run's directory past the full mode's scratch (a 64 MiB tmpfs of 4096 inodes): by size, and
# by entries. Where it is a directory on the work root's disk, the zygote samples it.
BASH_DISK_FILL = "for i in $(seq 1 13); do head -c 16000000 /dev/zero > f$i || exit 1; done; echo WROTE-ALL\n"
# The same, in files it holds open with no name left (no walk of the directory finds them).
BASH_UNLINKED_FILL = (
    'for i in $(seq 3 15); do eval "exec $i>f$i" && rm f$i && head -c 16000000 /dev/zero >&$i || exit 1; done\n'
    "echo WROTE-ALL\n"
)
# Never more than one 16 MB file at a time, each freed before the next: no sample of what the
# directory holds sees past the scratch, yet 320 MB went to the work root's disk. Where that is
# sampled (Landlock), the kernel's count of what the run wrote ends it all the same; in the full
# mode the scratch tmpfs alone bounds it, and such a run may pass.
BASH_CHURN_FILL = (
    "for i in $(seq 1 20); do exec 3>f && rm f && head -c 16000000 /dev/zero >&3 && exec 3>&- || exit 1; done\n"
    "echo CHURNED\n"
)
BASH_INODE_FILL = "mkdir d; for i in $(seq 1 5000); do : > d/$i || exit 1; done; echo WROTE-ALL\n"

# name -> (language, program, acceptable statuses)
HOSTILE: dict[str, tuple[str, str, set[str]]] = {
    "cpp_read_and_write_outside": ("cpp", CPP_READ, {"passed"}),
    "cpp_network_ptrace_forged_frames_kill": ("cpp", CPP_NET_PTRACE_KILL, {"error"}),
    "cpp_fork_bomb": ("cpp", CPP_FORK_BOMB, CONTAINED),
    "cpp_include_outside_at_compile_time": ("cpp", CPP_INCLUDE, {"syntax_error"}),
    "cpp_memory_bomb": ("cpp", CPP_MEMORY, {"memory_exceeded", "error"}),
    "java_memory_bomb": ("java", JAVA_MEMORY, {"memory_exceeded", "error"}),
    "java_read_outside_and_network": ("java", JAVA_READ, {"passed"}),
    "go_memory_bomb": ("go", GO_MEMORY, {"memory_exceeded", "error"}),
    "go_read_write_network": ("go", GO_READ, {"passed"}),
    "rust_memory_bomb": ("rust", RUST_MEMORY, {"memory_exceeded", "error"}),
    "rust_read_write_network": ("rust", RUST_READ, {"passed"}),
    "node_memory_bomb": ("nodejs", NODE_MEMORY, {"memory_exceeded", "error"}),
    "node_read_write_network": ("nodejs", NODE_READ, {"passed"}),
    "bash_read_write_network_kill": ("bash", BASH_READ, {"error"}),
    # The script itself may end at once (its bomb in the background): what must hold is that no
    # process of it outlives the run (checked below).
    "bash_fork_bomb": ("bash", BASH_FORK_BOMB, CONTAINED | {"passed"}),
    "bash_disk_fill": ("bash", BASH_DISK_FILL, CONTAINED),
    "bash_inode_fill": ("bash", BASH_INODE_FILL, CONTAINED),
    "bash_unlinked_fill": ("bash", BASH_UNLINKED_FILL, CONTAINED),
    "bash_churn_fill": ("bash", BASH_CHURN_FILL, CONTAINED | {"passed"}),  # held to more below
}
BENIGN = [
    {"language": "cpp", "code": '#include <cstdio>\nint main() { puts("benign"); }\n'},
    {"language": "bash", "code": "echo benign\n"},
    {"language": "python", "code": "print('benign')\n"},
]


def _run(lang: str, code: str, mode: str = "") -> dict:
    if lang == "cpp" and mode:  # a program of its own per mode: its compile step runs in that mode too
        code = f"// {mode} {MARK}\n{code}"
    return {"language": lang, "code": code, "tests": {"kind": "run"}, "limits": LIMITS, "use_cache": False}


SLOTS = 2  # of the server below, whose program uids are UID_BASE + 32 and + 33


def _run_processes(started_before: float) -> list[int]:
    """PIDs of this module's server's runs (its program uids) that started before `started_before`
    (seconds since boot); each slot keeps one blank process forked ahead, newer than that."""
    ticks = os.sysconf("SC_CLK_TCK")
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            start = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        except (OSError, IndexError, ValueError):
            continue
        if UID_BASE + 32 <= uid < UID_BASE + 32 + SLOTS and start < started_before:
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module", params=["full", "landlock"])
def sandbox_mode(request):
    # Slots 32+ of this process's uid block: apart from the session's sandbox (slots 0-1).
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": str(SLOTS),
        "CRUCIBLE_SANDBOX_CANARY_SECRET": SECRET,
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE + 32),
        "CRUCIBLE_SANDBOX_MOUNT_NAMESPACE": "true" if request.param == "full" else "false",
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as service:
        yield request.param, service


@pytest.mark.slow
def test_language_attacks_are_contained(sandbox_mode) -> None:
    mode, sandbox = sandbox_mode
    runs, where = [], {}
    for i, (name, (lang, code, _)) in enumerate(HOSTILE.items()):
        where[name] = len(runs)
        runs.append(_run(lang, code, mode))
        runs.append(_run(BENIGN[i % len(BENIGN)]["language"], BENIGN[i % len(BENIGN)]["code"], mode))
    r = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=300)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    for name, (_, _, allowed) in HOSTILE.items():
        got = results[where[name]]
        assert got["status"] in allowed, (
            f"{mode} {name}: {got['status']} {got['message']} {got['stderr'][-500:]}"
        )
        out = got["stdout"]
        # Under Landlock the scratch limit is sampled: a writer may finish before a sample sees it
        # (seen on a busy machine), and is then judged over the limit after the fact.
        late = mode == "landlock" and "fill" in name and got["status"] == "memory_exceeded"
        for escape in ("READ", "CONNECTED", "TRACED") if late else ("READ", "WROTE", "CONNECTED", "TRACED"):
            assert escape not in out, f"{mode} {name}: {out}"
        if "read" in name:
            assert out.count("denied") >= len(SECRETS), f"{mode} {name}: {out}"
    if mode == "landlock":
        churn = results[where["bash_churn_fill"]]
        assert churn["status"] == "memory_exceeded", churn
    included = results[where["cpp_include_outside_at_compile_time"]]
    diagnostics = included["compile"]["stderr"]
    assert "task_id" not in diagnostics and "root:" not in diagnostics, diagnostics  # nothing of either file
    assert "mbpp.jsonl" in diagnostics  # the compiler was refused it
    assert "no ptrace" in results[where["cpp_network_ptrace_forged_frames_kill"]]["stdout"]
    for i, result in enumerate(results):
        if i not in where.values():
            assert result["status"] == "passed" and result["stdout"] == "benign\n", result
    assert httpx.get(f"{sandbox.url}/health").json()["status"] == "ok"
    for target in TARGETS:
        assert not Path(target).exists(), f"{mode}: a run wrote {target}"
    if FULL:
        after_batch = _uptime()
        time.sleep(0.05)
        # Every slot replaces its blank process; none of a run's processes may be left.
        benign = [_run(b["language"], b["code"]) for b in BENIGN]
        httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": benign * 2}, timeout=60)
        assert _run_processes(after_batch) == [], "a run process outlived its run"
