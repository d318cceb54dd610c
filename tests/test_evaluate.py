"""evaluate.py: PLL against a one-copy-at-a-time loop, word-l2r, temperature selection, metrics
against hand-computed values, the Multi-Bootstrap against brute-force enumeration, readers and
their errors, and fine-tuning end to end."""
import collections
import itertools
import json
import math
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import evaluate as E
from conftest import run_script, shared_data
from data.masking import span_mask, uniform_mask
from data.prepare import CLS, MASK, SEP, load_tokenizer
from data.tasks import read_task
from evaluation import finetune
from machinery import plumbing
from evaluation import multibootstrap, results
from training import optim
from machinery.plumbing import load_state, read_checkpoint, save_checkpoint
from model import PRESETS, BootHeads, BootPredictor, Encoder, ModelConfig


@pytest.fixture(scope="module")
def ckpt(prepared, tmp_path_factory):
    """A randomly initialised tiny model with the 2000-piece test tokenizer, saved as train.py
    would."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**PRESETS["tiny"], "vocab_size": 2000, "d_model": 64, "d_ff": 128})
    model = Encoder(cfg).eval()
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    save_checkpoint({"model": model.state_dict(), "config": asdict(model.config),
                     "args": {"seed": 7}, "step": 40,
                     "tokenizer": (prepared / "tokenizer.model").read_bytes()},
                    path)
    return path


@pytest.fixture(scope="module")
def sentences(prepared):
    blimp = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    pairs = E.read_blimp([blimp])[::700]  # 20 pairs, many paradigms
    tok = load_tokenizer(prepared)
    texts = [p["good"] for p in pairs] + [p["bad"] for p in pairs]
    return [[CLS] + s + [SEP] for s in tok.encode(texts)]


def naive_pll(model, seq, temps, scorer, starts):
    """Each scorer as written, one forward per scored token. pll (Salazar et al. 2020): a copy
    with the token masked (word-l2r: and the later pieces of its word), its log-probability
    where it is; mntp: the same copy, read at the position before it; causal: a causal forward
    of the tokens before it alone, read at its last position."""
    words = starts[torch.tensor(seq)].cumsum(0)
    total = np.zeros(len(temps))
    for i in range(1, len(seq) - 1):
        x = torch.tensor(seq)
        hide = torch.arange(len(seq)) == i
        if scorer == "word-l2r":
            hide |= (torch.arange(len(seq)) > i) & (words == words[i])
        if scorer == "causal":
            z = model.logits(x[None, :i], causal=True)[0, -1]
        else:
            z = model.logits(x.masked_fill(hide, MASK)[None])[0, i - (scorer == "mntp")]
        total += [torch.log_softmax(z / t, -1)[seq[i]].item() for t in temps]
    return total


def pipeline_logprob(model, tokens, backend, temperature):
    """The BabyLM 2025 pipeline's log-probability of a sentence, transcribed from
    evaluation_pipeline/sentence_zero_shot (commit bf55c11): tokens as its tokenizer gives them,
    [CLS] ... [SEP], whose special tokens have empty offsets and are never scored.
    mntp (process_mntp_sentences, compute_mlm_results): prepend = 1 (a cls token exists); one
    copy per phrase token with that token masked; the logits at indices - 1; summed.
    causal (process_causal_sentences, the causal collate, compute_causal_results): inputs
    tokens[:-1], targets tokens[1:], the phrase mask shifted with them; summed."""
    phrase = [0] + [1] * (len(tokens) - 2) + [0]                      # offset end > 0
    if backend == "mntp":
        prepend = 1
        phrase_indices = [i for i, p in enumerate(phrase) if p and (i != 0 or prepend != 0)]
        copies = torch.tensor(tokens).repeat(len(phrase_indices), 1)
        copies[torch.arange(len(phrase_indices)), phrase_indices] = MASK
        indices = torch.tensor(phrase_indices) - 1
        logits = model.logits(copies)                                  # (copies, T, V)
        masked_logits = logits[torch.arange(len(indices)), indices]
        targets = torch.tensor(tokens)[phrase_indices]
        lp = torch.log_softmax(masked_logits / temperature, -1).gather(1, targets[:, None])
        return lp.sum().item()
    padded = torch.tensor([tokens])
    inputs, targets, mask = padded[:, :-1], padded[:, 1:], torch.tensor([phrase])[:, 1:]
    logits = model.logits(inputs, causal=True)
    lp = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
    return (lp * mask).sum().item()


@pytest.mark.parametrize("scorer", E.SCORERS)
def test_batched_pll_equals_naive_loop(ckpt, sentences, scorer):
    model, tok = E.load_checkpoint(ckpt)
    starts = E.word_starts(tok)
    temps = [0.5, 1.0, 2.0]
    # a small token budget: many batches, several per length
    got = E.pll(model, sentences, temps, scorer, 64, torch.device("cpu"), starts,
                progress=False)
    want = np.array([naive_pll(model, s, temps, scorer, starts) for s in sentences])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["mntp", "causal"])
def test_gpt_bert_scorers_are_the_pipelines_rules(ckpt, sentences, backend):
    """--scorer mntp and causal against a transcription of the BabyLM 2025 pipeline's code for
    its backends of the same names, at two temperatures."""
    model, tok = E.load_checkpoint(ckpt)
    got = E.pll(model, sentences, [0.5, 1.0], backend, 256, torch.device("cpu"),
                E.word_starts(tok), progress=False)
    with torch.no_grad():
        want = [[pipeline_logprob(model, s, backend, t) for t in (0.5, 1.0)] for s in sentences]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module", params=["relative", "absolute"])
def boot_ckpt(prepared, tmp_path_factory, request):
    """A tiny BootBERT student (MAE encoder with a final norm, a 2-layer decoder, the mask vector),
    saved as train.py saves a boot run; its norms moved off their init so that they count."""
    torch.manual_seed(1)
    cfg = ModelConfig(**{**PRESETS["tiny"], "vocab_size": 2000, "d_model": 64, "d_ff": 128,
                         "final_norm": True, "position": request.param})
    model, heads = Encoder(cfg).eval(), BootHeads(cfg, 2, mae=True)
    with torch.no_grad():
        for p in [model.norm.weight, model.norm.bias, *heads.decoder.norm.parameters()]:
            p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("boot") / "ckpt.pt"
    save_checkpoint({"model": model.state_dict(), "config": asdict(cfg), "objective": "boot",
                     "decoder": True, "heads": heads.state_dict(), "args": {"seed": 3},
                     "tokenizer": (prepared / "tokenizer.model").read_bytes()}, path)
    return path


def naive_boot_pll(encoder, heads, seq, l2r, starts):
    """BootBERT's student scored copy by copy, one forward each: the encoder reads the visible
    tokens alone, at their own positions; the mask vector stands at the hidden ones; the decoder
    reads the full length; the MLM head reads the decoder at the target."""
    words = starts[torch.tensor(seq)].cumsum(0)
    L, total = len(seq), 0.0
    for i in range(1, L - 1):
        hide = torch.arange(L) == i
        if l2r:
            hide |= (torch.arange(L) > i) & (words == words[i])
        seen = torch.arange(L)[~hide]
        states = encoder(torch.tensor(seq)[seen][None], positions=seen[None])[0]  # (L - h, D)
        x = heads.mask.expand(L, -1).clone()
        if encoder.config.position == "absolute":  # a hidden slot: the vector at its position
            x = x + encoder.pos.weight[:L]
        x[seen] = states
        z = encoder.head(heads.decoder(x[None], encoder.attention_inputs(torch.ones(1, L)))[0, i])
        total += torch.log_softmax(z, -1)[seq[i]].item()
    return total


@pytest.mark.parametrize("scorer", ["pll", "word-l2r"])
def test_boot_is_scored_through_its_decoder(boot_ckpt, sentences, scorer):
    model, tok = E.load_checkpoint(boot_ckpt)
    assert isinstance(model, BootPredictor) and len(model.heads.decoder.layers) == 2
    sentences = sentences[::4]  # 5 good and 5 bad: the naive loop runs a forward per token
    starts = E.word_starts(tok)
    seen = []  # every token id the encoder embeds
    model.encoder.word.register_forward_pre_hook(lambda m, a: seen.append(a[0].flatten()))
    got = E.pll(model, sentences, [1.0], scorer, 64, torch.device("cpu"), starts,
                progress=False)
    assert not (torch.cat(seen) == MASK).any()  # [MASK] never reaches the encoder
    seen.clear()
    want = [naive_boot_pll(model.encoder, model.heads, s, scorer == "word-l2r", starts)
            for s in sentences]
    np.testing.assert_allclose(got[:, 0], want, rtol=0, atol=1e-4)
    encoder, _ = E.load_checkpoint(boot_ckpt, encoder_only=True)  # what fine-tuning reads
    assert type(encoder) is Encoder and encoder.norm is not None


def test_word_l2r_differs_only_inside_multi_piece_words(ckpt, sentences):
    model, tok = E.load_checkpoint(ckpt)
    starts = E.word_starts(tok)
    run = lambda scorer: E.token_logprobs(model, sentences, [1.0], scorer, 256,
                                          torch.device("cpu"), starts, progress=False)
    sent, pos, plain = run("pll")
    _, _, l2r = run("word-l2r")
    # a copy's input changes only if its target has later pieces in the same word
    nxt = np.array([sentences[s][p + 1] for s, p in zip(sent, pos)])
    continued = ~starts[torch.from_numpy(nxt)].numpy()
    assert continued.any() and (~continued).any()  # the sample has both kinds of token
    np.testing.assert_array_equal(plain[~continued], l2r[~continued])
    assert (plain[continued] != l2r[continued]).all()


def test_temperature_is_chosen_on_one_half_only():
    rng = np.random.default_rng(0)
    temps = [0.5, 1.0, 2.0, 3.0]
    uids = np.repeat(["a", "b", "c"], 200)
    halves = rng.integers(0, 2, len(uids))
    correct = rng.random((len(uids), 4)) < 0.5
    correct[halves == 0, 2] = True      # the selection half likes T=2
    correct[halves == 1, 0] = True      # the reporting half would like T=0.5
    assert E.choose_temperature(correct, uids, halves, temps) == 2
    for _ in range(5):  # whatever the reporting half says, the choice stays
        shuffled = correct.copy()
        shuffled[halves == 1] = rng.random(((halves == 1).sum(), 4)) < rng.random()
        assert E.choose_temperature(shuffled, uids, halves, temps) == 2
    tie = np.ones((len(uids), 4), bool)  # all equal: the temperature nearest to 1
    assert E.choose_temperature(tie, uids, halves, temps) == 1


def test_split_by_pair_id_is_fixed_and_balanced():
    pairs = E.read_blimp([shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"])
    halves = np.array([E.half_of(p["id"]) for p in pairs])
    assert halves.mean() == pytest.approx(0.5, abs=0.02)
    assert E.half_of("adjunct_island/0") == E.half_of("adjunct_island/0")
    assert {E.half_of(f"x/{i}") for i in range(10)} == {0, 1}


# --- metrics -------------------------------------------------------------------------------------

def test_metrics_hand_computed():
    labels, preds = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]  # TP 2, FN 1, TN 1, FP 1
    cm = results.confusion(labels, preds, 2)
    assert cm.tolist() == [[1, 1], [1, 2]]
    assert results.accuracy(cm) == pytest.approx(3 / 5)
    assert results.f1(cm) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert results.mcc(cm) == pytest.approx((2 * 1 - 1 * 1) / math.sqrt(3 * 3 * 2 * 2))
    # three classes: c = 4 correct of s = 6; true counts t = (2, 2, 2), predicted p = (3, 2, 1)
    cm3 = results.confusion([0, 0, 1, 1, 2, 2], [0, 0, 1, 0, 2, 1], 3)
    want = (4 * 6 - (3 * 2 + 2 * 2 + 1 * 2)) / math.sqrt((36 - (9 + 4 + 1)) * (36 - 12))
    assert results.mcc(cm3) == pytest.approx(want)
    assert results.accuracy(cm3) == pytest.approx(4 / 6)
    # a constant prediction has no correlation; a class never seen has F1 0
    assert results.mcc(results.confusion([0, 1, 1], [1, 1, 1], 2)) == 0
    assert results.f1(results.confusion([0, 0], [0, 0], 2)) == 0


def test_binary_mcc_is_the_phi_coefficient_and_vectorises():
    rng = np.random.default_rng(1)
    cms = []
    for _ in range(20):
        y = rng.integers(0, 2, 50)
        p = np.where(rng.random(50) < 0.7, y, 1 - y)
        cm = results.confusion(y, p, 2)
        assert results.mcc(cm) == pytest.approx(np.corrcoef(y, p)[0, 1])
        cms.append(cm)
    np.testing.assert_allclose(results.mcc(np.stack(cms)), [results.mcc(c) for c in cms])


# --- Multi-Bootstrap -----------------------------------------------------------------------------

def result(seed, pred, label=None, metric="accuracy"):
    pred = np.atleast_2d(pred)
    label = np.ones(pred.shape[1], int) if label is None else np.asarray(label)
    return {"seed": seed, "id": [str(i) for i in range(pred.shape[1])], "label": label,
            "pred": pred, "metric": metric, "k": 2, "path": f"seed{seed}.json"}


def test_identical_inputs_give_no_difference():
    rng = np.random.default_rng(0)
    A = [result(s, rng.integers(0, 2, 300)) for s in range(4)]
    r = multibootstrap.multibootstrap(A, A, nboot=300)
    assert r["paired_seeds"] and r["paired_examples"]
    assert r["diff"] == 0 and r["ci95"] == [0, 0] and r["p"] == 0.5


def test_same_distribution_unpaired_seeds_is_not_significant():
    rng = np.random.default_rng(0)
    easy = rng.random(1000)  # per-example difficulty shared by both procedures
    draw = lambda: (rng.random(1000) < 0.4 + 0.4 * easy).astype(int)
    A = [result(s, draw()) for s in range(5)]
    B = [result(s + 10, draw()) for s in range(5)]
    r = multibootstrap.multibootstrap(A, B, nboot=1000)
    assert not r["paired_seeds"] and r["paired_examples"]
    assert r["ci95"][0] < 0 < r["ci95"][1] and 0.05 < r["p"] < 0.95


def test_known_shift_is_detected():
    rng = np.random.default_rng(0)
    A = [result(s, (rng.random(2000) < 0.60).astype(int)) for s in range(5)]
    B = [result(s, (rng.random(2000) < 0.66).astype(int)) for s in range(5)]
    r = multibootstrap.multibootstrap(A, B, nboot=1000)
    assert r["diff"] == pytest.approx(0.06, abs=0.01) and r["ci95"][0] > 0.03
    assert r["p"] == 1 / 1000 and r["p_floored"]  # no resample the other way: p < 1/nboot


def seed_accuracies(rng, sims, S, p, N=200, sd=0.03):
    """(sims, S) accuracies of S pretraining seeds on N examples: each seed's true accuracy is p
    plus a normal seed effect (sd), each example a Bernoulli draw from it."""
    return rng.binomial(N, np.clip(p + rng.normal(0, sd, (sims, S)), 0, 1)) / N


@pytest.mark.parametrize("paired", [True, False])
def test_the_seed_level_interval_holds_its_level_at_3_5_and_10_seeds(paired):
    """Simulated studies whose truth is known (seed effects sd 3 points, 200 examples a seed):
    at 3, 5 and 10 seeds a side the t-interval covers the true difference (none, and +4 points)
    93-97% of the time, and with no difference p < 0.05 comes 3-7% of the time. Paired: the
    same seed numbers on both sides (Student's t on the differences); unpaired: Welch's."""
    rng = np.random.default_rng(0)
    sims = 2000
    for S in (3, 5, 10):
        for shift in (0.0, 0.04):
            a = seed_accuracies(rng, sims, S, 0.6)
            b = seed_accuracies(rng, sims, S, 0.6 + shift)
            rows = [multibootstrap.seed_interval(x, y, paired) for x, y in zip(a, b)]
            covered = np.mean([r["ci95"][0] <= shift <= r["ci95"][1] for r in rows])
            assert 0.93 <= covered <= 0.97, (S, shift, covered)
            if shift == 0:
                false_positives = np.mean([r["p"] < 0.05 for r in rows])
                assert 0.03 <= false_positives <= 0.07, (S, false_positives)
    assert multibootstrap.seed_interval([0.5], [0.6], paired)["ci95"] is None  # one seed: none


def test_at_3_seeds_the_multibootstrap_interval_falls_short_and_is_reported_as_a_spread():
    """Why the t-interval gives the verdict below 25 seeds: simulated studies of a validation
    loss at 3 seeds a side, where the seeds differ far more than the mean over 500 segments
    does (seed sd 0.15 nats, as in docs/studies/gpt_bert_cpu; segment sd 0.5), through the
    Multi-Bootstrap (seeds and segments resampled jointly): its 2.5-97.5 percentiles, about the
    span of the per-seed differences, cover the truth far less often than 95%, and a result says
    it is not at its level. Its per-seed values and seed-level interval are the seeds' own."""
    rng = np.random.default_rng(1)
    covered = []
    for _ in range(200):
        seeds = 4.0 + rng.normal(0, 0.15, (2, 3))                          # (side, seed)
        A, B = ([result(s, seeds[i, s] + rng.normal(0, 0.5, 500), metric="mean")
                 for s in range(3)] for i in range(2))
        r = multibootstrap.multibootstrap(A, B, nboot=200)
        covered.append(r["ci95"][0] <= 0 <= r["ci95"][1])
    assert np.mean(covered) < 0.85 and not r["at_level"]
    assert r["values_b"] == pytest.approx([np.mean(b["pred"]) for b in B])
    want = np.mean([np.mean(b["pred"]) - np.mean(a["pred"]) for a, b in zip(A, B)])
    assert r["seed_level"]["diff"] == pytest.approx(want)
    assert r["seed_level"] == multibootstrap.seed_interval(r["values_a"], r["values_b"], True)


def enumerated_p(A, B, lower_is_better=False) -> float:
    """The Multi-Bootstrap's p for 2 seeds x 2 examples a side (unpaired seeds, paired
    examples), by enumerating its 4 x 4 x 4 equally likely draws: how often B is not better than
    A, ties counting half."""
    diffs = []
    for sa, sb, ex in itertools.product(itertools.product(range(2), repeat=2), repeat=3):
        mean = lambda side, seeds: np.mean([side[s]["pred"][0][list(ex)].mean() for s in seeds])
        diffs.append(mean(B, sb) - mean(A, sa))
    worse = -np.array(diffs) if lower_is_better else np.array(diffs)
    return (worse < 0).mean() + 0.5 * (worse == 0).mean()


def test_tiny_case_matches_brute_force_enumeration():
    A = [result(1, [1, 0]), result(2, [1, 1])]
    B = [result(3, [0, 1]), result(4, [1, 1])]
    exact_p = enumerated_p(A, B)
    r = multibootstrap.multibootstrap(A, B, nboot=40000, block=5000)
    assert r["p"] == pytest.approx(exact_p, abs=0.01)
    assert r["diff"] == pytest.approx(0.75 - 0.75)  # point estimates on all data: both 0.75


def test_bootstrap_point_estimates_use_the_metric():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 200)
    # 3 pretraining seeds x 2 fine-tuning seeds
    preds = [np.where(rng.random((2, 200)) < 0.8, y, 1 - y) for _ in range(3)]
    A = [result(s, p, y, "f1") for s, p in enumerate(preds)]
    want = np.mean([results.f1(results.confusion(y, row, 2)) for p in preds for row in p])
    assert multibootstrap.multibootstrap(A, A, nboot=10)["mean_a"] == pytest.approx(want, rel=1e-6)


