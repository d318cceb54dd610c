"""tests/parallel.sh's split of the suite (--shard, conftest.shard_of_files): every test file in
exactly one shard, and the shards' loads balanced as the longest-first rule guarantees, by the
seconds the suite's last recorded run measured; a file named to parallel.sh runs once, and the
shards' counts are summed at the end."""
import json
import os
import re
import subprocess
import sys

from conftest import FILE_SECONDS, REPO, shard_of_files


def test_every_file_runs_in_one_shard_and_the_shards_are_balanced():
    files = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    for n in (1, 2, 3, 4):
        owner = shard_of_files(files + files[:3], n)  # a name seen twice is still one file
        assert set(owner) == set(files) and set(owner.values()) == set(range(n))
        load = [sum(FILE_SECONDS.get(f, 10) for f in files if owner[f] == k) for k in range(n)]
        # longest first, to the lightest: no shard exceeds the mean by more than the file that
        # was added to it last, itself no longer than the longest file
        assert max(load) <= sum(load) / n + max(FILE_SECONDS.values()), (n, load)
    # by hand: train 344 | gpu_check 148, then study (92) to the lighter side, 148 < 344
    hand = {"test_train.py": 344, "test_gpu_check.py": 148, "test_study.py": 92}
    assert shard_of_files(list(hand), 2, hand) == {
        "test_train.py": 0, "test_gpu_check.py": 1, "test_study.py": 1}


def test_the_shard_seconds_are_the_suites_own_last_record():
    """tests/file_seconds.json is what the last recorded run measured (parallel.sh with RECORD
    writes it beside docs/suite.json): one run's, every test file there is in it, none that is
    gone, and its seconds add up to about what that run's shards took (the rest: each shard's
    start and its files' collection)."""
    table = json.loads((REPO / "tests" / "file_seconds.json").read_text())
    run = json.loads((REPO / "docs" / "suite.json").read_text())
    assert (table["commit"], table["date"]) == (run["commit"], run["date"])
    files = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert set(table["seconds"]) == files
    measured, shards = sum(table["seconds"].values()), sum(run["shard_seconds"])
    assert 0.8 * shards <= measured <= shards, (measured, shards)


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
    assert re.search(r"^\d+ deselected in ", shards, re.M)  # the other: not its own file
    assert total.startswith("1 passed in ")  # the shards' counts summed
