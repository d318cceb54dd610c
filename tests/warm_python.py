"""Warm starts for the tests' Python commands: conftest.run_script's, and those the scripts and
gpu_check.sh start in turn (bench.py and study.py run train.py, gpu_check.sh runs $PYTHON).

On CI's 2-core machine a script's start is most of a tiny CLI run: `import torch` takes about
2 s, and torch._dynamo, which every torch.optim optimizer imports, about 3 s more; a tiny run
itself takes 1 to 2 s. So a zygote, a Python process that has imported the two and nothing else
(no thread started, no tensor made), forks a child for each command.

`launcher()` writes an executable that takes the place of `python` (the tests give it as
$PYTHON, and as sys.executable in every warm child, so that a script's own `python SCRIPT`
is warm too). `launcher SCRIPT.py ARGS` sends its folder, environment, argv and its stdin,
stdout and stderr themselves to the zygote of its environment (started on first use) and waits.
The child takes them, reseeds what a fresh interpreter seeds from the OS (random, numpy's
global generator), runs the script as __main__ with the script's folder first on sys.path and
exits through the interpreter's own shutdown; the launcher exits with the child's status (or
dies by its signal). A signal to the launcher is passed on to the child; a launcher killed
outright (SIGKILL, a timeout) takes the child with it. Anything else (`-c`, `-m`, `-u`, a
script of the Python installation such as inductor's compile workers, which are handed more
file descriptors than the three) is `python ARGS` itself, cold.

What the imports read from the environment (OMP_*, TORCH*, PYTHON*, ...) is the zygote's
environment, so a zygote serves only commands whose environment is the same but for the
variables the repository, pytest, bash, gpu_check.sh and torchrun (each worker's rank and
rendezvous) set per command (PER_COMMAND); another environment gets a zygote of its own. A
script can tell a warm start in two ways, neither of which changes what the repository's
scripts do: torch is in sys.modules before the script imports it (run_folder.repo_sources reads
only the repository's own modules there, which the zygote has not imported), and
sys.executable is the launcher (bench.py and study.py use it only to start python).
"""
import hashlib
import json
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ZYGOTE = r"""
import io, json, os, random, runpy, select, signal, socket, sys
path, owner = sys.argv[1], int(sys.argv[2])
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    listener.bind(path)  # before the imports: a launcher that comes meanwhile waits for them
except OSError:
    sys.exit(0)  # another launcher's zygote serves this environment
listener.listen(64)
with open(path + ".pid", "w") as f:
    f.write(str(os.getpid()))
import torch, torch._dynamo

def stdio(fd):  # as a fresh interpreter makes them (-u: written through; a tty: by lines)
    if fd == 0:
        return open(0, closefd=False)
    raw = io.FileIO(fd, "w", closefd=False)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                            errors="backslashreplace" if fd == 2 else "strict",
                            line_buffering=not unbuffered and (fd == 2 or raw.isatty()),
                            write_through=unbuffered)

def child(command, fds):
    os.chdir(command["cwd"])
    os.environ.clear()
    os.environ.update(command["env"])
    for fd, given in enumerate(fds):
        os.dup2(given, fd)
        os.close(given)
    sys.stdin, sys.stdout, sys.stderr = map(stdio, (0, 1, 2))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv, sys.executable = command["argv"], command["executable"]
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    runpy.run_path(os.path.abspath(sys.argv[0]), run_name="__main__")  # __file__ absolute
    sys.exit(0)

def manage(conn):  # one command: its child, then its status to the launcher
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    pid = os.fork()
    if pid == 0:
        conn.close()
        child(json.loads(message), fds)  # raises SystemExit (or the script's exception)
    for fd in fds:
        os.close(fd)
    conn.send(str(pid).encode())
    ended = os.pidfd_open(pid)
    while True:
        ready = select.select([conn, ended], [], [])[0]
        if ended in ready:
            break
        if not conn.recv(16):  # the launcher is gone (killed): its command goes with it
            os.kill(pid, signal.SIGKILL)
            break
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        conn.send(str(status).encode())
    except OSError:
        pass
    os._exit(0)

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # each command's manager reaps itself
listener.settimeout(5)
while True:
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:  # the tests are over (killed, say): so is the zygote
            os.unlink(path)
            sys.exit(0)
        continue
    if os.fork() == 0:
        listener.close()
        manage(conn)
    conn.close()
"""
# variables read when the script runs, not by the zygote's imports: set per command (torchrun's
# too: each worker's rank, its rendezvous), by name or by prefix
PER_COMMAND = ("PWD", "OLDPWD", "SHLVL", "_", "OUT", "BUDGET", "SCALE", "GPU_DATA", "VOCAB_SIZE",
               "PYTHON", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
PER_COMMAND_PREFIXES = ("NANOMLM_", "PYTEST_", "TORCHELASTIC_")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
LAUNCHER = """#!{python} -S
import sys
sys.path.insert(0, {tests!r})
import warm_python
warm_python.launch({python!r}, {installed!r}, {folder!r}, {owner}, sys.argv)
"""


def per_command(name: str) -> bool:
    return name in PER_COMMAND or name.startswith(PER_COMMAND_PREFIXES)


def launch(python: str, installed: tuple, folder: str, owner: int, argv: list) -> None:
    """The launcher's body: argv[1:] run warm as `python argv[1:]` would run it, or cold
    (installed: the Python installation's folders, venv and site-packages included)."""
    args = argv[1:]
    script = os.path.realpath(args[0]) if args and args[0].endswith(".py") else ""
    if not os.path.isfile(script) or script.startswith(installed):
        os.execv(python, [python, *args])
    env = dict(os.environ)
    key = json.dumps(sorted((k, v) for k, v in env.items() if not per_command(k)))
    path = os.path.join(folder, hashlib.sha1(key.encode()).hexdigest()[:16] + ".sock")
    if not os.path.exists(path):
        with open(path + ".log", "a") as log:
            subprocess.Popen([python, "-c", ZYGOTE, path, str(owner)], cwd="/", env=env,
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    deadline = time.monotonic() + 60
    while True:
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:  # no zygote came: see its log
                os.execv(python, [python, *args])
            time.sleep(0.02)
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # until the child's pid is known
    command = {"argv": args, "cwd": os.getcwd(), "env": env, "executable": argv[0]}
    socket.send_fds(conn, [json.dumps(command).encode()], [0, 1, 2])
    said = conn.recv(16)
    if said:
        pid = int(said)
        for s in FORWARDED:
            signal.signal(s, lambda n, _: forward(pid, n))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        said = conn.recv(16)
    if not said:
        sys.exit(f"warm_python: the zygote for {args[0]} died; its log: {path}.log")
    status = int(said)
    if status < 0:  # the child died by a signal: so does the launcher
        if -status != signal.SIGKILL:
            signal.signal(-status, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-status])
        os.kill(os.getpid(), -status)
    os._exit(status)


def forward(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it has just ended: its status is on its way
        pass


_folder: Path | None = None


def launcher() -> Path:
    """The executable that takes the place of `python` in the tests, made on first use for this
    process; its zygotes end with this process (stop(), or within 5 s of its death)."""
    global _folder
    if _folder is None:
        _folder = Path(tempfile.mkdtemp(prefix="warm_python-"))
        exe = _folder / "python"
        # the launcher runs with -S, where sys.prefix is not the venv's: found here
        installed = tuple({os.path.realpath(p) + os.sep for p in (
            sys.prefix, sys.base_prefix, *site.getsitepackages(), site.getusersitepackages())})
        exe.write_text(LAUNCHER.format(python=sys.executable, tests=str(Path(__file__).parent),
                                       installed=installed, folder=str(_folder),
                                       owner=os.getpid()))
        exe.chmod(0o755)
    return _folder / "python"


def run(argv: list, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python *argv` in cwd with the environment env, as subprocess.run(capture_output=True,
    text=True, timeout=timeout) runs it, forked from a zygote."""
    return subprocess.run([str(launcher()), *map(str, argv)], cwd=cwd, env=env, text=True,
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)


def stop() -> None:
    """End the zygotes (at the end of the tests)."""
    global _folder
    if _folder is None:
        return
    for pid in _folder.glob("*.sock.pid"):
        try:
            os.kill(int(pid.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
    shutil.rmtree(_folder, ignore_errors=True)
    _folder = None
