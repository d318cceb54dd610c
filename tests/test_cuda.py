"""On a CUDA device: every objective compiled and in bf16, PLL against the CPU's, resume. Skipped
without one (CI has none); gpu_check.sh runs this file where a GPU is lent (../shared/GPU.md).
There the corpus is the carried, prepared babylm_10m ($NANOMLM_DATA); elsewhere the tests' own."""
import os
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

import evaluate
import train as T
from conftest import TINY, run_train
from data.prepare import CLS, SEP
from model import PRESETS, Encoder, ModelConfig
from test_train import MLSM_DICT, read_log

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = [*TINY[:-1], "cuda"]  # the tests' tiny model, on the GPU
assert TINY[-2:] == ["--device", "cpu"]


@pytest.fixture(scope="module")
def corpus(request) -> Path:
    carried = Path(os.environ.get("NANOMLM_DATA", "/nonexistent")) / "babylm_10m"
    if (carried / "meta.json").is_file():
        return carried
    return request.getfixturevalue("prepared")


@pytest.mark.parametrize("objective", sorted(T.OBJECTIVES))
def test_every_objective_compiled_in_bf16(corpus, tmp_path, objective):
    """30 steps, phase 2 from step 10: finite losses, and torch.compile settles (dynamo logs
    each recompilation; a shape that changes with the batch would log one per step). mlsm's
    code_share is a real share of the step (CUDA events recorded outside the compiled graphs)."""
    r = run_train("--data", corpus, "--out-dir", tmp_path / "run", "--objective", objective,
                  "--max-steps", 30, "--phase1-steps", 10, *CUDA, "--compile", "--bf16",
                  *(MLSM_DICT if objective.startswith("mlsm") else []),
                  env={"TORCH_LOGS": "recompiles"})
    assert r.returncode == 0, r.stderr[-3000:]
    log = read_log(tmp_path / "run")
    losses = [e["loss"] for e in log if "loss" in e]
    assert len(losses) == 6 and np.isfinite(losses).all()
    shares = [e["code_share"] for e in log if "code_share" in e]
    assert len(shares) == (4 if objective.startswith("mlsm") else 0)
    assert all(0 < share < 1 for share in shares), shares
    # at its limit (8 per function) dynamo stops compiling and says so: that must not happen
    assert "recompile_limit" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("Recompiling function") <= 6, r.stderr[-3000:]


def test_pll_on_cuda_matches_the_cpu(corpus):
    """The batched PLL of 40 sentences on the GPU against the CPU: in float32 (evaluate.py's
    default everywhere) within 1e-3 nats per scored token; under --bf16 within 0.05."""
    tok = spm.SentencePieceProcessor(model_file=str(corpus / "tokenizer.model"))
    V = tok.get_piece_size()
    torch.manual_seed(0)
    model = Encoder(ModelConfig(**{**PRESETS["tiny"], "vocab_size": V})).eval()
    rng = np.random.default_rng(0)
    seqs = [[CLS, *rng.integers(5, V, n).tolist(), SEP] for n in rng.integers(3, 30, 40)]
    starts = evaluate.word_starts(tok)
    got = {}
    for device, bf16 in (("cpu", False), ("cuda", False), ("cuda", True)):
        m = model.to(device)
        got[device, bf16] = evaluate.pll(m, seqs, [1.0, 2.0], True, 4096, torch.device(device),
                                         starts, progress=False, bf16=bf16)  # starts: on the CPU
    default = evaluate.pll(model.to("cuda"), seqs, [1.0, 2.0], True, 4096, torch.device("cuda"),
                           starts, progress=False)
    assert np.array_equal(default, got["cuda", False])  # float32 unless asked, on CUDA too
    scored = np.array([len(s) - 2 for s in seqs])[:, None]
    err = {bf16: np.abs(got["cuda", bf16] - got["cpu", False]) for bf16 in (False, True)}
    assert (err[False] <= 1e-3 * scored).all() and (err[True] <= 0.05 * scored).all()
    assert err[True].max() > err[False].max()  # --bf16 did reach the autocast


def test_resume_on_cuda(corpus, tmp_path):
    """20 steps in one go against 10, stop, resume: as close as two uninterrupted runs are to
    each other (bit for bit where the GPU's kernels are deterministic; some backward passes
    add with atomics, whose order varies)."""
    common = ["--data", corpus, "--max-steps", 20, *CUDA, "--no-compile"]
    for name in "ab":
        r = run_train(*common, "--out-dir", tmp_path / name)
        assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(*common, "--out-dir", tmp_path / "c", "--stop-at", 10)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train("--out-dir", tmp_path / "c", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b, c = (torch.load(tmp_path / x / "ckpt.pt", weights_only=True)["model"] for x in "abc")
    gap = lambda x, y: max((x[k] - y[k]).abs().max().item() for k in a)
    assert gap(a, c) <= 2 * gap(a, b), (gap(a, c), gap(a, b))
