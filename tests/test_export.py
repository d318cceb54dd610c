"""export.py: the Hugging Face folder loads with transformers alone and computes what our code
computes (logits, tokens, PLL), fine-tunes, and train.py --save-words keeps the BabyLM
pipeline's intermediate checkpoints. Needs requirements-export.txt; skipped without it."""
import gzip
import json
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch


for name in ("transformers", "tokenizers", "safetensors", "google.protobuf"):
    pytest.importorskip(name, reason="the export tests need pip install -r "
                                     "requirements-export.txt")

import transformers  # noqa: E402
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,  # noqa: E402
                          AutoModelForSequenceClassification, AutoTokenizer)

import evaluate as E  # noqa: E402
import export  # noqa: E402
import objectives as O  # noqa: E402
from conftest import run_script, run_train, shared_data  # noqa: E402
from data.prepare import MASK  # noqa: E402
from evaluation import results  # noqa: E402
from machinery.plumbing import read_checkpoint, save_checkpoint  # noqa: E402
from model import PRESETS, BootHeads, Encoder, ModelConfig, load_checkpoint  # noqa: E402


BLIMP = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"


def checkpoint(path, tokenizer: bytes, objective="mlm", **kw):
    """A tiny model with every tensor perturbed (so a zero bias or a unit norm cannot hide a
    tensor that was dropped or misplaced), saved as train.py would for `objective`."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**PRESETS["tiny"], "vocab_size": 2000, "d_model": 64, **kw})
    model = Encoder(cfg)
    entry = O.OBJECTIVES[objective]
    ckpt = {"model": model.state_dict(), "config": asdict(cfg), "tokenizer": tokenizer,
            "objective": objective, "step": 7, "predicts_before": entry.predicts_before,
            "decoder": entry.decoder, "args": {"objective": objective, "causal_fraction": 1 / 16}}
    if entry.decoder:
        ckpt["heads"] = BootHeads(cfg, 1, mae=True).state_dict()
    for t in [*ckpt["model"].values(), *ckpt.get("heads", {}).values()]:
        if t.is_floating_point():
            t.add_(0.05 * torch.randn_like(t))
    save_checkpoint(ckpt, path)
    return path


def sentences(n=40):
    """n BLiMP sentences from 8 paradigms, of different lengths."""
    pairs = [json.loads(x) for f in sorted(BLIMP.glob("*.jsonl"))[:8]
             for x in f.read_text().splitlines()[:3]]
    return [s for p in pairs for s in (p["sentence_good"], p["sentence_bad"])][:n]


@pytest.fixture(scope="module")
def tokenizer_bytes(prepared):
    return (prepared / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("kind", ["mlm", "boot", "absolute"])
def test_exported_logits_equal_load_checkpoint(kind, tokenizer_bytes, tmp_path):
    """Real sentences, padded in a batch; a BootBERT MAE student predicts the [MASK]s through
    its decoder in both; absolute positions too."""
    kw = dict(position="absolute") if kind == "absolute" else {}
    path = checkpoint(tmp_path / "ckpt.pt", tokenizer_bytes, "boot" if kind == "boot" else "mlm",
                      **kw)
    export.main(["--ckpt", str(path), "--out", str(tmp_path / "hf")])
    hf = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    # the tokenizer needs no remote code (export.py's comment: True under transformers 4 and 5)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=False)
    ours, _ = load_checkpoint(path)
    batch = tok(sentences(), padding=True, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert (mask == 0).any()
    ids = ids.masked_fill((torch.rand(ids.shape) < 0.2) & (ids > 4), MASK)  # some [MASK]s
    with torch.no_grad():
        got, want = hf(input_ids=ids, attention_mask=mask).logits, ours.logits(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert type(ours).__name__ == ("BootPredictor" if kind == "boot" else "Encoder")
    # AutoModel (the pipeline's fine-tuning loads it): the encoder's states, as encoder_only
    base = AutoModel.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    encoder, _ = load_checkpoint(path, encoder_only=True)
    with torch.no_grad():
        got, want = base(input_ids=ids, attention_mask=mask).last_hidden_state, encoder(ids, mask)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_fast_tokenizer_equals_sentencepiece_on_every_blimp_sentence(tokenizer_bytes, tmp_path):
    """Every sentence of the filtered BLiMP and its supplement (full_eval), through the converted
    tokenizer and through sentencepiece, with our test tokenizer (2000 pieces: more rare
    characters fall back to bytes than with the real one); and decoding gives the text back."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_bytes)
    tok = export.fast_tokenizer(tokenizer_bytes)
    full = shared_data() / "babylm_eval" / "full_eval"
    texts = sorted({p[k] for p in E.read_blimp([full / "blimp_filtered",
                                                full / "supplement_filtered"])
                    for k in ("good", "bad")})
    texts += ["  spaces   inside ", "ünïcödé ☃ 日本 \U0001F600", "12345 x2"]  # bytes, spaces
    assert len(texts) > 100_000
    got = tok(texts)["input_ids"]
    want = sp.encode(texts)
    bad = [t for t, g, w in zip(texts, got, want) if g != [2] + w + [3]]
    assert not bad, f"{len(bad)} sentences differ, e.g. {bad[:3]}"
    for t in texts[-3:]:
        assert tok.decode(tok(t)["input_ids"], skip_special_tokens=True) == sp.decode(sp.encode(t))