# --- readers and errors --------------------------------------------------------------------------

def test_read_blimp_schemas(tmp_path):
    (tmp_path / "orig").mkdir()
    (tmp_path / "orig" / "x.jsonl").write_text(
        json.dumps({"sentence_good": "a b.", "sentence_bad": "b a.", "UID": "animate_subject_trans",
                    "field": "f", "linguistics_term": "s-selection", "pairID": "12"}) + "\n")
    (tmp_path / "supp").mkdir()
    (tmp_path / "supp" / "turn_taking.jsonl").write_text(
        "".join(json.dumps({"sentence_good": "g", "sentence_bad": "b", "row": 0}) + "\n"
                for _ in range(3)))
    pairs = E.read_blimp([tmp_path / "orig", tmp_path / "supp"])
    assert pairs[0]["id"] == "animate_subject_trans/12"
    assert pairs[0]["phenomenon"] == "argument_structure"
    # line numbers
    assert [p["id"] for p in pairs[1:]] == ["turn_taking/0", "turn_taking/1", "turn_taking/2"]
    assert {p["phenomenon"] for p in pairs[1:]} == {"turn_taking"} and pairs[1]["group"] == "supp"


def test_reader_errors(tmp_path):
    with pytest.raises(SystemExit, match="no BLiMP folder at"):
        E.read_blimp([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no \\*.jsonl"):
        E.read_blimp([tmp_path / "empty"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "p.jsonl").write_text('{"sentence_good": "a", "sentence_bad": "b"}\n'
                                              '{"sentence_good": oops}\n')
    with pytest.raises(SystemExit, match=r"p\.jsonl:2 is not valid JSON"):
        E.read_blimp([tmp_path / "bad"])
    (tmp_path / "bad" / "p.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="holds no pairs"):
        E.read_blimp([tmp_path / "bad"])


def test_task_without_train_file_fails_clearly(prepared):
    tok = load_tokenizer(prepared)
    glue = shared_data() / "babylm_eval" / "full_eval" / "glue_filtered"
    with pytest.raises(SystemExit, match=r"no boolq\.train\.jsonl .*only boolq\.valid\.jsonl"):
        read_task(glue, "boolq", "train", tok, 128)
    seqs, labels, ids = read_task(glue, "mrpc", "valid", tok, 32)
    assert len(seqs) == 204 and max(map(len, seqs)) <= 32 and set(labels) == {0, 1}
    # [CLS] a [SEP] b [SEP]
    assert all(s[0] == CLS and s[-1] == SEP and s.count(SEP) == 2 for s in seqs)


def test_pair_truncation_is_longest_first(tmp_path, prepared):
    tok = load_tokenizer(prepared)
    long, short = " ".join(["word"] * 40), "two words"
    row = {"sentence1": long, "sentence2": short, "label": 0}
    (tmp_path / "rte.valid.jsonl").write_text(json.dumps(row) + "\n")
    (seq,), _, _ = read_task(tmp_path, "rte", "valid", tok, 16)
    assert len(seq) == 16
    assert seq[-1 - len(tok.encode(short)):-1] == tok.encode(short)  # the short one kept whole


# --- fine-tuning and compare, end to end ---------------------------------------------------------

def keyword_task(folder: Path, n: int, seed: int):
    """An MSGS-style binary task (sentence, label) any model can learn: does 'dog' occur?"""
    rng = np.random.default_rng(seed)
    words = "the a red blue green cat house tree runs sees big small old new".split()
    with open(folder / f"keyword.{'train' if n > 100 else 'valid'}.jsonl", "w") as f:
        for i in range(n):
            s = list(rng.choice(words, 8))
            label = int(rng.random() < 0.5)
            if label:
                s[rng.integers(8)] = "dog"
            f.write(json.dumps({"sentence": " ".join(s), "label": label}) + "\n")


def test_length_grouped_batches_cover_every_example_once_with_little_padding():
    lengths = np.random.default_rng(0).integers(5, 120, 3000)
    # tokens / padded tokens
    useful = lambda batches: lengths.sum() / sum(lengths[b].max() * len(b) for b in batches)
    epochs = [finetune.length_grouped(lengths, 32, np.random.default_rng(seed)) for seed in (1, 2)]
    for batches in epochs:
        assert sorted(np.concatenate(batches)) == list(range(3000))
        # the schedule's step count holds
        assert len(batches) == math.ceil(3000 / 32) and max(map(len, batches)) == 32
        assert useful(batches) > 0.95
    order = np.random.default_rng(1).permutation(3000)
    # what plain shuffled batches waste
    assert useful([order[i:i + 32] for i in range(0, 3000, 32)]) < 0.6
    assert [list(b) for b in epochs[0]] != [list(b) for b in epochs[1]]


def test_finetune_learns_and_reports_every_seed(ckpt, tmp_path, capsys):
    keyword_task(tmp_path, 400, 0)
    keyword_task(tmp_path, 100, 1)
    out = tmp_path / "keyword.json"
    E.main(["finetune", "--ckpt", str(ckpt), "--task", "keyword", "--data-dir", str(tmp_path),
            "--seeds", "1,2", "--lr", "1e-3", "--epochs", "4", "--batch-size", "16",
            "--device", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["kind"] == "finetune" and r["pretrain_seed"] == 7 and set(r["runs"]) == {"1", "2"}
    assert r["aggregate"]["mcc"]["mean"] > 0.8 and len(r["aggregate"]["mcc"]["values"]) == 2
    for run in r["runs"].values():  # the reported metrics are those of the reported predictions
        cm = results.confusion(r["examples"]["label"], run["pred"], 2)
        assert run["metrics"]["mcc"] == pytest.approx(results.mcc(cm))
    said = capsys.readouterr().out
    assert "mcc" in said
    # issue 43: each seed says when and why it stopped, as its per-epoch lines show it
    for seed, run in r["runs"].items():
        mcc = [float(line.split("mcc ")[1].split(",")[0]) for line in said.splitlines()
               if line.startswith(f"  seed {seed} epoch ")]
        best = 1 + mcc.index(max(mcc))  # the first best epoch (chosen on validation here)
        waited = len(mcc) - best
        why = (f"stopped after epoch {len(mcc)} of 4: no better mcc for {waited} epochs "
               f"(--patience 3)" if waited >= 3 else "ran all 4 epochs")
        assert (run["stopped"], run["epoch"], run["epochs_run"]) == (why, best, len(mcc))
        assert f"  seed {seed}: {why}; kept epoch {best}" in said


def test_finetune_can_choose_epochs_without_seeing_validation(ckpt, tmp_path, monkeypatch):
    """With --holdout the epoch is chosen on held-out training examples: the choice must not
    change whatever the validation labels say."""
    keyword_task(tmp_path, 400, 0)
    keyword_task(tmp_path, 100, 1)
    runs = {}
    for flip in (False, True):
        if flip:  # invert every validation label: a validation-driven choice would move
            valid = tmp_path / "keyword.valid.jsonl"
            rows = [json.loads(line) for line in valid.read_text().splitlines()]
            valid.write_text("".join(json.dumps({**r, "label": 1 - r["label"]}) + "\n"
                                     for r in rows))
        out = tmp_path / f"r{flip}.json"
        # lr 1e-4: the scores still climb over the 4 epochs, so the two choices would differ
        E.main(["finetune", "--ckpt", str(ckpt), "--task", "keyword", "--data-dir", str(tmp_path),
                "--lr", "1e-4", "--epochs", "4", "--patience", "4", "--batch-size", "16",
                "--device", "cpu", "--holdout", "0.2", "--out", str(out)])
        runs[flip] = json.loads(out.read_text())["runs"]["1"]
    # validation's mcc climbs, so flipped labels would choose epoch 1 and the true ones a later one
    assert runs[False]["epoch"] == runs[True]["epoch"] > 1
    assert runs[False]["pred"] == runs[True]["pred"]
    assert runs[True]["metrics"]["mcc"] == pytest.approx(-runs[False]["metrics"]["mcc"])


def test_a_gpt_bert_model_is_scored_by_its_own_rule(ckpt, tmp_path):
    """A gpt-bert checkpoint's blimp.json is scored by mntp, the pipeline's rule for it; another
    scorer writes its own file (pll, which reads where gpt-bert was not trained to predict, only
    with --any-scorer)."""
    state = read_checkpoint(ckpt)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint({**state, "predicts_before": True,
                     "args": {**state["args"], "objective": "gpt-bert",
                              "causal_fraction": 0.0625}},
                    run / "ckpt.pt")
    src = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    folder = tmp_path / "mini"
    folder.mkdir()
    lines = (src / "anaphor_gender_agreement.jsonl").read_text().splitlines(True)
    (folder / "anaphor_gender_agreement.jsonl").write_text("".join(lines[:6]))
    for scorer in ([], ["--scorer", "causal"], ["--scorer", "pll", "--any-scorer"]):
        E.main(["blimp", "--ckpt", str(run / "ckpt.pt"), "--blimp-dir", str(folder), *scorer,
                "--device", "cpu"])
    said = {f.name: json.loads(f.read_text())["scorer"] for f in (run / "eval").glob("*.json")}
    assert said == {"blimp.json": "mntp", "blimp_causal.json": "causal", "blimp_pll.json": "pll"}


def test_compare_reads_a_folder_by_the_kinds_it_can_compare(tmp_path, capsys):
    """Issue 84: two runs' eval/ folders: weights.json (no per-example section, written by
    evaluate.py itself) is passed over; a folder holding two kinds (blimp.json and mlm.json) is
    refused in one line naming them; a folder of study results without the section asked for
    names the sections it has."""
    def result(path, seed, kind, metric="accuracy", key="examples"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": kind, "pretrain_seed": seed, key: {
            "id": [0, 1, 2, 3], "label": [1, 0, 1, 1], "pred": [[1, 0, seed % 2, 1]],
            "metric": metric, "k": 2}}))
    for run, seed in (("a", 0), ("b", 1)):
        result(tmp_path / run / "eval" / "blimp.json", seed, "blimp")
        (tmp_path / run / "eval" / "weights.json").write_text(json.dumps({"rows": []}))
    E.main(["compare", str(tmp_path / "a" / "eval"), str(tmp_path / "b" / "eval"), "--nboot",
            "50"])
    assert "A: 1 seeds [0], B: 1 seeds [1]; blimp accuracy" in capsys.readouterr().out
    result(tmp_path / "a" / "eval" / "mlm.json", 0, "mlm", "mean", key="loss_span")  # no
    E.main(["compare", str(tmp_path / "a" / "eval"), str(tmp_path / "b" / "eval"), "--nboot",
            "50"])                              # 'examples' (a masking must be chosen): left out
    assert "A: 1 seeds [0], B: 1 seeds [1]; blimp accuracy" in capsys.readouterr().out
    result(tmp_path / "a" / "eval" / "rte.json", 0, "finetune")
    with pytest.raises(SystemExit) as stopped:
        E.main(["compare", str(tmp_path / "a" / "eval"), str(tmp_path / "b" / "eval")])
    assert str(stopped.value) == (f"error: {tmp_path / 'a' / 'eval'} holds results of 2 kinds "
                                  f"(blimp.json, rte.json): give one file or quoted glob a side, "
                                  f"e.g. {tmp_path / 'a' / 'eval' / 'blimp.json'}")
    for arm in ("mlm", "boot"):
        result(tmp_path / "study" / arm / "s0.json", 0, "study-run", "mean", key="loss_uniform")
    with pytest.raises(SystemExit) as stopped:
        E.main(["compare", str(tmp_path / "study" / "mlm"), str(tmp_path / "study" / "boot")])
    assert str(stopped.value) == (f"error: no result file in {tmp_path / 'study' / 'mlm'} has a "
                                  f"'examples' section; theirs: loss_uniform (--examples NAME)")


def test_result_files_of_one_masking_are_read_under_todays_names(tmp_path):
    """A study result or an evaluate.py mlm.json made before two maskings: its one masking is
    uniform's draw, and it is read as loss_uniform and acc_uniform (so compare and the reports
    read committed results made then), today's names left as they are."""
    section = {"id": [0], "label": [0], "pred": [[1.0]], "metric": "mean", "k": 0}
    for kind, old in (("study-run", ("val_loss", "val_acc")),
                      ("mlm", ("examples_loss", "examples"))):
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps({"kind": kind, old[0]: section, old[1]: section}))
        r = results.read_result(path)
        assert {"loss_uniform", "acc_uniform"} <= set(r) and not set(old) & set(r)
    path.write_text(json.dumps({"kind": "blimp", "examples": section}))
    assert "examples" in results.read_result(path)  # another kind's section keeps its name


def test_blimp_then_compare(ckpt, tmp_path, capsys):
    src = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    folder = tmp_path / "mini"
    folder.mkdir()
    for name in ("anaphor_gender_agreement", "regular_plural_subject_verb_agreement_1"):
        lines = (src / f"{name}.jsonl").read_text().splitlines(True)
        (folder / f"{name}.jsonl").write_text("".join(lines[:20]))
    for scorer in ("pll", "word-l2r"):
        E.main(["blimp", "--ckpt", str(ckpt), "--blimp-dir", str(folder), "--scorer", scorer,
                "--device", "cpu"])
    r = json.loads((ckpt.parent / "eval" / "blimp.json").read_text())
    assert (ckpt.parent / "eval" / "blimp_l2r.json").exists()
    assert len(r["pairs"]) == 40
    assert r["best_temperature"] in r["temperatures"] and 1.0 in r["temperatures"]
    t1 = r["temperatures"].index(1.0)
    wins = [int(p["good"][t1] > p["bad"][t1]) for p in r["pairs"]]
    assert r["examples"]["pred"] == [wins]
    macro = np.mean([np.mean(wins[:20]), np.mean(wins[20:])])
    assert r["summary"]["mini"]["macro_paradigms"][0] == pytest.approx(macro)
    report = [p for p in r["pairs"] if p["half"] == 1]
    assert r["examples_best_t"]["id"] == [p["id"] for p in report]
    out = capsys.readouterr().out
    assert "sentences/s" in out and "anaphor_agreement" in out
    # issue 43: the headline before the tables, and the ties counted (wrong here, as the JSON says)
    last = out[out.rindex("BLiMP accuracy %"):]
    assert last.index("mini: over paradigms") < last.index("mini, per paradigm")
    assert r["ties"] == sum(p["good"][t1] == p["bad"][t1] for p in r["pairs"])
    assert f"ties: {r['ties']} of 40 pairs" in last
    won_or_tied = [int(p["good"][t1] >= p["bad"][t1]) for p in r["pairs"]]
    pipeline = np.mean([np.mean(won_or_tied[:20]), np.mean(won_or_tied[20:])])  # its mean of UIDs
    assert r["summary"]["mini"]["pipeline_average"] == pytest.approx(pipeline)
    assert (f"to quote (over paradigms, all pairs, T=1): mini {100 * macro:.2f}; the BabyLM "
            f"pipeline's average, ties counted right: mini {100 * pipeline:.2f}") in last
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    for s in (1, 2):
        (tmp_path / "A" / f"s{s}.json").write_text(json.dumps({**r, "pretrain_seed": s}))
        (tmp_path / "B" / f"s{s}.json").write_text(json.dumps({**r, "pretrain_seed": s}))
    E.main(["compare", str(tmp_path / "A"), str(tmp_path / "B"), "--nboot", "200",
            "--out", str(tmp_path / "c.json")])
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["paired_seeds"] and c["diff"] == 0 and c["p"] == 0.5
    said = capsys.readouterr()
    assert "BLiMP accuracy, all pairs, T=1: mean A " in said.out and "warning" not in said.err
    # one pretraining seed twice in a group: said, as the two files it is in
    (tmp_path / "B" / "s2.json").write_text(json.dumps({**r, "pretrain_seed": 1}))
    E.main(["compare", str(tmp_path / "A"), str(tmp_path / "B"), "--nboot", "200"])
    said = capsys.readouterr()
    assert said.err.count("warning: pretraining seed 1 appears twice") == 1
    assert str(tmp_path / "B" / "s1.json") in said.err and "seeds [1, 1]" in said.out


def test_ties_count_as_wrong(ckpt, tmp_path):
    (tmp_path / "same").mkdir()
    same = {"sentence_good": "the cat sat.", "sentence_bad": "the cat sat."}
    (tmp_path / "same" / "p.jsonl").write_text("".join(
        json.dumps({**same, "pair_id": i}) + "\n" for i in range(4)))
    E.main(["blimp", "--ckpt", str(ckpt), "--blimp-dir", str(tmp_path / "same"), "--device", "cpu",
            "--out", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert all(p["good"] == p["bad"] for p in r["pairs"])
    assert r["summary"]["same"]["macro_paradigms"][0] == 0


def test_a_run_folder_stands_for_its_checkpoint(ckpt, tmp_path):
    """As export.py's --ckpt does: `--ckpt runs/NAME` said "no checkpoint at runs/NAME"."""
    out = tmp_path / "w.json"
    E.main(["weights", "--ckpt", str(ckpt.parent), "--out", str(out)])
    assert json.loads(out.read_text())["ckpt"] == str(ckpt)


def test_cli_errors_are_one_line(ckpt, tmp_path):
    (tmp_path / "rte.train.jsonl").write_text("")
    (tmp_path / "rte.valid.jsonl").write_text('{"sentence1": "a", "sentence2": "b", "label": 1}\n')
    rte = ["--task", "rte", "--data-dir", str(tmp_path)]
    cases = [(["blimp", "--ckpt", str(ckpt), "--blimp-dir", str(tmp_path / "nope")],
              "no BLiMP folder at"),
             (["finetune", "--ckpt", str(ckpt), *rte], r"rte\.train\.jsonl holds no examples"),
             (["finetune", "--ckpt", str(tmp_path / "rte.valid.jsonl"), *rte],
              "cannot read checkpoint"),
             (["finetune", "--ckpt", str(ckpt), "--task", "rtee", "--data-dir", str(tmp_path)],
              r"no rtee\.train\.jsonl in .* \(the tasks there: rte\)"),
             (["fill", "--ckpt", str(ckpt), "no mask here"], "'no mask here' has no \\[MASK\\]")]
    for argv, pattern in cases:
        r = run_script("evaluate.py", *argv)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert __import__("re").search(pattern, r.stderr.strip().splitlines()[-1]), r.stderr


def test_flags_wrong_for_the_checkpoint_are_one_line_and_write_nothing(ckpt, tmp_path, capsys):
    """Issue 83: a scorer that reads an MLM model where it was never trained to predict (causal,
    mntp), and a --seq-len past the model's positions, are refused as a bad flag is (exit 2, one
    line naming the flag), before anything is scored or written; --any-scorer asks for the
    scorer anyway and writes its own file."""
    folder = tmp_path / "mini"
    folder.mkdir()
    src = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    lines = (src / "anaphor_gender_agreement.jsonl").read_text().splitlines(True)
    (folder / "anaphor_gender_agreement.jsonl").write_text("".join(lines[:4]))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ckpt, run / "ckpt.pt")
    blimp = ["blimp", "--ckpt", str(run / "ckpt.pt"), "--blimp-dir", str(folder), "--device",
             "cpu"]
    cases = [([*blimp, "--scorer", "causal"], "--scorer causal: this model is read by pll or "
              "word-l2r (--any-scorer scores it by causal anyway)"),
             ([*blimp, "--scorer", "mntp"], "--scorer mntp: this model is read by pll or "
              "word-l2r"),
             (["mlm", "--ckpt", str(run / "ckpt.pt"), "--seq-len", "100000", "--device", "cpu"],
              "--seq-len 100000: the model reads at most 512 positions")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as stopped:
            E.main(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("\n") == 1 and says in err, err
        assert err.startswith(f"evaluate.py {argv[0]}: error: ")
    with pytest.raises(SystemExit) as stopped:
        E.main([*blimp, "--out", str(tmp_path)])
    assert stopped.value.code == 2 and "--out " + str(tmp_path) + " is a folder; give the " \
        "result file's path" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    for argv in (blimp, ["mlm", "--ckpt", str(run / "ckpt.pt"), "--device", "cpu"]):
        with pytest.raises(SystemExit) as stopped:
            E.main([*argv, "--out", str(tmp_path / "file" / "r.json")])
        bad = tmp_path / "file" / "r.json"
        assert str(stopped.value).startswith(f"error: cannot write {bad}: ")  # the OS's reason
    assert sorted(p.name for p in run.iterdir()) == ["ckpt.pt"]  # no eval/, no partial file
    E.main([*blimp, "--scorer", "causal", "--any-scorer"])
    assert json.loads((run / "eval" / "blimp_causal.json").read_text())["scorer"] == "causal"


def test_own_scorers_follow_the_objective():
    """What each kind of checkpoint is read by, its own scorer first: an MLM-style model where
    the token is, gpt-bert at the position before it, and causally only if it trained causal
    rows."""
    model = lambda before, args: SimpleNamespace(predicts_before=before, train_args=args)
    assert E.own_scorers(model(False, {"objective": "mlm"})) == ("pll", "word-l2r")
    assert E.own_scorers(model(True, {"causal_fraction": 1 / 16})) == ("mntp", "causal")
    assert E.own_scorers(model(True, {"causal_fraction": 0.0})) == ("mntp",)


def test_weight_stats_hand_computed():
    """Modules group tensors by name up to the layer; mean, std and max |w| over them together."""
    shape = {"n_layer": 1, "vocab_size": 50, "d_model": 8, "d_ff": 8}
    model = Encoder(ModelConfig(**{**PRESETS["tiny"], **shape}))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
        model.layers[0].attn.qk.weight.copy_(torch.arange(128.0).reshape(16, 8))
    rows = {r["module"]: r for r in E.weight_stats(model)}
    assert set(rows) == {"word", "rel", "rel_norm", "layers.0.attn", "layers.0.ffn", "head_in",
                         "head_bias"}
    tensors = list(model.layers[0].attn.parameters())
    attn = torch.cat([p.detach().flatten() for p in tensors])
    assert rows["layers.0.attn"]["params"] == attn.numel() == sum(p.numel() for p in tensors)
    assert rows["layers.0.attn"]["mean"] == pytest.approx(attn.mean().item())
    assert rows["layers.0.attn"]["std"] == pytest.approx(attn.std().item())
    assert rows["layers.0.attn"]["max_abs"] == 127.0
    assert rows["word"] == dict(module="word", params=400, mean=1.0, std=0.0, max_abs=1.0)


# --- masked-token loss: `evaluate.py mlm` and the Multi-Bootstrap of a mean ----------------------

def test_mean_metric_matches_brute_force_enumeration():
    """Per-example values (a segment's loss), lower is better: 2 seeds x 2 examples, unpaired
    seeds, paired examples, every one of the 4 x 4 x 4 draws enumerated."""
    value = lambda seed, v: {"seed": seed, "id": ["a", "b"], "label": np.zeros(2),
                             "pred": np.array([v], float), "metric": "mean", "k": 0,
                             "better": "lower", "path": "x"}
    A = [value(1, [3.0, 2.0]), value(2, [2.5, 2.5])]
    B = [value(3, [2.0, 2.4]), value(4, [2.6, 2.2])]
    exact_p = enumerated_p(A, B, lower_is_better=True)  # B not better: a higher loss
    r = multibootstrap.multibootstrap(A, B, nboot=40000, block=5000)
    assert r["mean_a"] == pytest.approx(2.5) and r["mean_b"] == pytest.approx(2.3)
    assert r["better"] == "lower" and r["p"] == pytest.approx(exact_p, abs=0.01)
    with pytest.raises(SystemExit, match="different metrics"):
        multibootstrap.multibootstrap(A, [{**b, "better": "higher"} for b in B], nboot=10)


@pytest.mark.parametrize("objective", ["mlm", "gpt-bert"])
def test_masked_lm_against_a_loop_over_hidden_tokens(ckpt, small_raw, prepared, tmp_path,
                                                     monkeypatch, capsys, objective):
    """Each segment's loss and accuracy, under each masking, equal a loop that reads every logit
    at every position and scores the [MASK]ed ones one by one (a gpt-bert model's at the
    position before each): uniform hides int(0.15 T) per segment, span hides span_mask's
    choice, every hidden token [MASK] in both, the same ones for any model; the share whose
    previous piece is shown, and the loss there, counted by the loop too."""
    monkeypatch.setenv("NANOMLM_DATA", str(prepared.parent))
    if objective == "gpt-bert":
        state = read_checkpoint(ckpt)
        ckpt = tmp_path / "gpt-bert.pt"
        save_checkpoint({**state, "predicts_before": True}, ckpt)
    shift = int(objective == "gpt-bert")
    out = tmp_path / "mlm.json"
    E.main(["mlm", "--ckpt", str(ckpt), "--data", str(small_raw), "--segments", "6",
            "--seq-len", "32", "--batch-size", "4", "--device", "cpu", "--out", str(out)])
    r = json.loads(out.read_text())
    model, _ = E.load_checkpoint(ckpt)
    tokens = np.fromfile(prepared / "val.bin", dtype=np.uint16).astype(np.int64)
    for masking in ["uniform", "span"]:
        losses, accs, hidden_sets, shown = [], [], [], []
        for first, size in [(0, 4), (4, 2)]:  # the batches the command drew
            seed = E.seed_of(0, first) if masking == "uniform" else E.seed_of(0, first, 1)
            gen = torch.Generator().manual_seed(seed)
            body = torch.from_numpy(tokens[:6 * 30].reshape(6, 30)[first:first + size])
            ids = torch.cat([torch.full((size, 1), CLS), body, torch.full((size, 1), SEP)], 1)
            if masking == "uniform":
                inputs, _ = uniform_mask(ids, 0.15, gen)
            else:
                _, labels = span_mask(ids, 0.15, 2000, gen)
                inputs = torch.where(labels != -100, MASK, ids)
            with torch.no_grad():
                logits = model.logits(inputs).log_softmax(-1)                 # (b, T, V)
            for row in range(size):
                hidden = [t for t in range(32) if inputs[row, t] == MASK]
                hidden_sets.append(hidden)
                if not hidden:
                    continue
                nll = [-logits[row, t - shift, ids[row, t]].item() for t in hidden]
                hit = [float(logits[row, t - shift].argmax() == ids[row, t]) for t in hidden]
                shown += [(inputs[row, t - 1] > MASK, x) for t, x in zip(hidden, nll)]
                losses.append(np.mean(nll))
                accs.append(np.mean(hit))
        if masking == "uniform":
            assert all(len(h) == int(0.15 * 32) for h in hidden_sets)
        else:  # spans: runs of hidden tokens longer than one, other counts per segment
            assert len({len(h) for h in hidden_sets}) > 1
            assert any(b - a == 1 for h in hidden_sets for a, b in zip(h, h[1:]))
        assert all(0 not in h and 31 not in h for h in hidden_sets)
        assert r[f"loss_{masking}"]["pred"][0] == pytest.approx(losses, rel=1e-5)
        assert r[f"acc_{masking}"]["pred"][0] == pytest.approx(accs)
        got = r["maskings"][masking]
        assert got["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
        assert got["hidden"] == sum(map(len, hidden_sets))
        assert got["previous_shown"] == pytest.approx(np.mean([s for s, _ in shown]))
        assert got["loss_previous_shown"] == pytest.approx(
            np.mean([x for s, x in shown if s]), rel=1e-5)
        assert r[f"loss_{masking}"]["better"] == "lower"
    assert r["pretrain_seed"] == 7 and r["read_at"] == ("t - 1" if shift else "t")
    assert r["step"] == 40  # the checkpoint's, so a result says which weights it scored
    printed = capsys.readouterr().out
    assert "6 validation segments" in printed
    assert f"read from the model at {r['read_at']}" in printed
    for masking in ("uniform", "span"):  # each masking's row, its floors beside its loss
        floors = r["maskings"][masking]["floors"]
        assert re.search(rf"^{masking} .* {r['maskings'][masking]['loss']:.4f} .* "
                         rf"{floors['unigram']:.4f} +{floors['bigram']:.4f} ", printed, re.M)


def test_masked_lm_draws_each_masking_alone(ckpt, small_raw, prepared, tmp_path, monkeypatch):
    """A masking's hidden tokens are its own: asked alone, or the other way round, each gives
    the segments it gives beside the other (so results made with other --maskings compare)."""
    monkeypatch.setenv("NANOMLM_DATA", str(prepared.parent))

    def sections(*flags):
        out = tmp_path / "mlm.json"
        E.main(["mlm", "--ckpt", str(ckpt), "--data", str(small_raw), "--segments", "4",
                "--seq-len", "32", "--device", "cpu", "--out", str(out), *flags])
        r = json.loads(out.read_text())
        return {k: v["pred"] for k, v in r.items() if k.startswith(("loss_", "acc_"))}

    both = sections()
    assert set(both) == {"loss_uniform", "acc_uniform", "loss_span", "acc_span"}
    assert sections("--maskings", "span,uniform") == both
    assert sections("--maskings", "span") == {k: v for k, v in both.items() if "span" in k}


def test_count_floors_against_counting_by_hand():
    """The unigram (add-one) and Witten-Bell bigram of a short stream, against the formulas
    written out with a Counter: p(w | v) = (c(v w) + N(v) p1(w)) / (c(v) + N(v)); the unigram
    where no previous piece is shown (-1) or the piece was never seen before another; and, for a
    seen v, a distribution over the vocabulary (it sums to 1)."""
    stream = np.array([5, 6, 5, 7, 5, 6, 8, 6, 5, 9, 9, 6], np.uint16)
    V = 11
    floors = E.CountFloors(stream, V)
    uni = collections.Counter(stream.tolist())
    p1 = lambda w: (uni[w] + 1) / (len(stream) + V)
    pairs = collections.Counter(zip(stream[:-1].tolist(), stream[1:].tolist()))
    seen = collections.Counter(stream[:-1].tolist())
    after = lambda v: len({b for a, b in pairs if a == v})
    want = lambda v, w: (pairs[v, w] + after(v) * p1(w)) / (seen[v] + after(v))
    prev = np.array([5, 5, 6, 9, 9, -1, 8, 7, 10, 6])   # 10: never seen before another piece
    target = np.array([6, 8, 5, 6, 9, 5, 6, 9, 5, 10])
    expect = [-math.log(p1(w) if v < 0 or not seen[v] else want(v, w)) for v, w in
              zip(prev, target)]
    assert floors.bigram(prev, target) == pytest.approx(expect, rel=1e-12)
    assert floors.unigram(target) == pytest.approx([-math.log(p1(w)) for w in target])
    for v in (5, 6, 9):
        everything = np.arange(V)
        assert np.exp(-floors.bigram(np.full(V, v), everything)).sum() == pytest.approx(1)


def test_babylm2025_schedule_is_the_pipelines_rule():
    """Transcribed from the pipeline's finetune/utils.py: lr 0 at step 0, the peak at the end
    of warm-up, half way down the cosine at the middle of the rest, 0.1 at the end."""
    f = lambda s: optim.cosine_with_warmup(s, warmup=6, steps=106)
    assert f(0) == 0 and f(3) == 0.5 and f(6) == 1.0
    assert f(56) == pytest.approx(0.1 + 0.9 * 0.5) and f(106) == pytest.approx(0.1)


@pytest.mark.parametrize("task, typed, want", [
    ("rte", [], dict(lr=3e-5, batch_size=32, epochs=10, patience=None, max_len=512)),
    ("wsc", [], dict(epochs=30, batch_size=32)),
    ("boolq", [], dict(batch_size=16, epochs=10)),
    ("wsc", ["--epochs", "3", "--lr", "1e-4"], dict(epochs=3, lr=1e-4)),  # typed flags win
])
def test_babylm2025_recipe_settings(task, typed, want):
    args = E.build_parser().parse_args(["finetune", "--ckpt", "x", "--task", task, "--data-dir",
                                        "d", "--recipe", "babylm2025", *typed])
    finetune.recipe_settings(args)
    assert {k: getattr(args, k) for k in want} == want
    assert args.group_by_length is False


def test_finetune_babylm2025_runs_every_epoch_and_keeps_the_best(ckpt, tmp_path, capsys):
    keyword_task(tmp_path, 150, 0)  # (150 > 100: the training file)
    keyword_task(tmp_path, 40, 1)
    out = tmp_path / "keyword.json"
    E.main(["finetune", "--ckpt", str(ckpt), "--task", "keyword", "--data-dir", str(tmp_path),
            "--recipe", "babylm2025", "--epochs", "3", "--lr", "1e-3", "--device", "cpu",
            "--out", str(out)])
    r = json.loads(out.read_text())
    run = r["runs"]["1"]
    assert run["epochs_run"] == 3 and r["settings"]["max_len"] == 512  # no early stopping
    # the pipeline's rule: the epoch with the best validation score, the first of ties
    printed = [float(line.split("mcc ")[1].split(",")[0]) for line in
               capsys.readouterr().out.splitlines() if line.startswith("  seed 1 epoch ")]
    assert len(printed) == 3 and len(set(printed)) > 1  # (a choice to make)
    assert run["epoch"] == printed.index(max(printed)) + 1
    assert r["settings"]["patience"] is None and r["settings"]["batch_size"] == 32
    cm = results.confusion(r["examples"]["label"], run["pred"], 2)
    assert run["metrics"]["mcc"] == pytest.approx(results.mcc(cm))


def test_supplement_pair_ids_keep_an_items_variants_in_one_half(tmp_path):
    rows = [{"sentence_good": f"good {i}", "sentence_bad": f"bad {i}", "pair_ID": i // 4}
            for i in range(40)]  # 10 items of 4 variants, as subject_aux_inversion
    (tmp_path / "subject_aux_inversion.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    pairs = E.read_blimp([tmp_path])
    assert len({p["id"] for p in pairs}) == 40 and len({p["item"] for p in pairs}) == 10
    assert pairs[5]["id"] == "subject_aux_inversion/1/6"
    halves = {}
    for p in pairs:
        halves.setdefault(p["item"], set()).add(E.half_of(p["item"]))
    assert all(len(h) == 1 for h in halves.values())


def test_phenomenon_is_the_mean_of_its_paradigms(ckpt, tmp_path):
    src = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    folder = tmp_path / "mini"
    folder.mkdir()
    for name, n in (("anaphor_gender_agreement", 30), ("anaphor_number_agreement", 6)):
        (folder / f"{name}.jsonl").write_text(
            "".join((src / f"{name}.jsonl").read_text().splitlines(True)[:n]))
    out = tmp_path / "b.json"
    E.main(["blimp", "--ckpt", str(ckpt), "--blimp-dir", str(folder), "--device", "cpu",
            "--out", str(out)])
    r = json.loads(out.read_text())
    para = r["paradigms"]["mini"]
    phen = r["phenomena"]["mini"]["anaphor_agreement"]
    a, b = para["anaphor_gender_agreement"], para["anaphor_number_agreement"]
    assert phen[0] == pytest.approx((a[0] + b[0]) / 2) and phen[3] == 36
    # pooled over pairs it would weigh the 30-pair paradigm five times the other
    assert a[0] == b[0] or phen[0] != pytest.approx((30 * a[0] + 6 * b[0]) / 36)


def bf16_by_default(device, bf16=None):
    """device.use_bf16 as it answers on a CUDA device (bf16 unless told), to stand in on the CPU."""
    return True if bf16 is None else bf16


def test_scores_are_float32_unless_bf16_is_asked(ckpt, monkeypatch):
    model, tok = E.load_checkpoint(ckpt)
    seqs = [[2, *tok.encode("the cat sat on the mat"), 3], [2, *tok.encode("a dog ran"), 3]]
    starts = E.word_starts(tok)
    score = lambda **k: E.pll(model, seqs, [1.0], "pll", 64, torch.device("cpu"), starts,
                              progress=False, **k)
    with torch.autocast("cpu", enabled=False):
        want = score(bf16=False)
    monkeypatch.setattr(plumbing, "use_bf16", bf16_by_default)  # as on CUDA
    assert not np.allclose(score(bf16=None), want, atol=1e-4)  # the stand-in takes effect
    assert np.array_equal(score(), want)  # the default is float32 even there
    assert not np.allclose(score(bf16=True), want, atol=1e-4)  # bf16 differs: the flag reaches it


def test_masked_lm_scores_in_float32_unless_bf16_is_asked(ckpt, small_raw, prepared, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("NANOMLM_DATA", str(prepared.parent))

    def losses(*flags):
        out = tmp_path / "mlm.json"
        E.main(["mlm", "--ckpt", str(ckpt), "--data", str(small_raw), "--segments", "4",
                "--seq-len", "32", "--device", "cpu", "--out", str(out), *flags])
        return json.loads(out.read_text())["loss_span"]["pred"][0]

    want = losses()  # on the CPU: float32 whatever the default
    monkeypatch.setattr(plumbing, "use_bf16", bf16_by_default)  # as on CUDA
    assert losses() == want
    assert not np.allclose(losses("--bf16"), want, atol=1e-4)


@pytest.mark.parametrize("argv, says", [
    (["finetune", "--ckpt", "x", "--task", "rte", "--data-dir", "y", "--lr", "-1"],
     "--lr: must be >= 0, not -1"),
    (["finetune", "--ckpt", "x", "--task", "rte", "--data-dir", "y", "--holdout", "1"],
     "--holdout: must be in [0, 1), not 1"),
    (["blimp", "--ckpt", "x", "--blimp-dir", "y", "--temperatures", "1,-2"],
     "--temperatures: must be > 0, not -2"),
    (["compare", "a", "b", "--nboot", "0"], "--nboot: must be >= 1, not 0"),
    (["mlm", "--ckpt", "x", "--mask-p", "2"], "--mask-p: must be in (0, 1), not 2"),
])
def test_bad_numbers_are_one_line_before_anything_is_read(argv, says, capsys):
    """Issue 43: every numeric flag is range-checked before a checkpoint or a file is read."""
    with pytest.raises(SystemExit) as stopped:
        E.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("objective", ["mlm", "boot", "gpt-bert"])
def test_fill_shows_the_models_own_top_guesses(ckpt, tmp_path, objective, capsys):
    """`fill` on any checkpoint: for each [MASK], the top-k pieces and probabilities of the
    model's distribution there, as the full (B, T, V) logits give them (a path that does not
    pick positions), with every [MASK] hidden at once; the first line puts each top guess in
    place. A boot checkpoint predicts through its decoder, as it was trained to; a gpt-bert one
    at the position before each [MASK]."""
    path = ckpt
    if objective == "gpt-bert":
        saved = load_state(ckpt)
        path = tmp_path / "gpt-bert.pt"
        save_checkpoint({**saved, "predicts_before": True}, path)
    if objective == "boot":
        saved = load_state(ckpt)
        torch.manual_seed(1)
        heads = BootHeads(ModelConfig(**saved["config"]), 1, mae=True)
        path = tmp_path / "boot.pt"
        save_checkpoint({**saved, "objective": "boot", "decoder": True,
                         "heads": heads.state_dict()}, path)
    E.main(["fill", "--ckpt", str(path), "the cat [MASK] on the [MASK] .", "--top-k", "3",
            "--device", "cpu"])
    out = capsys.readouterr().out.splitlines()
    model, tok = E.load_checkpoint(path)
    assert isinstance(model, BootPredictor) == (objective == "boot")
    ids = [CLS, *tok.encode("the cat"), MASK, *tok.encode("on the"), MASK, *tok.encode("."), SEP]
    x = torch.tensor([ids])
    with torch.no_grad():
        read = (x[0] == MASK).roll(-(objective == "gpt-bert"), 0)
        probs = model.logits(x)[0].float().softmax(-1)[read]                  # (2, V)
    top = probs.topk(3, -1)
    for m in range(2):
        want = "  ".join(f"{tok.id_to_piece(int(t)).replace('▁', ' ')!r} {100 * float(q):.1f}%"
                         for q, t in zip(top.values[m], top.indices[m]))
        assert out[1 + m] == f"  [MASK] {m + 1}: {want}"
    first, second = top.indices[:, 0].tolist()
    at = [i for i, t in enumerate(ids[1:-1]) if t == MASK]
    guess = list(ids[1:-1])
    guess[at[0]], guess[at[1]] = first, second
    assert out[0] == tok.decode(guess)
    # text glued to a [MASK] is read as in running text: the ids of "the cat sat on the." with
    # its last word hidden (not "." as a word of its own)
    ids = [CLS, *tok.encode("the cat sat on the."), SEP]
    last = max(i for i, t in enumerate(ids) if tok.id_to_piece(t) == "▁the")
    ids[last] = MASK
    E.main(["fill", "--ckpt", str(path), "the cat sat on [MASK].", "--top-k", "1",
            "--device", "cpu"])
    x = torch.tensor([ids])
    with torch.no_grad():
        probs = model.logits(x)[0].float().softmax(-1)[last - (objective == "gpt-bert")]
    q, t = probs.max(-1)
    assert capsys.readouterr().out.splitlines()[1] == (
        f"  [MASK] 1: {tok.id_to_piece(int(t)).replace('▁', ' ')!r} {100 * float(q):.1f}%")


def test_a_second_blimp_on_the_same_result_is_refused(ckpt, tmp_path):
    """Two `evaluate.py blimp` writing one result would write one partial file at once: the
    second is refused in one line, naming the first; once it has ended, the next one runs."""
    from machinery.plumbing import hold_lock
    folder = tmp_path / "mini"
    folder.mkdir()
    src = (shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
           / "anaphor_gender_agreement.jsonl")
    (folder / "p.jsonl").write_text("".join(src.read_text().splitlines(True)[:4]))
    out = tmp_path / "r.json"
    argv = ["blimp", "--ckpt", str(ckpt), "--blimp-dir", str(folder), "--device", "cpu",
            "--out", str(out)]
    held = hold_lock(tmp_path / "r.json.lock", "x", "")  # another process's, as far as flock sees
    with pytest.raises(SystemExit, match=f"error: {out} is in use by process .*; wait for that"):
        E.main(argv)
    held.close()
    E.main(argv)  # the first gone, its lock file is taken over
    assert out.exists()


def test_a_verdict_sentence_says_what_its_interval_says():
    """evaluation/multibootstrap.verdict, on hand-computed t intervals: paired seeds b - a =
    (-1, -0.5, -0.6) nats: mean -0.7, sd sqrt(0.07), se 0.15275, t(2) 4.3027: interval
    -1.3572..-0.0428 excludes 0 ("lower by"); (+0.1, -0.05, 0.0) holds 0 ("not
    distinguishable"); rates print in points; Welch names itself approximate; one seed a side
    is a demo."""
    t = multibootstrap.seed_interval([4.0, 4.0, 4.0], [3.0, 3.5, 3.4], True)
    assert multibootstrap.verdict(t, "lower", 3, 3) == (
        "lower by 0.7000 nats, 95% t interval -1.3572..-0.0428 over 3 paired seeds, p = 0.044")
    t = multibootstrap.seed_interval([4.0, 4.0, 4.0], [4.1, 3.95, 4.0], True)
    assert multibootstrap.verdict(t, "lower", 3, 3).startswith(
        "not distinguishable: +0.0167 nats, 95% t interval -0.1731..+0.2064 over 3 paired seeds")
    t = multibootstrap.seed_interval([0.60, 0.62, 0.61], [0.70, 0.71, 0.69, 0.72], False)
    said = multibootstrap.verdict(t, "higher", 3, 4)
    assert said.startswith("higher by 9.50 points, 95% t interval +") and said.endswith(
        "over 3 and 4 seeds (Welch's t, approximate), p < 0.001"), said
    t = multibootstrap.seed_interval([0.6], [0.7], True)
    assert multibootstrap.verdict(t, "higher", 1, 1) == (
        "+10.00 points from one seed a side: a demo, no verdict")


def test_a_table_of_many_intervals_says_what_chance_alone_gives():
    """studies/report.many_intervals: 40 intervals, 3 excluding 0, chance about 2.0; Holm keeps
    the smallest p's while p_(k) <= 0.05 / (m - k + 1): p = 0.0001, 0.001 and 0.04 of 40 give
    0.0001 <= 0.00125 and 0.001 <= 0.00128, then 0.04 > 0.00132: two stand."""
    from studies.report import many_intervals
    none = {"ci95": [-1.0, 1.0], "p": 0.5}
    tests = [none] * 37 + [{"ci95": [0.1, 1.0], "p": p} for p in (0.0001, 0.001, 0.04)]
    assert many_intervals(tests) == (
        "40 intervals, each uncorrected: where no arm differs, chance alone excludes 0 from "
        "about 2.0 of them; 3 exclude it here, and 2 stand after Holm's correction (5%, "
        "family-wise, over the table).")
    assert many_intervals([{"ci95": None, "p": None}]) == "No intervals: one seed a side."
