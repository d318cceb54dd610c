"""gpu_check.sh --smoke: the GPU check, run end to end on the CPU as a GPU machine would run it
(../shared/GPU.md): a prepared babylm_10m under NANOMLM_DATA and no raw text, every part, the
summary and the tarball. A lent GPU is rare; the script it runs has run here first."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO, shared_data
from data.prepare import prepare


def gpu_check(*parts, env, cwd=REPO, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "gpu_check.sh"), *parts], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def carried(small_raw, tmp_path_factory) -> dict:
    """What carry.sh builds, at test size: babylm_10m prepared (a 2000-piece tokenizer on
    small_raw's text) with no raw corpus beside it, and two paradigms each of BLiMP and its
    supplement. Returns the environment gpu_check.sh runs in."""
    root = tmp_path_factory.mktemp("gpu_data")
    raw = root / "raw" / "babylm_10m"
    raw.mkdir(parents=True)
    for f in small_raw.iterdir():
        (raw / f.name).symlink_to(f)
    env = {**os.environ, "NANOMLM_DATA": str(root / "prep"), "NANOMLM_RAW": str(root / "noraw"),
           "VOCAB_SIZE": "2000", "GPU_EVAL": str(root / "eval"), "OMP_NUM_THREADS": "1",
           "PYTHON": sys.executable}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOMLM_DATA", env["NANOMLM_DATA"])
        prepare(str(raw), vocab_size=2000, quiet=True)
    fast = shared_data() / "babylm_eval" / "fast_eval"
    for ours, theirs in (("blimp_filtered", "blimp_fast"),
                         ("supplement_filtered", "supplement_fast")):
        (root / "eval" / ours).mkdir(parents=True)
        for f in sorted((fast / theirs).glob("*.jsonl"))[:2]:
            (root / "eval" / ours / f.name).symlink_to(f.resolve())
    return env


def test_smoke_runs_every_part_and_bundles_the_results(carried, tmp_path):
    env = {**carried, "OUT": str(tmp_path)}
    r = gpu_check("--smoke", "tests", "objectives", "kernels", "mlm10", "dictionary", env=env)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    with tarfile.open(tmp_path / "gpu_check.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back" / "gpu_check"
    summary = json.loads((back / "summary.json").read_text())
    data_line, *parts = summary["parts"]
    assert data_line.startswith("data: ") and "babylm_10m-" in data_line
    ran = {line.split(":")[0]: line for line in parts}
    assert set(ran) == {"tests", "objectives", "kernels", "mlm10", "blimp", "dictionary"}
    assert all(": exit 0, " in line for line in parts), parts
    assert "skipped" in summary["tests"]  # no CUDA here: the file imports, and skips
    steps = {row["case"].split()[0]: row for row in summary["bench"] if "tokens/s" == row["unit"]}
    assert {"mlm", "mlsm+mlm"} <= set(steps) and steps["mlsm+mlm"]["coder_ms"] > 0
    assert {row["case"].split(",")[0] for row in summary["bench_kernels"]}  # rows came back
    for run in ("mlm10", "dictionary"):
        assert summary[f"{run}_last_val"]["val_loss"] > 0 and not summary[f"{run}_errors"]
        assert any(line.startswith("done: 10 steps") for line in summary[f"{run}_said"])
        assert (back / run / "log.jsonl").is_file() and not list((back / run).glob("*.pt"))
    assert any(line.startswith("dictionary: 48 atoms") for line in summary["dictionary_said"])
    assert len(summary["blimp"]) == 4  # filtered and supplement: over paradigms, phenomena


def test_without_the_carried_corpus_it_stops_at_once_with_one_line(carried, tmp_path):
    env = {**carried, "NANOMLM_DATA": str(tmp_path / "empty"), "OUT": str(tmp_path)}
    r = gpu_check("--smoke", env=env, timeout=60)
    assert r.returncode == 1 and not (tmp_path / "gpu_check.tgz").exists()
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: no prepared babylm_10m")