def test_pll_through_the_hugging_face_api_equals_evaluate_blimp(tokenizer_bytes, tmp_path):
    """evaluate.py blimp's pseudo-log-likelihoods (temperature 1) equal the textbook PLL
    computed with transformers alone: mask each token in turn, sum the log-probabilities."""
    path = checkpoint(tmp_path / "ckpt.pt", tokenizer_bytes)
    export.main(["--ckpt", str(path), "--out", str(tmp_path / "hf")])
    folder = tmp_path / "blimp"
    folder.mkdir()
    for f in sorted(BLIMP.glob("*.jsonl"))[:3]:
        (folder / f.name).write_text("".join(f.read_text().splitlines(True)[:4]))
    E.main(["blimp", "--ckpt", str(path), "--blimp-dir", str(folder), "--device", "cpu",
            "--out", str(tmp_path / "blimp.json")])
    result = results.read_result(tmp_path / "blimp.json")
    t1 = result["temperatures"].index(1.0)
    hf = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    by_id = {p["id"]: p for p in E.read_blimp([folder])}

    def pll(text):
        ids = torch.tensor(tok(text)["input_ids"])
        n = len(ids) - 2
        copies = ids.repeat(n, 1)
        copies[torch.arange(n), torch.arange(1, n + 1)] = tok.mask_token_id
        with torch.no_grad():
            logp = hf(input_ids=copies).logits.log_softmax(-1)
        return float(logp[torch.arange(n), torch.arange(1, n + 1), ids[1:-1]].sum())

    assert len(result["pairs"]) == 12
    for pair in result["pairs"]:
        src = by_id[pair["id"]]
        assert pll(src["good"]) == pytest.approx(pair["good"][t1], abs=1e-4)
        assert pll(src["bad"]) == pytest.approx(pair["bad"][t1], abs=1e-4)


