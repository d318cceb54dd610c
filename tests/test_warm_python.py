"""warm_python.py, which the tests' command-line runs go through: a warm run is the cold run
(`python SCRIPT ARGS` in a process of its own) in every respect a script can see but two
(warm_python.py's docstring: sys.modules, sys.executable); signals and kills reach the script as
they would."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import warm_python

SCRIPT = """import json, os, random, sys
import numpy as np
print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:], "path0": sys.path[0],
                  "name": __name__, "var": os.environ.get("NANOMLM_WARM_TEST"),
                  "omp": os.environ.get("OMP_NUM_THREADS"),
                  "draws": [random.random(), float(np.random.rand())]}))
print("to stderr", file=sys.stderr)
LEFT = open("left.txt", "w")
LEFT.write("unclosed")  # buffered: the interpreter's own shutdown writes it out
if sys.argv[1] == "crash":
    raise ValueError("boom")
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
if sys.argv[1] == "sleep":
    import time; time.sleep(30)
sys.exit(int(sys.argv[1]))
"""


def environment() -> dict:
    return {**os.environ, "NANOMLM_WARM_TEST": "é x", "OMP_NUM_THREADS": "1"}


def both(tmp_path, *args, timeout=60):
    """(the cold run, the warm run) of the script, each in a folder of its own."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = environment()
    runs = []
    for name in ("cold", "warm"):
        (tmp_path / name).mkdir()
        argv, cwd = [script, *args], tmp_path / name
        runs.append(subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=env,
                                   capture_output=True, text=True, timeout=timeout)
                    if name == "cold" else warm_python.run(argv, cwd, env, timeout))
    return runs


@pytest.mark.parametrize("status", ["0", "3"])
def test_a_warm_run_is_the_cold_run(tmp_path, status):
    cold, warm = both(tmp_path, status)
    assert cold.returncode == warm.returncode == int(status)
    assert cold.stderr == warm.stderr == "to stderr\n"
    said = [json.loads(r.stdout) for r in (cold, warm)]
    assert said[0]["cwd"] == str(tmp_path / "cold") and said[1]["cwd"] == str(tmp_path / "warm")
    for s in said:
        s.pop("cwd")
    draws = [s.pop("draws") for s in said]
    assert said[0] == said[1] and said[1]["var"] == "é x" and said[1]["path0"] == str(tmp_path)
    assert draws[0] != draws[1]  # seeded from the OS, as a fresh interpreter's are
    assert (tmp_path / "warm" / "left.txt").read_text() == "unclosed"
    again = warm_python.run([tmp_path / "script.py", "0"], tmp_path / "warm", environment(), 60)
    assert json.loads(again.stdout)["draws"] != draws[1]  # each child reseeds


def test_a_crash_a_signal_and_a_timeout_are_the_cold_run_s(tmp_path):
    cold, warm = both(tmp_path, "crash")
    assert cold.returncode == warm.returncode == 1
    assert cold.stderr.splitlines()[-1] == warm.stderr.splitlines()[-1] == "ValueError: boom"
    (tmp_path / "a").mkdir()
    cold, warm = both(tmp_path / "a", "kill")
    assert cold.returncode == warm.returncode == -9
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([tmp_path / "script.py", "sleep"], tmp_path, environment(), 2)
    after = warm_python.run([tmp_path / "script.py", "0"], tmp_path, environment(), 60)
    assert after.returncode == 0  # the zygote that timed out goes on


CHILD = """import os, signal, sys, time
torch = "torch" in sys.modules  # before any import of torch: a warm start
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
print(torch, os.getpid(), flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_a_scripts_own_python_is_warm_and_a_signal_reaches_it(tmp_path):
    """A warm script's `sys.executable SCRIPT` is warm too (bench.py's and study.py's train.py
    runs); `-c` is the cold interpreter's. SIGTERM to the launcher reaches the script, whose
    status the launcher exits with; a launcher killed outright takes the script with it."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys\n"
        "for argv in ([sys.argv[1], '0'], ['-c', 'import sys; print(\"torch\" in sys.modules)']):\n"
        "    print(subprocess.run([sys.executable, *argv], capture_output=True,\n"
        "                         text=True).stdout.split()[0])\n")
    r = warm_python.run([tmp_path / "parent.py", tmp_path / "child.py"], tmp_path,
                        environment(), 120)
    assert r.returncode == 0 and r.stdout.split() == ["True", "False"], r.stderr
    for sig, want in ((signal.SIGTERM, 7), (signal.SIGKILL, -9)):
        p = subprocess.Popen([warm_python.launcher(), tmp_path / "child.py", "30"],
                             cwd=tmp_path, env=environment(), stdout=subprocess.PIPE, text=True)
        warm, pid = p.stdout.readline().split()
        assert warm == "True"
        p.send_signal(sig)
        assert p.wait(timeout=30) == want
        for _ in range(100):  # the script ends with its launcher
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the script outlived its launcher's {sig!r}")
