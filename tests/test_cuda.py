"""On a CUDA device: every objective compiled and in bf16, no host sync in a compiled step, PLL
against the CPU's, resume, every attention form compiled. Skipped without one (CI has none);
gpu_check.sh runs this file where a GPU is lent (../shared/GPU.md). There the corpus is the
carried, prepared babylm_10m ($NANOMLM_DATA), found as train.py finds it; elsewhere the tests'
own."""
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
from test_train import MLSM_DICT, compiled_trainee, read_log

import evaluate
import objectives as O
from conftest import TINY, run_train, run_trains
from data.masking import make_batch
from data.prepare import CLS, SEP, VOCAB_SIZE, Segments, prepare
from machinery.plumbing import load_state
from training.optim import Lamb, clipped_step, ema_update
from model import PRESETS, TRAINING_ATTENTION, Encoder, ModelConfig, use_attention


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = [*TINY[:-1], "cuda"]  # the tests' tiny model, on the GPU
assert TINY[-2:] == ["--device", "cpu"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles as a fresh train.py process would. Dynamo keeps 8 graphs per code
    object for the whole process, and every objective's trainee runs Trainee.forward: without a
    reset the ninth compiled objective hits that limit."""
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def corpus(request) -> Path:
    """babylm_10m as data/prepare.py finds it (the one prepared copy under $NANOMLM_DATA, with
    no raw text beside it on a GPU machine); failing that, the tests' corpus (needs ../shared)."""
    try:
        return prepare("babylm_10m", int(os.environ.get("VOCAB_SIZE", VOCAB_SIZE)), quiet=True)
    except SystemExit:
        return request.getfixturevalue("prepared")


def test_every_objective_compiled_in_bf16(corpus, tmp_path):
    """30 steps, phase 2 from step 10, each objective in its own process, all side by side (their
    compilations use the CPU's cores): finite losses, and torch.compile settles (dynamo logs each
    recompilation; a shape that changes with the batch would log one per step)."""
    objectives = sorted(O.OBJECTIVES)
    runs = run_trains(*[("--data", corpus, "--out-dir", tmp_path / o, "--objective", o,
                         "--max-steps", 30, "--phase1-steps", 10, *CUDA, "--compile", "--bf16",
                         *(MLSM_DICT if o.startswith("mlsm") else [])) for o in objectives],
                      env={"TORCH_LOGS": "recompiles"})
    for objective, r in zip(objectives, runs):
        assert r.returncode == 0, (objective, r.stderr[-3000:])
        losses = [e["loss"] for e in read_log(tmp_path / objective) if "loss" in e]
        assert len(losses) == 6 and np.isfinite(losses).all(), objective
        # at its limit (8 per function) dynamo stops compiling and says so: that must not happen
        assert "recompile_limit" not in r.stderr, (objective, r.stderr[-3000:])
        assert r.stderr.count("Recompiling function") <= 4, (objective, r.stderr[-3000:])


@pytest.mark.parametrize("objective", sorted(O.OBJECTIVES))
def test_a_compiled_step_never_waits_for_the_gpu(corpus, objective):
    """The loop's step, as train.py takes it (a batch gathered on the GPU from a pinned copy of
    its offsets, masks, the loss compiled whole in bf16, backward, clipping, LAMB, the EMA),
    under CUDA's sync debug mode: after two warm-up steps, any host sync raises. aot_eager runs
    the graphs inductor would compile, in seconds instead of a minute per objective."""
    take_steps(corpus, objective, backend="aot_eager")


@pytest.mark.parametrize("objective", ["mlm", "boot", "gpt-bert", "mlsm+mlm"])
def test_a_step_replayed_as_cuda_graphs_never_waits_for_the_gpu(corpus, objective):
    """The same step with --cuda-graphs: its graphs captured once and replayed (dynamo's
    cudagraphs backend, the trees inductor's reduce-overhead uses, without inductor's compile
    time). A host sync or a shape that changes with the data could not be captured."""
    take_steps(corpus, objective, backend="cudagraphs")


def take_steps(corpus, objective, backend):
    device = torch.device("cuda")
    trainee, parts, args = compiled_trainee(objective)
    trainee.to(device)
    move = lambda v: (v.to(device) if isinstance(v, (torch.Tensor, torch.nn.Module))
                      else [move(x) for x in v] if isinstance(v, list) else v)
    parts = dataclasses.replace(parts, **{f.name: move(getattr(parts, f.name))
                                          for f in dataclasses.fields(parts)})
    train = Segments(corpus / "train.bin", 22, 0, shuffle=True).to(device)
    model = torch.compile(trainee, fullgraph=True, backend=backend)
    optimizer = Lamb(trainee.parameters(), lr=1e-3)
    for step in range(5):
        torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")
        try:
            if backend == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()
            gen = torch.Generator(device).manual_seed(step)
            batch = make_batch(train.batch(4 * step, 4) % 300, args, 300, gen)
            with torch.autocast("cuda", torch.bfloat16):
                loss, stats = model(batch, parts)
            loss.backward()
            clipped_step(optimizer, 2.0)
            optimizer.zero_grad(set_to_none=True)
            if parts.ema is not None:
                ema_update(parts.ema, trainee.encoder, 0.99)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        finite = torch.isfinite(loss).item()  # read now: the next replay may overwrite it
    assert finite


def test_compiled_lamb_never_waits_for_the_gpu():
    """LAMB compiled as train.py compiles it on a GPU (inductor, two groups, a new learning rate
    and weight decay each step, gradients clipped inside), under CUDA's sync debug mode after two
    warm-up steps: no host sync, and the same parameters as the eager update (float32, a few
    ulps)."""
    torch.manual_seed(0)
    model = Encoder(ModelConfig(**PRESETS["tiny"], vocab_size=300)).cuda()
    twin = Encoder(ModelConfig(**PRESETS["tiny"], vocab_size=300)).cuda()
    twin.load_state_dict(model.state_dict())
    groups = lambda m: [{"params": [p for p in m.parameters() if p.ndim > 1], "weight_decay": 0.1},
                        {"params": [p for p in m.parameters() if p.ndim <= 1]}]
    compiled, eager = Lamb(groups(model), lr=1e-3, compile=True), Lamb(groups(twin), lr=1e-3)
    for step in range(6):
        for a, b in zip(model.parameters(), twin.parameters()):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        for opt in (compiled, eager):
            opt.param_groups[0]["weight_decay"] = 0.1 + 0.01 * step
            for g in opt.param_groups:
                g["lr"] = 1e-3 * (step + 1)
        torch.cuda.set_sync_debug_mode("error" if step >= 2 else "default")
        try:
            compiled.step(max_norm=2.0)  # clipping inside the compiled update, as train.py
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager.step(max_norm=2.0)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


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
        got[device, bf16] = evaluate.pll(m, seqs, [1.0, 2.0], "word-l2r", 4096,
                                         torch.device(device), starts, progress=False,
                                         bf16=bf16)  # starts: on the CPU
    default = evaluate.pll(model.to("cuda"), seqs, [1.0, 2.0], "word-l2r", 4096,
                           torch.device("cuda"), starts, progress=False)
    assert np.array_equal(default, got["cuda", False])  # float32 unless asked, on CUDA too
    scored = np.array([len(s) - 2 for s in seqs])[:, None]
    err = {bf16: np.abs(got["cuda", bf16] - got["cpu", False]) for bf16 in (False, True)}
    assert (err[False] <= 1e-3 * scored).all() and (err[True] <= 0.05 * scored).all()
    assert err[True].max() > err[False].max()  # --bf16 did reach the autocast


def test_resume_on_cuda_is_bit_exact(corpus, tmp_path):
    """20 steps in one go against 10, stop, resume, under --deterministic: the same weights bit
    for bit, as on the CPU, and two uninterrupted runs too. Deterministic kernels take away the
    only source of difference (backward passes that add with atomics in a varying order), so
    the criterion cannot fail by chance: a kernel without a deterministic version raises."""
    common = ["--data", corpus, "--max-steps", 20, *CUDA, "--no-compile", "--deterministic"]
    runs = run_trains(*[[*common, "--out-dir", tmp_path / name] for name in "ab"],
                      [*common, "--out-dir", tmp_path / "c", "--stop-at", 10])
    assert all(r.returncode == 0 for r in runs), [r.stderr[-3000:] for r in runs]
    r = run_train("--out-dir", tmp_path / "c", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b, c = (load_state(tmp_path / x / "ckpt.pt")["model"] for x in "abc")
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


@pytest.mark.parametrize("form", TRAINING_ATTENTION)
def test_every_attention_form_trains_compiled_on_cuda(form):
    """Each --attention form compiled as train.py compiles a step (inductor, bf16 autocast), in a
    tiny encoder with the fused kernels' head size (64), over a batch that shares its bucket map
    (one row padded) and over per-row maps (positions: BootBERT's compact student): forward and
    backward run, and the outputs at real positions and every gradient agree with the gather in
    float32, eager, to bf16's precision. Seconds: gpu_check.sh speed runs it first and stops if
    a form cannot run."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**PRESETS["tiny"], "n_layer": 1, "vocab_size": 300, "dropout": 0.0})
    enc = Encoder(cfg).cuda()
    ids = torch.randint(5, 300, (4, 64), device="cuda")
    mask = torch.ones(4, 64, dtype=torch.long, device="cuda")
    mask[1, 40:] = 0
    positions = torch.sort(torch.randperm(128, device="cuda")[:64].expand(4, 64), dim=1)[0]
    real = mask[..., None] == 1
    shared = lambda: (enc(ids, mask) * real).float()                 # (B, T, D) at real positions
    per_row = lambda: enc(ids, mask, positions=positions).float()
    out = {}
    for name in ("reference", form):  # each map compiled on its own, as a training step is
        use_attention(enc, "gather" if name == "reference" else form)
        enc.zero_grad()
        with torch.autocast("cuda", torch.bfloat16, enabled=name != "reference"):
            y, z = ((f() if name == "reference" else torch.compile(f)()) for f in (shared,
                                                                                    per_row))
        (y.sin().sum() + z.cos().sum()).backward()
        out[name] = [y, z] + [p.grad.clone() for p in enc.parameters() if p.grad is not None]
    assert len(out[form]) == len(out["reference"]) > 10
    for got, want in zip(out[form], out["reference"]):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))