def test_a_gpt_bert_export_scores_through_both_pipeline_backends_as_evaluate_does(
        tokenizer_bytes, tmp_path):
    """A gpt-bert export loaded as the BabyLM 2025 pipeline loads it for --backend mntp
    (AutoModelForMaskedLM: one copy per scored token, that token masked, the logits at the
    position before it) and for --backend causal (AutoModelForCausalLM: a right-padded batch,
    inputs ids[:-1], targets ids[1:]) gives evaluate.py blimp's log-probabilities. The scored
    tokens are chosen as the pipeline chooses them: by the tokenizer's offsets (end > 0, so no
    special token), the first from [CLS]'s state (its cls token exists: prepend = 1)."""
    path = checkpoint(tmp_path / "ckpt.pt", tokenizer_bytes, "gpt-bert")
    export.main(["--ckpt", str(path), "--out", str(tmp_path / "hf")])
    folder = tmp_path / "blimp"
    folder.mkdir()
    for f in sorted(BLIMP.glob("*.jsonl"))[:3]:
        (folder / f.name).write_text("".join(f.read_text().splitlines(True)[:4]))
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    by_id = {p["id"]: p for p in E.read_blimp([folder])}
    mlm = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    clm = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()

    def phrase(enc):  # process_mntp_sentences / process_causal_sentences, start_char_idx 0
        return [i for i, (start, end) in enumerate(enc["offset_mapping"]) if end > 0 and i != 0]

    @torch.no_grad()
    def mntp(text):
        enc = tok(text, return_offsets_mapping=True)
        ids, at = torch.tensor(enc["input_ids"]), torch.tensor(phrase(enc))
        copies = ids.repeat(len(at), 1)
        copies[torch.arange(len(at)), at] = tok.mask_token_id
        logp = mlm(input_ids=copies).logits[torch.arange(len(at)), at - 1].log_softmax(-1)
        return float(logp[torch.arange(len(at)), ids[at]].sum())

    @torch.no_grad()
    def causal(texts):
        batch = tok(texts, padding=True, return_tensors="pt")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        scored = torch.zeros_like(ids)
        for row, text in enumerate(texts):
            scored[row, phrase(tok(text, return_offsets_mapping=True))] = 1
        logits = clm(input_ids=ids[:, :-1], attention_mask=mask[:, :-1]).logits
        lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return (lp * scored[:, 1:]).sum(1).tolist()

    for scorer in ("mntp", "causal"):
        out = tmp_path / f"{scorer}.json"
        E.main(["blimp", "--ckpt", str(path), "--blimp-dir", str(folder), "--device", "cpu",
                "--scorer", scorer, "--out", str(out)])
        result = results.read_result(out)
        t1 = result["temperatures"].index(1.0)
        texts = [by_id[p["id"]][side] for p in result["pairs"] for side in ("good", "bad")]
        got = causal(texts) if scorer == "causal" else [mntp(t) for t in texts]
        want = [p[side][t1] for p in result["pairs"] for side in ("good", "bad")]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["objective"] == "gpt-bert" and "AutoModelForCausalLM" in config["auto_map"]


