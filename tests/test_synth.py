"""synth.py: the CoNLL-U reader, the grammar read off dependency trees, the batched sampler and
the relexicalisations, against hand-computed examples and the statistics they promise."""
import json
from collections import Counter

import numpy as np
import pytest

import synth as S
from conftest import TINY, run_script, run_train, shared_data

EDGE = """# sent_id = 1
# text = a made-up line
1-2\tzz\t_\t_\t_\t_\t_\t_\t_\t_
1\tA\ta\tDET\t_\t_\t2\tdet\t_\t_
2\tB\tb\tNOUN\t_\t_\t4\tnsubj:pass\t_\t_
3\tC\tc\tAUX\t_\t_\t4\taux\t_\t_
3.1\tE\te\tVERB\t_\t_\t_\t_\t4:conj\t_
4\tD\td\tVERB\t_\t_\t0\troot\t_\t_
5\tF\tf\tNOUN\t_\t_\t4\tobj\t_\t_

1\tG\tg\tVERB\t_\t_\t0\troot\t_\t_
2\tH\th\tNOUN\t_\t_\t1\tobj\t_\t_"""          # no final newline


def test_conllu_skips_comments_ranges_and_empty_nodes(tmp_path):
    (tmp_path / "a.conllu").write_text(EDGE)
    sents = S.read_conllu(tmp_path / "a.conllu")
    assert [[w["id"] for w in s] for s in sents] == [[1, 2, 3, 4, 5], [1, 2]]
    assert [w["head"] for w in sents[0]] == [2, 4, 4, 0, 4]
    assert sents[0][1]["deprel"] == "nsubj:pass"
    (tmp_path / "bad.conllu").write_text("1\tA\ta\n")
    with pytest.raises(SystemExit, match=r"bad.conllu:1: .* 10 tab-separated columns, this one 3"):
        S.read_conllu(tmp_path / "bad.conllu")


def test_grammar_hand_computed(tmp_path):
    """Sentence 1: root D has dependents nsubj(B) aux(C) obj(F) -> root: nsubj aux * obj; B has
    det(A) -> nsubj: det *. Sentence 2: root: * obj. With n_rels=4 (root and obj twice each,
    then the first two of the ties det/nsubj/aux by order of appearance), aux becomes `other`."""
    (tmp_path / "a.conllu").write_text(EDGE)
    g = S.grammar(S.read_conllu(tmp_path / "a.conllu"), n_rels=4)
    assert g["symbols"] == ["root", "obj", "det", "nsubj", "other"]
    assert g["rules"]["root"] == {("nsubj", "other", "*", "obj"): 0.5, ("*", "obj"): 0.5}
    assert g["rules"]["nsubj"] == {("det", "*"): 1.0}   # nsubj:pass counted as nsubj
    assert g["rules"]["obj"] == {("*",): 1.0} and g["rules"]["other"] == {("*",): 1.0}
    assert g["lemmas"]["obj"] == 2 and g["lengths"] == [5, 2]


def test_grammar_dropping_rare_relations_hand_computed(tmp_path):
    """With n_rels=3 (root, obj, det) and rare="drop", sentence 1 loses nsubj(B) with its
    det(A) and aux(C): root D keeps only obj F; sentence 2 is whole."""
    (tmp_path / "a.conllu").write_text(EDGE)
    g = S.grammar(S.read_conllu(tmp_path / "a.conllu"), n_rels=3, rare="drop")
    assert g["symbols"] == ["root", "obj", "det"]
    assert g["rules"] == {"root": {("*", "obj"): 1.0}, "obj": {("*",): 1.0}}
    assert g["lengths"] == [2, 2] and g["lemmas"] == {"root": 2, "obj": 2}


def test_dropping_rare_relations_shortens_the_sentences(treebank, french):
    """The blog's 1M sentences are about 15M tokens; ours with `other` 21.6 words a sentence.
    Dropping the rare relations' subtrees brings the trees, and what is sampled, closer."""
    other, drop = french, S.grammar(treebank, rare="drop")
    assert np.mean(drop["lengths"]) < np.mean(other["lengths"]) - 2
    sampled = {}
    for name, g in (("other", other), ("drop", drop)):
        _, sids = S.Sampler(g).sample(20000, 0)
        sampled[name] = np.bincount(sids).mean()
    assert sampled["drop"] < sampled["other"] - 2


@pytest.fixture(scope="module")
def treebank():
    return [s for f in S.treebank_files(shared_data() / "ud") for s in S.read_conllu(f)]


@pytest.fixture(scope="module")
def french(treebank):
    return S.grammar(treebank, n_rels=20)


def test_real_grammar_is_a_distribution_per_nonterminal(french):
    assert len(french["symbols"]) == 21 and french["symbols"][-1] == "other"
    for lhs, rules in french["rules"].items():
        assert sum(rules.values()) == pytest.approx(1.0, abs=1e-12), lhs
        assert all(rhs.count("*") == 1 for rhs in rules)


def test_sampler_draws_rules_with_their_probabilities(french):
    """With the depth capped at 1, a sentence is the root's rule with every dependent written as
    its own word: the frequency of each right-hand side must match its probability."""
    sampler = S.Sampler(french, max_depth=1, max_len=1000)
    rels, sids = sampler.sample(20000, seed=0)
    sym = french["symbols"]
    root = sym.index("root")
    bounds = np.r_[0, np.cumsum(np.bincount(sids))]
    seen = Counter(tuple("*" if r == root else sym[r] for r in rels[a:b])
                   for a, b in zip(bounds[:-1], bounds[1:]))
    for rhs, p in sorted(french["rules"]["root"].items(), key=lambda x: -x[1])[:5]:
        four_se = 4 * (p * (1 - p) / 20000) ** 0.5
        assert seen[rhs] / 20000 == pytest.approx(p, abs=four_se + 1e-3), rhs


