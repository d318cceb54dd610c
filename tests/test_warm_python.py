"""warm_python.py, which the tests' command-line runs go through: a warm run is the cold run
(`python SCRIPT ARGS` in a process of its own) in every respect a script can see."""
import json
import os
import subprocess
import sys

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