def test_sequence_classification_loads_the_encoder_and_trains_one_step(tokenizer_bytes,
                                                                         tmp_path):
    path = checkpoint(tmp_path / "ckpt.pt", tokenizer_bytes)
    export.main(["--ckpt", str(path), "--out", str(tmp_path / "hf")])
    clf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", num_labels=3,
                                                             trust_remote_code=True)
    for k, v in read_checkpoint(path)["model"].items():  # the encoder as trained, not re-drawn
        torch.testing.assert_close(clf.nanomlm.state_dict()[k], v, rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    batch = tok(sentences(12), padding=True, return_tensors="pt")
    labels = torch.arange(12) % 3
    opt = torch.optim.AdamW(clf.parameters(), lr=1e-3)
    clf.train()
    torch.manual_seed(0)
    before = clf(**batch, labels=labels).loss
    before.backward()
    opt.step()
    clf.eval()
    with torch.no_grad():
        logits = clf(**batch).logits
    assert logits.shape == (12, 3) and torch.isfinite(before)
    assert clf.classifier[-1].weight.grad.abs().sum() > 0
    assert clf.nanomlm.word.weight.grad.abs().sum() > 0       # the encoder is fine-tuned too


def words_read_by(prepared, step, global_batch=8, seq_len=32, seed=0) -> int:
    """An independent count of the training words a run read by the end of `step`: the
    segments of every micro-batch it read (Segments.batch, the loop's own reader, positions 0 ..
    step x global batch), piece by piece, a word where a piece begins one ('▁', sentencepiece's
    mark of a space before it), as BabyLM counts whitespace-separated words."""
    import sentencepiece as spm
    from data.prepare import Segments
    sp = spm.SentencePieceProcessor(model_proto=(prepared / "tokenizer.model").read_bytes())
    marked = {i for i in range(len(sp)) if sp.id_to_piece(i).startswith("\u2581")}
    segments = Segments(prepared / "train.bin", seq_len - 2, seed, shuffle=True)
    ids = segments.batch(0, step * global_batch)[:, 1:-1]  # [CLS] and [SEP] are not text
    return sum(int(t) in marked for t in ids.flatten())


def test_save_words_keeps_checkpoints_at_the_word_counts(prepared, tmp_path):
    """chck_<N>.pt at the first step by whose end N training words were read, counted (here
    against words_read_by, the words of the segments read), holding that step's weights; the
    same after a resume; export writes one folder each, named as the BabyLM pipeline expects.
    The rule counts the corpus's words as meta.json's whitespace count does, within 0.01%."""
    from data.prepare import Segments
    meta = json.loads((prepared / "meta.json").read_text())
    stream = Segments(prepared / "train.bin", 30, 0, shuffle=True).count_words(
        (prepared / "tokenizer.model").read_bytes())
    assert abs(stream.word_cum[-1] - meta["train_words"]) <= 1e-4 * meta["train_words"]
    last = next(s for s in range(1, 100) if words_read_by(prepared, s) >= 2000)  # ends at 2K
    flags = ["--data", prepared.name, "--size", "tiny", "--batch-size", 4, "--grad-accum", 2,
             "--seq-len", 32, "--max-steps", last, "--save-every", 5, "--save-words",
             "1K,2K,100K", "--device", "cpu"]
    env = {"NANOMLM_DATA": str(prepared.parent)}
    out, cut = tmp_path / "run", tmp_path / "cut"
    p = run_train(*flags, "--out-dir", out, env=env)
    assert p.returncode == 0, p.stderr
    said = p.stdout + p.stderr
    assert f"not written, beyond --max-steps {last}" in said and "chck_100K" in said
    for r in (run_train(*flags, "--out-dir", cut, "--stop-at", 3, env=env),
              run_train(*flags, "--out-dir", cut, "--resume", env=env)):
        assert r.returncode == 0, r.stderr
    for n, name in ((1000, "chck_1K"), (2000, "chck_2K")):
        ckpt = read_checkpoint(out / f"{name}.pt")
        step = ckpt["step"]
        assert words_read_by(prepared, step - 1) < n <= words_read_by(prepared, step)
        assert ckpt["words_mark"] == n and ckpt["words_seen"] == words_read_by(prepared, step)
        resumed = read_checkpoint(cut / f"{name}.pt")
        assert (resumed["step"], resumed["words_seen"]) == (step, ckpt["words_seen"])
    assert not (out / "chck_100K.pt").exists()
    final, kept = read_checkpoint(out / "ckpt.pt"), read_checkpoint(out / "chck_2K.pt")
    assert kept["step"] == final["step"] == last and "optimizer" not in kept  # weights only
    assert read_checkpoint(cut / "ckpt.pt")["words_seen"] == final["words_seen"]
    for k, v in final["model"].items():
        torch.testing.assert_close(kept["model"][k], v, rtol=0, atol=0)
    hf = tmp_path / "hf" / "mlm"
    export.main(["--ckpt", str(out), "--out", str(hf)])
    assert {p.name for p in hf.iterdir() if p.is_dir()} == {"chck_1K", "chck_2K"}
    saved = json.loads((hf / "chck_1K" / "mlm" / "config.json").read_text())
    step = read_checkpoint(out / "chck_1K.pt")["step"]
    assert saved["words_mark"] == 1000 and saved["words_seen"] == words_read_by(prepared, step)
    # the final model says what it saw too: every step's words, the last step's included
    assert json.loads((hf / "config.json").read_text())["words_seen"] == words_read_by(
        prepared, last)
    # the pipeline's rule (babylm/evaluation-pipeline-2025, its zero-shot main()): results go to
    # output_dir / Path(model_path_or_name).stem / (revision_name or "main") / ...
    filed = lambda model, revision=None: Path("results") / Path(model).stem / (revision or "main")
    assert filed(hf) == Path("results/mlm/main")
    for revision in ("chck_1K", "chck_2K"):  # as collate_preds.py looks for them: one name
        assert filed(hf / revision / "mlm", revision) == Path("results/mlm") / revision


def test_export_errors_are_one_line(tokenizer_bytes, tmp_path):
    path = checkpoint(tmp_path / "ckpt.pt", tokenizer_bytes)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    (tmp_path / "empty_run").mkdir()
    gz = tmp_path / "not_a_ckpt.pt"
    with gzip.open(gz, "wb") as f:
        f.write(b"nothing")
    cases = [(["--ckpt", str(path), "--out", str(tmp_path / "full")], "not empty; pass --force"),
             (["--ckpt", str(tmp_path / "empty_run"), "--out", str(tmp_path / "o")],
              "nothing to export"),
             (["--ckpt", str(gz), "--out", str(tmp_path / "o")], "cannot read checkpoint")]
    for argv, msg in cases:  # each refused in one line, before anything is written
        with pytest.raises(SystemExit) as e:
            export.main(argv)
        assert msg in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    export.main(["--ckpt", str(path), "--out", str(tmp_path / "full"), "--force"])
    assert (tmp_path / "full" / "config.json").exists()
    assert not (tmp_path / "o").exists()  # a refused export writes nothing
    # every file of the export readable alike (safetensors writes its own 0600)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "full").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
    # a folder that cannot be made or written (even by root: /proc, or under a file)
    (tmp_path / "afile").write_text("")
    for out, says in ((tmp_path / "afile", "is a file, not a folder"),
                      (tmp_path / "afile" / "sub", "cannot write"),
                      (Path("/proc/nanomlm_export"), "cannot write /proc/nanomlm_export")):
        r = run_script("export.py", "--ckpt", path, "--out", out)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr


def test_a_gpt_bert_export_generates_and_its_masked_class_says_where_it_reads(tokenizer_bytes,
                                                                              tmp_path):
    """AutoModelForCausalLM's generate() (greedy, no cache) gives the tokens a hand-written loop
    over load_checkpoint's model gives: one causal forward of the whole sequence a token, the
    argmax of the last position, until [SEP] or 12 new tokens. The masked class of a gpt-bert
    export says that its predictions sit a position before where a reader would be wrong
    (transformers' fill-mask pipeline), in one warning, and nowhere else (the BabyLM pipeline's
    mntp backend loads it as AutoModelForMaskedLM and reads the position before)."""
    path = checkpoint(tmp_path / "ckpt.pt", tokenizer_bytes, "gpt-bert")
    export.main(["--ckpt", str(path), "--out", str(tmp_path / "hf")])
    clm = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours, _ = load_checkpoint(path)
    for text in ("the cat sat on the", "once upon a time there"):
        x = torch.tensor([[tok.cls_token_id, *tok(text, add_special_tokens=False)["input_ids"]]])
        with torch.no_grad():
            got = clm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12,
                               do_sample=False)
            want = x
            for _ in range(12):
                nxt = ours.head(ours(want, torch.ones_like(want), causal=True))[0, -1].argmax()
                want = torch.cat([want, nxt.view(1, 1)], 1)
                if nxt == tok.sep_token_id:
                    break
        assert got.tolist() == want.tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading it for its logits: no warning
        AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    with pytest.warns(UserWarning, match="predicts a masked token from the position before it"):
        transformers.pipeline("fill-mask", model=str(tmp_path / "hf"), trust_remote_code=True)
