"""Assemble the Breton corpus of the transfer study (synth.py) from the shared Breton sources:

    python data/breton.py --out data/raw/breton     # then: train.py --data data/raw/breton ...

Sources, under $NANOMLM_RAW (see ../shared/data/SOURCES.md): the Common Voice prompt sentences
(breton/common_voice_sentences_br.txt), the Breton side of the Arbres parallel sentences
(breton/arbres-kenstur_br-fr.jsonl), the Apertium texts (the `# text = ` lines of
breton/apertium-bre_texts/*.vislcg.txt, and oab.txt) and the sentences of UD Breton-KEB
(ud/UD_Breton-KEB/*.conllu, `# text = ` lines). Sentences are stripped and de-duplicated (the
Apertium texts and KEB share about 770). Validation is a fixed tenth, chosen by a hash of the
sentence itself, so it does not depend on the order or on which sources are present.
"""
import argparse
import json
import sys
import zlib
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as `python data/breton.py`: the package is data/
from data.prepare import raw_root  # noqa: E402
from machinery.plumbing import Parser  # noqa: E402


def text_lines(path: Path, prefix: str = "# text = "):
    with open(path, encoding="utf-8") as f:
        return [line[len(prefix):].strip() for line in f if line.startswith(prefix)]


def sentences(root: Path) -> dict[str, list[str]]:
    """{source: sentences} from the shared data folder `root`."""
    br, ud = root / "breton", root / "ud" / "UD_Breton-KEB"
    if not br.is_dir():
        raise SystemExit(f"error: no Breton data at {br}; set NANOMLM_RAW to the folder that "
                         f"holds breton/ and ud/")
    lines = lambda path: [l.strip() for l in path.read_text(encoding="utf-8").splitlines()]
    apertium = br / "apertium-bre_texts"
    with open(br / "arbres-kenstur_br-fr.jsonl", encoding="utf-8") as f:
        arbres = [json.loads(l)["translation"]["br"].strip() for l in f if l.strip()]
    out = {"common_voice": lines(br / "common_voice_sentences_br.txt"),
           "arbres": arbres,
           "apertium": [s for f in sorted(apertium.glob("*.vislcg.txt")) for s in text_lines(f)]
                       + lines(apertium / "oab.txt"),
           "ud_keb": [s for f in sorted(ud.glob("*.conllu")) for s in text_lines(f)]}
    return {k: [s for s in v if s] for k, v in out.items()}


def split(sents: list[str], dev_share: int = 10) -> tuple[list[str], list[str]]:
    """De-duplicated (first occurrence kept), then (train, dev) with dev = crc32(sentence) % 10
    == 0."""
    in_dev = {s: zlib.crc32(s.encode()) % dev_share == 0 for s in sents}  # keys: first-seen order
    return [s for s, d in in_dev.items() if not d], [s for s, d in in_dev.items() if d]


def main(argv=None):
    ap = Parser(description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", default=str(raw_root()),
                    help="shared data folder (default $NANOMLM_RAW, else data/raw)")
    ap.add_argument("--out", default=str(HERE / "raw" / "breton"),
                    help="corpus folder to write (default data/raw/breton)")
    args = ap.parse_args(argv)
    by_source = sentences(Path(args.raw))
    train, dev = split([s for v in by_source.values() for s in v])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "breton.train").write_text("".join(s + "\n" for s in train), encoding="utf-8")
    (out / "breton.dev").write_text("".join(s + "\n" for s in dev), encoding="utf-8")
    words = lambda ss: sum(len(s.split()) for s in ss)
    print(" | ".join(f"{k} {len(v)}" for k, v in by_source.items()) +
          f" -> {len(train) + len(dev)} distinct sentences: train {len(train)} "
          f"({words(train)} words), dev {len(dev)} ({words(dev)} words) in {out}")


if __name__ == "__main__":
    main()
