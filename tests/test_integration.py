"""End to end on real BabyLM text: raw folder -> prepare -> train.py -> a model that has learned
something a unigram model cannot."""
import json
import os

from conftest import run_train


def test_tiny_mlm_learns_past_the_unigram_entropy(small_raw, tmp_path, monkeypatch):
    # from the raw folder, so train.py's own data preparation runs too
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prepared"))
    out = tmp_path / "run"
    r = run_train("--data", small_raw, "--vocab-size", 2000, "--size", "tiny", "--seq-len", 64,
                  "--batch-size", 32, "--max-steps", 200, "--lr", 1e-2, "--eval-every", 100,
                  "--eval-batches", 4, "--log-every", 50, "--device", "cpu", "--out-dir", out,
                  # both of CI's cores in a serial run; one where tests/parallel.sh has set one
                  # per shard (a second thread then only contends with the other shard)
                  env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "data.json").read_text())  # the prepared corpus' meta.json
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    val = [e["val_loss"] for e in log if "val_loss" in e]
    assert len(val) == 2 and val[0] > val[-1]  # validation loss falls...
    # ...well below the entropy of the tokens' unigram distribution (5.89 nats here; 4.45
    # measured at step 200)
    assert val[-1] < meta["unigram_entropy"] - 1.0, (val, meta["unigram_entropy"])
