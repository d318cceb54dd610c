"""data/: the tokenizer, token streams and meta.json, reuse and staleness, the errors a user can
cause, the Breton corpus, the segment reader and span masking."""
import argparse
import gzip
import json
import re
import math
import unicodedata
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import run_script, shared_data
from data import masking, tasks
from data import prepare as P


def test_special_ids_are_fixed(prepared):
    tok = P.load_tokenizer(prepared)
    assert [tok.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert (P.PAD, P.UNK, P.CLS, P.SEP, P.MASK) == (0, 1, 2, 3, 4)
    assert tok.get_piece_size() == 2000
    # "[MASK]" typed in text is ordinary text, never the control token
    assert P.MASK not in tok.encode("a [MASK] b")


def test_tokenizer_round_trip(prepared, small_raw):
    tok = P.load_tokenizer(prepared)
    lines = P.read_lines(small_raw / "childes.dev")[:5]
    lines += P.read_lines(small_raw / "simple_wiki.dev")[:5]
    for line in lines:
        # the tokenizer normalises (NFKC, whitespace runs -> one space); otherwise text stays as is
        assert tok.decode(tok.encode(line)) == " ".join(unicodedata.normalize("NFKC", line).split())
    # characters never seen in training come back through byte fallback, not as [UNK]
    rare = "Gwenn-ha-du ŋ 漢字 🙂 naïve"
    ids = tok.encode(rare)
    assert tok.decode(ids) == rare and P.UNK not in ids
    assert any(5 <= i < 5 + 256 for i in ids)  # byte pieces <0x00>..<0xFF> follow the specials


def test_streams_and_meta(prepared, small_raw):
    meta = P.load_meta(prepared)
    train = np.memmap(prepared / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(prepared / "val.bin", dtype=np.uint16, mode="r")
    assert len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    assert train.min() >= 5 and train.max() < meta["vocab_size"]  # no specials, no [UNK]
    assert meta["specials"] == {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    assert {s["split"] for s in meta["sources"]} == {"train", "dev"}
    assert meta["val_from"] == "*.dev files"
    assert meta["train_words"] == 3 * 130 * 500  # the fixture's 390 lines of 500 words
    # a stream is its lines tokenized one by one and concatenated, files in name order
    tok = P.load_tokenizer(prepared)
    dev_lines = P.read_lines(small_raw / "childes.dev")
    dev_lines += P.read_lines(small_raw / "simple_wiki.dev")
    assert val.tolist() == [i for line in dev_lines for i in tok.encode(line)]
    # unigram entropy, recounted naively
    counts = Counter(train.tolist())
    n = sum(counts.values())
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    assert meta["unigram_entropy"] == pytest.approx(entropy, rel=1e-9)


@pytest.fixture
def one_file(small_raw, tmp_path, monkeypatch):
    """A raw folder holding one text file of 130 real lines (no *.dev); prepared into
    tmp_path/prep."""
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    raw = tmp_path / "corpus"
    raw.mkdir()
    (raw / "text.txt").write_text((small_raw / "childes.train").read_text())
    return raw


def test_reuse_or_a_new_folder_keyed_by_content(one_file, tmp_path, monkeypatch):
    out = P.prepare(str(one_file), vocab_size=800, quiet=True)
    stamp = (out / "train.bin").stat().st_mtime_ns
    assert P.prepare(str(one_file), vocab_size=800, quiet=True) == out
    assert (out / "train.bin").stat().st_mtime_ns == stamp  # reused, not rewritten
    other = P.prepare(str(one_file), vocab_size=700, quiet=True)  # other tokenizer settings
    assert other != out and P.load_meta(other)["vocab_size"] == 700
    with open(one_file / "text.txt", "a") as f:  # the raw text changed: a folder of its own
        f.write("one more line of text\n")
    changed = P.prepare(str(one_file), vocab_size=700, quiet=True)
    assert changed not in (out, other) and P.load_meta(changed)["train_lines"] == 131 - 6
    # a second corpus of the same name never lands in (or over) the first one's folder
    twin = tmp_path / "elsewhere" / one_file.name
    twin.mkdir(parents=True)
    (twin / "text.txt").write_text("".join((one_file / "text.txt").open().readlines()[:100]))
    theirs = P.prepare(str(twin), vocab_size=700, quiet=True)
    assert theirs not in (out, other, changed) and P.load_meta(theirs)["train_lines"] == 95
    assert P.load_meta(out)["vocab_size"] == 800 and (out / "train.bin").stat().st_mtime_ns == stamp
    assert all(P.load_meta(p)["name"] == one_file.name for p in (out, other, changed, theirs))
    assert not list((tmp_path / "prep").glob(".*"))  # no temporary folder left behind
    # with no raw text, a name picks its one prepared copy, and refuses to guess among several
    monkeypatch.setenv("NANOMLM_RAW", str(tmp_path / "no_raw"))
    assert P.prepare(one_file.name, vocab_size=800, quiet=True) == out
    with pytest.raises(SystemExit, match=f"3 prepared copies of {one_file.name}"):
        P.prepare(one_file.name, vocab_size=700)


def test_plain_and_gzip_read_alike_and_holdout(tmp_path):
    lines = [f"line {i} with some words" for i in range(45)]
    (tmp_path / "x.txt").write_text("\n".join(lines[:30]) + "\n\n   \n")
    with gzip.open(tmp_path / "y.txt.gz", "wt") as f:
        f.write("\n".join(lines[30:]))
    (tmp_path / "z.train").write_text("\n".join(lines[:30]))
    # blank lines dropped
    assert P.read_lines(tmp_path / "x.txt") == P.read_lines(tmp_path / "z.train") == lines[:30]
    assert P.read_lines(tmp_path / "y.txt.gz") == lines[30:]
    # a folder without *.train files is read whole
    other = tmp_path / "other"
    other.mkdir()
    for f in ("x.txt", "y.txt.gz"):
        (other / f).write_bytes((tmp_path / f).read_bytes())
    assert [p.name for p in P.find_files(other)[0]] == ["x.txt", "y.txt.gz"]
    assert P.find_files(tmp_path)[0] == [tmp_path / "z.train"]


def test_holdout_every_20th_line_without_dev_files(one_file):
    meta = P.load_meta(P.prepare(str(one_file), vocab_size=800, quiet=True))
    assert (meta["train_lines"], meta["val_lines"]) == (130 - 6, 6)  # lines 19, 39, ..., 119
    assert meta["val_from"].startswith("every 20th line")


# --- errors a user can cause: one clear sentence, nothing written ------------------------------

def test_missing_corpus_says_where_it_looked_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMLM_RAW", str(tmp_path / "nowhere"))
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    with pytest.raises(SystemExit) as e:
        P.prepare("babylm_10m")
    msg = str(e.value)
    assert msg.startswith("error: no corpus folder at " + str(tmp_path / "nowhere" / "babylm_10m"))
    assert "https://osf.io/ad7qg/" in msg and "train_10M.zip" in msg and "--download" in msg
    assert not (tmp_path / "prep").exists()


@pytest.mark.parametrize("content", [None, "\n\n   \n\t\n"],
                         ids=["empty folder", "only blank lines"])
def test_corpus_without_text(tmp_path, monkeypatch, content):
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    raw = tmp_path / "corpus"
    raw.mkdir()
    if content is not None:
        (raw / "a.train").write_text(content)
    with pytest.raises(SystemExit, match="^error: .*(holds no text files|has no text)") as e:
        P.prepare(str(raw))
    assert "pass --data PATH" not in str(e.value)  # it was given one: no advice to give one
    assert not (tmp_path / "prep").exists() or not any((tmp_path / "prep").iterdir())


@pytest.mark.parametrize("label", ['"entailment"', "1.5", "true", "null"])
def test_a_label_that_is_no_integer_is_named(tmp_path, label):
    (tmp_path / "rte.train.jsonl").write_text(
        f'{{"sentence1": "a b", "sentence2": "c", "label": {label}}}\n')
    with pytest.raises(SystemExit) as e:
        tasks.read_task(tmp_path, "rte", "train", None, 32)
    assert str(e.value) == (f"error: {tmp_path / 'rte.train.jsonl'}:1 has label "
                            f"{json.loads(label)!r}; labels must be integers 0..1")


def test_vocab_too_big_for_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    raw = tmp_path / "corpus"
    raw.mkdir()
    (raw / "a.train").write_text("just a few words\n" * 50)
    too_big = "could not train a 16384-piece tokenizer.*smaller --vocab-size"
    with pytest.raises(SystemExit, match=too_big):
        P.prepare(str(raw))


def test_download_offline_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMLM_RAW", str(tmp_path))

    def offline(*a, **k):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    offline_error = r"^error: could not download https://api\.osf\.io/.*by hand"
    with pytest.raises(SystemExit, match=offline_error):
        P.download("babylm_10m")
    with pytest.raises(SystemExit, match="no download known"):
        P.download("my_corpus")


def test_prepared_folder_must_not_be_the_raw_folder(one_file, monkeypatch):
    monkeypatch.setenv("NANOMLM_DATA", str(one_file.parent))  # prep/corpus/ = the raw folder
    with pytest.raises(SystemExit, match="would be the raw folder"):
        P.prepare(str(one_file), vocab_size=800)


def test_breton_corpus_split_is_fixed_and_disjoint(tmp_path):
    import random
    from data import breton
    sents = breton.sentences(shared_data())
    assert all(len(v) > 500 for v in sents.values()), {k: len(v) for k, v in sents.items()}
    flat = [s for v in sents.values() for s in v]
    train, dev = breton.split(flat)
    assert not set(train) & set(dev)
    assert len(train) + len(dev) == len(set(flat)) < len(flat)  # duplicates dropped
    assert 0.08 < len(dev) / (len(train) + len(dev)) < 0.12
    random.Random(0).shuffle(flat)
    assert set(breton.split(flat)[1]) == set(dev)  # the split does not depend on order
    r = run_script("data/breton.py", "--raw", shared_data(), "--out", tmp_path / "br", timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "br" / "breton.dev").read_text(encoding="utf-8").splitlines() == dev


# --- data order ----------------------------------------------------------------------------------

def test_each_epoch_visits_every_segment_once(tmp_path):
    stream = np.arange(5, 5 + 103, dtype=np.uint16)
    stream.tofile(tmp_path / "t.bin")
    seg = P.Segments(tmp_path / "t.bin", 10, seed=3, shuffle=True)
    assert seg.n == 10
    for epoch in range(3):
        batch = seg.batch(epoch * seg.n, seg.n)
        assert (batch[:, 0] == P.CLS).all() and (batch[:, -1] == P.SEP).all()
        body = batch[:, 1:-1].numpy()
        starts = body[:, 0] - 5
        assert (np.diff(body, axis=1) == 1).all()  # each row is one contiguous window of the stream
        assert len(set((starts % 10).tolist())) == 1
        assert sorted(starts // 10) == list(range(10))  # every segment once
    again = P.Segments(tmp_path / "t.bin", 10, seed=3, shuffle=True)
    assert torch.equal(seg.batch(7, 25), again.batch(7, 25))  # a function of (seed, position) alone
    # one gather for the whole batch, across epoch boundaries, equals segment-by-segment reading
    for first, size in ((7, 25), (19, 3), (0, 1)):
        rows = []
        for k in range(first, first + size):
            s = seg.starts(k // seg.n)[k % seg.n]
            rows.append([P.CLS, *stream[s:s + 10].tolist(), P.SEP])
        assert seg.batch(first, size).tolist() == rows


# --- span masking --------------------------------------------------------------------------------

def test_span_masking_statistics():
    V, B, L = 5000, 1024, 128
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (B, L), generator=gen)
    ids[:, 0], ids[:, -1] = P.CLS, P.SEP
    ids[: B // 4, 100:] = P.PAD  # some padding too
    inputs, labels = masking.span_mask(ids, 0.15, V, gen)
    real = ids >= 5
    chosen = labels != -100
    assert not chosen[~real].any()                                  # specials are never chosen
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    assert chosen[real].float().mean().item() == pytest.approx(0.15, abs=0.01)
    masked = (inputs == P.MASK) & chosen
    kept = (inputs == ids) & chosen
    randomised = chosen & ~masked & ~kept
    n = chosen.sum().item()
    assert masked.sum().item() / n == pytest.approx(0.8, abs=0.01)
    assert kept.sum().item() / n == pytest.approx(0.1, abs=0.01)  # (+1/V: a random draw = itself)
    assert randomised.sum().item() / n == pytest.approx(0.1, abs=0.01)
    assert inputs[randomised].min() >= 5                        # random tokens are never specials
    # spans: a chosen token's right neighbour is chosen if it is in the same span (prob 2/3 for
    # geometric lengths of mean 3) or starts a new span that is chosen (1/3 * 0.15); i.i.d.
    # token masking would give 0.15
    both = chosen[:, 1:90] & chosen[:, 2:91]
    rate = both.sum().item() / chosen[:, 1:90].sum().item()
    assert rate == pytest.approx(2 / 3 + 0.15 / 3, abs=0.02)


def test_uniform_masking_by_the_mlsm_rule():
    """Exactly int(0.15 * 40) = 6 tokens per row, never a special one, all [MASK]; every other
    position equally likely (a chi-square test over 2000 rows: 38 cells, 37 degrees of freedom,
    99.9% quantile 69.3)."""
    B, T = 2000, 40
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(len(P.SPECIALS), 300, (B, T), generator=gen)
    ids[:, 0], ids[:, -1] = P.CLS, P.SEP
    inputs, labels = masking.uniform_mask(ids, 0.15, gen)
    chosen = labels != -100
    assert (chosen.sum(1) == 6).all()
    assert not chosen[:, [0, -1]].any()
    assert (inputs[chosen] == P.MASK).all() and torch.equal(inputs[~chosen], ids[~chosen])
    assert torch.equal(labels[chosen], ids[chosen])
    counts = chosen[:, 1:-1].sum(0).double()
    expected = B * 6 / (T - 2)
    assert ((counts - expected) ** 2 / expected).sum().item() < 69.3


def test_span_masking_is_a_function_of_the_generator():
    ids = torch.randint(5, 100, (4, 32))
    a = masking.span_mask(ids, 0.15, 100, torch.Generator().manual_seed(7))
    b = masking.span_mask(ids, 0.15, 100, torch.Generator().manual_seed(7))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("mean_span", [3.0, 1.0])
def test_mask_capacity_bounds_the_chosen_count(mean_span):
    """The chosen count of 4000 batches of 16 x 64 tokens: its standard deviation is at most the
    one mask_capacity's formula gives and close to it (rows cut their last span short, so the
    formula runs 2% high here for spans, exact for single tokens), the bound sits 7 of them
    above the mean (plus 8), and no batch comes near it. With the capacity passed, span_mask
    keeps the first `capacity` chosen tokens in row-major order and nothing else changes."""
    B, T, p = 16, 64, 0.15
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (4000 * B, T), generator=gen)
    ids[:, 0], ids[:, -1] = P.CLS, P.SEP
    _, labels = masking.span_mask(ids, p, 1000, gen, mean_span)
    counts = (labels != -100).view(4000, B * T).sum(1).double()
    cap = masking.mask_capacity(B, T, p, mean_span)
    n = B * (T - 2)
    std = math.sqrt(n * p * (1 - p) * (2 * mean_span - 1))
    assert 0.93 * std <= counts.std().item() <= 1.02 * std
    assert counts.mean().item() == pytest.approx(p * n, rel=0.01)
    assert cap == math.ceil(p * n + 7 * std) + 8 and counts.max() < p * n + 5 * std
    few = 10
    full = masking.span_mask(ids[:B], p, 1000, torch.Generator().manual_seed(1), mean_span)
    cut = masking.span_mask(ids[:B], p, 1000, torch.Generator().manual_seed(1), mean_span, few)
    chosen = (full[1] != -100).flatten()
    keep = chosen & (chosen.cumsum(0) <= few)
    assert chosen.sum() > few and torch.equal((cut[1] != -100).flatten(), keep)
    assert torch.equal(cut[0].flatten()[keep], full[0].flatten()[keep])
    assert torch.equal(cut[0].flatten()[~keep], ids[:B].flatten()[~keep])
    assert masking.mask_capacity(B, T, p) == B * int(p * T)  # uniform: exactly int(p T) per row


@pytest.mark.parametrize("scheme", sorted(masking.MASKINGS))
def test_every_masking_scheme_predicts_within_its_capacity(scheme):
    """make_batch under each --masking, over many batches of two shapes: the predicted tokens
    never outnumber the fixed slot count (mask_capacity of the scheme's mean span), the slots
    hold exactly them in row-major order and then padding, the targets are their tokens, [CLS]
    and [SEP] are never chosen, and the inputs differ from the ids only where a token is
    predicted. Uniform masking: exactly int(p T) per row."""
    args = argparse.Namespace(masking=scheme, mask_p=0.15)
    for B, T in ((8, 32), (4, 128)):
        for seed in range(40):
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(len(P.SPECIALS), 1000, (B, T), generator=gen)
            ids[:, 0], ids[:, -1] = P.CLS, P.SEP
            batch = masking.make_batch(ids, args, 1000, gen)
            predicted = batch["labels"] != -100                            # (B, T)
            n, slots = int(predicted.sum()), batch["slots"]
            cap = masking.mask_capacity(B, T, 0.15, masking.MASKINGS[scheme])
            assert 0 < n <= cap == slots.shape[0]
            assert torch.equal(slots[:n], predicted.flatten().nonzero().squeeze(1))
            assert torch.equal(batch["targets"][:n], ids[predicted])
            assert (batch["targets"][n:] == -100).all()
            assert not predicted[:, 0].any() and not predicted[:, -1].any()
            assert torch.equal(batch["inputs"][~predicted], ids[~predicted])
            if masking.MASKINGS[scheme] is None:
                assert (predicted.sum(1) == int(0.15 * T)).all()


def test_predicted_slots_are_the_boolean_index_then_padding():
    """Hand-made labels: the slots list the predicted positions in row-major order (as
    x[labels != -100] reads them), then positions predicting nothing up to the capacity."""
    labels = torch.full((2, 4), -100)
    labels[0, 2], labels[1, 0], labels[1, 3] = 7, 8, 9
    slots = masking.predicted_slots(labels, 5)
    assert slots[:3].tolist() == [2, 4, 7] and slots.shape == (5,)
    assert labels.flatten()[slots].tolist() == [7, 8, 9, -100, -100]
    x = torch.randn(2, 4, 3)
    assert torch.equal(x.flatten(0, 1)[slots[:3]], x[labels != -100])


def test_vocab_too_small_for_corpus_asks_for_a_larger_one(tmp_path, monkeypatch):
    """Each distinct character is a piece: a corpus of 40 of them and the 5 specials needs 45
    pieces or more (sentencepiece's count); the line says so, and the fix is a larger size. The
    size it names trains."""
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    raw = tmp_path / "corpus"
    raw.mkdir()
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"
    (raw / "a.train").write_text("".join(f"{chars[i:]} {chars[:i]}\n" for i in range(40)) * 20)
    with pytest.raises(SystemExit) as e:
        P.prepare(str(raw), 30)
    need = re.search(r"give --vocab-size (\d+) or more$", str(e.value))
    assert need and str(e.value).startswith("error: --vocab-size 30 is too small"), e.value
    assert int(need[1]) > 40
    P.prepare(str(raw), int(need[1]))
