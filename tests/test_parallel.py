"""tests/parallel.sh's split of the suite (--shard, conftest.shard_of_files): every test file in
exactly one shard, and the shards' loads balanced as the longest-first rule guarantees; a file
named to parallel.sh runs once, and the shards' counts are summed at the end."""
import os
import re
import subprocess
import sys

from conftest import FILE_SECONDS, REPO, shard_of_files


def test_every_file_runs_in_one_shard_and_the_shards_are_balanced():
    files = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert set(FILE_SECONDS) <= set(files), "FILE_SECONDS names a file that is gone"
    for n in (1, 2, 3, 4):
        owner = shard_of_files(files + files[:3], n)  # a name seen twice is still one file
        assert set(owner) == set(files) and set(owner.values()) == set(range(n))
        load = [sum(FILE_SECONDS.get(f, 10) for f in files if owner[f] == k) for k in range(n)]
        # longest first, to the lightest: no shard exceeds the mean by more than the file that
        # was added to it last, itself no longer than the longest file
        assert max(load) <= sum(load) / n + max(FILE_SECONDS.values()), (n, load)
    # by hand: train 344 | gpu_check 148, then study (92) to the lighter side, 148 < 344
    assert shard_of_files(["test_train.py", "test_gpu_check.py", "test_study.py"], 2) == {
        "test_train.py": 0, "test_gpu_check.py": 1, "test_study.py": 1}


def test_a_file_named_to_parallel_sh_runs_once():
    """`bash tests/parallel.sh tests/test_x.py`: that file alone (not the suite too), in its own
    shard only; the other shard finds no test (pytest's status 5), which is not a failure. Here
    the file is this one, its other test selected by -k."""
    r = subprocess.run(["bash", "tests/parallel.sh", "tests/test_parallel.py", "-k", "balanced"],
                       cwd=REPO, env={**{k: v for k, v in os.environ.items() if k != "RECORD"},
                                      "SHARDS": "2", "PYTHON": sys.executable},  # not the suite's
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    shards, total = r.stdout.split("== all shards: ")
    assert re.findall(r"(\d+) passed", shards) == ["1"], r.stdout  # one shard ran one test
    assert "1 deselected" in shards  # the other shard: this file is not its own
    assert total.startswith("1 passed in ")  # the shards' counts summed