def test_sampler_is_reproducible_and_respects_its_caps(french):
    a = S.Sampler(french, max_depth=30, max_len=40).sample(3000, seed=1)
    b = S.Sampler(french, max_depth=30, max_len=40).sample(3000, seed=1)
    c = S.Sampler(french, max_depth=30, max_len=40).sample(3000, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and not np.array_equal(a[0], c[0])
    lengths = np.bincount(a[1])
    assert len(lengths) == 3000 and lengths.min() >= 1 and lengths.max() <= 40
    assert (a[0] >= 0).all() and (a[0] < len(french["symbols"])).all()   # only words are left


def test_uncapped_mean_length_matches_the_treebank(french):
    """A PCFG estimated by maximum likelihood from trees generates yields whose expected length is
    the trees' mean length (Chi & Geman 1998: such a PCFG is also consistent)."""
    _, sids = S.Sampler(french, max_depth=200, max_len=10**6).sample(20000, seed=0)
    assert np.bincount(sids).mean() == pytest.approx(np.mean(french["lengths"]), rel=0.05)


def test_relexicalisation_statistics(french):
    rels, sids = S.Sampler(french).sample(20000, seed=0)
    sizes = S.token_sets(french, 5000)
    assert sizes.sum() == 5000 and sizes.min() >= 1
    lemmas = np.array([french["lemmas"][s] for s in french["symbols"]], float)
    big = sizes >= 100
    np.testing.assert_allclose(sizes[big] / sizes.sum(), lemmas[big] / lemmas.sum(), rtol=0.05)
    zipf = S.relex_zipf(rels, sizes, np.random.default_rng(0))
    loglin = S.relex_loglinear(rels, sids, sizes, np.random.default_rng(0))
    start = np.r_[0, np.cumsum(sizes)]
    for tokens in (zipf, loglin):      # every word stays in its relation's set
        assert ((tokens >= start[rels]) & (tokens < start[rels + 1])).all()
    for r in np.nonzero(sizes >= 200)[0]:
        slope = S.rank_slope(zipf[rels == r], top=30)
        assert slope == pytest.approx(-1.0, abs=0.1), french["symbols"][r]
    assert abs(S.same_sentence_pmi(zipf, rels, sids)) < 0.02
    assert S.same_sentence_pmi(loglin, rels, sids) > 0.3


def test_cli_writes_a_corpus_folder_that_trains_word_by_word(tmp_path, monkeypatch):
    out = tmp_path / "synth"
    r = run_script("synth.py", "--ud", shared_data() / "ud", "--sentences", "2000", "--out", out,
                   timeout=300)
    assert r.returncode == 0, r.stderr
    train = (out / "synth.train").read_text().splitlines()
    dev = (out / "synth.dev").read_text().splitlines()
    assert len(train) == 1900 and len(dev) == 100
    assert all(w.startswith("w") and w[1:].isdigit() for line in dev for w in line.split())
    assert "sentences/s" in r.stdout
    assert (out / "stats.json").exists() and (out / "grammar.json").exists()
    # data/prepare.py reads it with one token per made-up word; train.py trains on it
    from data.prepare import prepare
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prepared"))
    folder = prepare(str(out), quiet=True)
    meta = json.loads((folder / "meta.json").read_text())
    words = [w for line in train for w in line.split()]
    # one token per word, and [SEP] (id 3) after every sentence: boundaries kept when packed
    assert meta["vocab_size"] == len(set(words)) + 5
    assert meta["train_tokens"] == len(words) + len(train)
    stream = np.fromfile(folder / "train.bin", np.uint16)
    ends = np.cumsum([len(line.split()) + 1 for line in train]) - 1
    assert (stream[ends] == 3).all() and (stream == 3).sum() == len(train)
    r = run_train("--data", out, "--out-dir", tmp_path / "run", "--max-steps", 2, *TINY)
    assert r.returncode == 0, r.stderr


def test_an_unwritable_out_is_one_line_before_the_sampling(tmp_path, capsys):
    """Issue 83: --out under a file (no folder can be made there) stops in one line, before
    the treebanks are read (--ud points nowhere: reading it would fail otherwise)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        S.main(["--sentences", "10", "--ud", str(tmp_path / "nowhere"),
                "--out", str(tmp_path / "file" / "x")])
    line = str(stopped.value)
    assert line == f"error: cannot write {tmp_path / 'file' / 'x'}: Not a directory", line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_loglinear_draws_words_by_the_papers_scale():
    """One sentence of 20,000 words of one relation: their frequencies are softmax(v_t . v_w)
    with v_w and v_t both ~ N(0, I_10) (Ri & Tsuruoka 2022, sec. 3.1), redrawn here from the
    same seed in the same order (the word vectors, then the chunk's topics)."""
    V, n = 50, 20000
    tokens = S.relex_loglinear(np.zeros(n, np.int64), np.zeros(n, np.int64), np.array([V]),
                               np.random.default_rng(0))
    rng = np.random.default_rng(0)
    vec = rng.standard_normal((V, 10))
    topic = rng.standard_normal(10)
    p = np.exp(vec @ topic - (vec @ topic).max())
    p /= p.sum()
    freq = np.bincount(tokens, minlength=V) / n
    assert 0.5 * np.abs(freq - p).sum() < 0.02  # total variation: sampling noise only
    assert p.max() > 0.2  # a topic favours a few words (under the old 1/sqrt(10) scale: < 0.1)
