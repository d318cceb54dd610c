"""Shared fixtures. The real corpus is read from $NANOMLM_RAW (CI: ../shared/data); test corpora
are cut from it into temporary folders, never into the repository."""
import functools
import gzip
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import warm_python  # noqa: E402
from data.prepare import prepare  # noqa: E402


def shared_data() -> Path:
    root = Path(os.environ.get("NANOMLM_RAW", REPO.parent / "shared" / "data"))
    if not (root / "babylm_10m").is_dir():
        pytest.fail(f"the shared corpus is not at {root / 'babylm_10m'}; set NANOMLM_RAW "
                    f"(see README)")
    return root


def head_lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f) for _ in range(n)]


@pytest.fixture(scope="session")
def small_raw(tmp_path_factory) -> Path:
    """About 200k words of real BabyLM text in the official layout: three *.train files (one plain,
    two gzip) and two *.dev files."""
    src = shared_data() / "babylm_10m"
    raw = tmp_path_factory.mktemp("raw") / "babylm_small"
    raw.mkdir()
    (raw / "childes.train").write_text("".join(head_lines(src / "childes.train.gz", 130)))
    for name in ("simple_wiki", "open_subtitles"):
        with gzip.open(raw / f"{name}.train.gz", "wt", encoding="utf-8") as f:
            f.writelines(head_lines(src / f"{name}.train.gz", 130))
    for name in ("childes", "simple_wiki"):
        (raw / f"{name}.dev").write_text("".join(head_lines(src / f"{name}.dev.gz", 12)))
    return raw


@pytest.fixture(scope="session")
def prepared(small_raw, tmp_path_factory) -> Path:
    """small_raw prepared with a 2000-piece tokenizer, into a temporary NANOMLM_DATA."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOMLM_DATA", str(tmp_path_factory.mktemp("prepared")))
        return prepare(str(small_raw), vocab_size=2000, quiet=True)


def run_script(script, *args, cwd=REPO, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` (SCRIPT: a path under the repository) in a process of its own, with
    the tests' environment and env's variables added; returns the finished process, its output
    captured. The process is a warm one (warm_python.py): torch is imported before the command
    comes, which is most of a tiny run's time."""
    return warm_python.run([REPO / script, *args], cwd, {**os.environ, **(env or {})}, timeout)


@pytest.fixture
def warm_executable(monkeypatch) -> None:
    """sys.executable is the launcher for this test: what the repository's code starts as
    `sys.executable SCRIPT.py` from inside the tests' process (bench.py's and study.py's train.py
    runs) starts warm."""
    monkeypatch.setattr(sys, "executable", str(warm_python.launcher()))


def run_train(*args, cwd=REPO, launcher=None, timeout=600,
              env=None) -> subprocess.CompletedProcess:
    """train.py in a process of its own, as a user runs it (env: variables to add; launcher: a
    command that starts it, torchrun say, in a cold process); returns the finished process."""
    # OMP_NUM_THREADS: 2 gloo processes on 2 cores, no oversubscription
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if launcher is None:
        return run_script("train.py", *args, cwd=cwd, env=env, timeout=timeout)
    cmd = launcher + [str(REPO / "train.py"), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def run_trains(*commands, **kw) -> list[subprocess.CompletedProcess]:
    """Several independent train.py commands side by side (each on one thread: two at once on
    CI's two cores take about the time of one); their finished processes, in order."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_train(*args, **kw), commands))


# a model small enough that a CLI run takes seconds on a CPU
TINY = ["--size", "tiny", "--n-layer", "1", "--d-model", "64", "--n-head", "2", "--d-ff", "128",
        "--seq-len", "32", "--batch-size", "8", "--log-every", "5", "--eval-every", "1000",
        "--eval-batches", "2", "--device", "cpu"]


# Seconds each test file took (its tests' set-up, call and tear-down, the fixtures they built
# with them) in the suite's last recorded run: `RECORD=docs/suite.json bash tests/parallel.sh`
# on a fresh clone writes tests/file_seconds.json beside docs/suite.json (tests/test_parallel.py
# holds the two to one run). They only balance the shards; a file missing there counts as 10 s.
FILE_SECONDS = json.loads((REPO / "tests" / "file_seconds.json").read_text())["seconds"]


def shard_of_files(names, n: int, seconds: dict = FILE_SECONDS) -> dict:
    """{file name: its shard in range(n)}: files, longest first, each to the shard with the least
    `seconds` so far (a file missing there counts as 10 s)."""
    took = lambda name: seconds.get(name, 10)
    load, owner = [0] * n, {}
    for name in sorted(set(names), key=lambda f: (-took(f), f)):
        owner[name] = load.index(min(load))
        load[owner[name]] += took(name)
    return owner


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="I/N", help="run only shard I of N (0 <= I < N), by "
                     "whole test files: tests/parallel.sh runs the N at once")
    parser.addoption("--record-times", metavar="FILE", help="write {test file: seconds} of "
                     "this run there (tests/parallel.sh with RECORD merges the shards')")


SECONDS_TAKEN = {}  # {test file: seconds} of this session, its reports' durations summed


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    SECONDS_TAKEN[name] = SECONDS_TAKEN.get(name, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    warm_python.stop()
    if out := session.config.getoption("--record-times"):
        Path(out).write_text(json.dumps(SECONDS_TAKEN))


def pytest_ignore_collect(collection_path, config):
    """--shard I/N: only shard I's test files are collected (whole files, so that a module
    fixture is built once; each of the N processes with about 1/N of the time, and importing
    only what its own files import). An option, not a variable of the environment, so that a
    pytest the tests start (gpu_check.sh's) runs whole."""
    if not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    return True if collection_path.name in other_shards_files(config) else None


def pytest_collection_modifyitems(config, items):
    """--shard I/N with a test file named on the command line (pytest collects it whatever
    pytest_ignore_collect says): its tests run in its own shard only."""
    others = other_shards_files(config)
    drop = [item for item in items if item.path.name in others]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if item.path.name not in others]


@functools.cache
def other_shards_files(config) -> frozenset:
    """The test files --shard I/N leaves to the other shards (none without --shard)."""
    shard = config.getoption("--shard")
    if not shard:
        return frozenset()
    i, n = map(int, shard.split("/"))
    owner = shard_of_files([f.name for f in Path(__file__).parent.glob("test_*.py")], n)
    return frozenset(name for name, k in owner.items() if k != i)
