"""Warm starts for the tests' command-line runs (conftest.run_script and run_train).

On CI's 2-core machine a script's start is most of a tiny CLI run: `import torch` takes about
2 s, and torch._dynamo, which every torch.optim optimizer imports, about 3 s more; a tiny run
itself takes 1 to 2 s. So a zygote, a Python process that has imported the two and nothing else
(no thread started, no tensor made), forks a child for each command. The child is a process of
its own, as `python SCRIPT ARGS` makes one: it takes the command's folder, environment and argv,
writes to its own stdout and stderr (files the caller reads), reseeds what a fresh interpreter
seeds from the OS (random, numpy's global generator), runs the script as __main__ with the
script's folder first on sys.path, and exits through the interpreter's own shutdown, with the
script's status. The zygote waits for it, kills it at the timeout, and reports its status as
subprocess does (-N: killed by signal N).

What the two imports read from the environment (OMP_*, TORCH*, PYTHON*, ...) is the zygote's
environment, so a zygote serves only commands whose environment is the same but for the
variables the repository and pytest set per test (NANOMLM_*, PYTEST_*); another environment gets
a zygote of its own. A zygote runs one command at a time; side-by-side commands get one each.
"""
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ZYGOTE = r"""
import json, os, random, runpy, signal, sys, time
import torch, torch._dynamo

def child(command):
    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    for fd, path in ((0, os.devnull), (1, command["stdout"]), (2, command["stderr"])):
        opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)  # as a fresh interpreter's: block-buffered to a file
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = command["argv"]
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)

for line in sys.stdin:
    command = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(command)  # raises SystemExit (or the script's exception) out of this loop
    deadline = time.monotonic() + command["timeout"]
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    timed_out = not done[0]
    if timed_out:
        os.kill(pid, signal.SIGKILL)
        done = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(done[1]), "timed_out": timed_out}),
          flush=True)
"""
PER_TEST = ("NANOMLM_", "PYTEST_")  # read when the script runs, not by the zygote's imports

_idle: dict[tuple, list[subprocess.Popen]] = {}  # zygotes waiting for a command, by environment
_lock = threading.Lock()


def _key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(PER_TEST)))


def run(argv: list, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python *argv` in cwd with the environment env, as subprocess.run(capture_output=True,
    text=True, timeout=timeout) runs it, forked from a zygote."""
    key = _key(env)
    with _lock:
        idle = _idle.setdefault(key, [])
        while idle and idle[-1].poll() is not None:
            idle.pop()
        zygote = idle.pop() if idle else subprocess.Popen(
            [sys.executable, "-c", ZYGOTE], cwd="/", env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        command = {"argv": argv, "cwd": str(cwd), "env": env, "timeout": timeout,
                   "stdout": str(out), "stderr": str(err)}
        zygote.stdin.write(json.dumps(command) + "\n")
        zygote.stdin.flush()
        said = zygote.stdout.readline()  # the child's status
        if not said:
            raise RuntimeError(f"the warm interpreter for {argv[0]} died (exit {zygote.wait()}); "
                               f"its error is on the tests' stderr")
        reply = json.loads(said)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    with _lock:
        _idle[key].append(zygote)
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *argv], reply["status"], stdout, stderr)


def stop() -> None:
    """End the zygotes (at the end of the tests)."""
    with _lock:
        for zygote in [z for idle in _idle.values() for z in idle]:
            zygote.stdin.close()
            zygote.wait()
        _idle.clear()
