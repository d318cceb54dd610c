"""Raw text -> sentencepiece tokenizer + flat uint16 token streams, ready for train.py.

    python data/prepare.py babylm_10m                    # what train.py does on first use
    python data/prepare.py path/to/text_folder --vocab-size 8000
    python data/prepare.py babylm_10m --download         # fetch the official corpus (needs network)

Where things live
    raw      $NANOMLM_RAW/NAME/   (default data/raw/NAME/), or any folder given as a path
    prepared $NANOMLM_DATA/NAME-KEY/ (default data/prepared/NAME-KEY/): train.bin val.bin
             tokenizer.model meta.json

Raw layout: the BabyLM one, a folder of `*.train` and `*.dev` text files, plain or `.gz`. A folder
without `*.train` files is read whole (every text file in it), and when there are no `*.dev` files
every 20th line of the training text is held out for validation instead.

The tokenizer is a sentencepiece unigram model trained on the training split only (the BabyLM rule),
with byte fallback (no [UNK] in practice) and fixed special ids [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3
[MASK]=4. Lines are tokenized independently and concatenated into one stream per split; Segments
reads that stream back as `seq_len - 2` token segments wrapped in [CLS] ... [SEP].

A raw folder with a `tokenizer.json` saying {"model_type": "word"} (synth.py writes one) gets a
word-level vocabulary instead: every distinct training word is one token, --vocab-size is not
used, and a word never seen in training reads as [UNK]. With "separate_sentences": true as well,
every line is followed by [SEP] in the stream.

A prepared folder is named by what it is made of: NAME-KEY, KEY a hash of the raw files (name, size,
sha256) and the tokenizer settings. Changed raw files or settings make a new folder beside the old
(delete those you no longer need); a folder is built under a temporary name and renamed when
complete, so an interrupted or failed preparation leaves nothing behind.
"""
import argparse
import functools
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python data/prepare.py`
from machinery.plumbing import Parser, bar, heartbeat  # noqa: E402


HERE = Path(__file__).resolve().parent
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(len(SPECIALS))
VOCAB_SIZE = 16384  # sentencepiece pieces, unless a script's --vocab-size says otherwise
VERSION = 1  # bump when the prepared format changes, so old folders count as stale

# The official BabyLM corpora live in the OSF project below, folder text_data/:
# train_10M.zip (strict-small), train_100M.zip (strict) and dev.zip (validation for both).
OSF_PROJECT = "https://osf.io/ad7qg/"
OSF_API = "https://api.osf.io/v2/nodes/ad7qg/files/osfstorage/"
KNOWN = {"babylm_10m": "train_10M.zip", "babylm_100m": "train_100M.zip"}


# ---------------------------------------------------------------------------------------------
# Locating and reading raw text

def raw_root() -> Path:
    return Path(os.environ.get("NANOMLM_RAW", HERE / "raw"))


def prepared_root() -> Path:
    """Where prepared corpora live (NAME-KEY/ folders): $NANOMLM_DATA, else data/prepared/."""
    return Path(os.environ.get("NANOMLM_DATA", HERE / "prepared"))


def resolve(data: str) -> tuple[Path, Path]:
    """--data NAME or PATH -> (raw folder, prepared_root()/NAME); neither needs to exist."""
    path = Path(data).expanduser()
    if path.is_dir() or os.sep in data:  # an explicit folder of text files
        return path.resolve(), prepared_root() / path.resolve().name
    return raw_root() / data, prepared_root() / data


def where_to_get(name: str, raw: Path) -> str:
    if name in KNOWN:
        return (f"Get the official BabyLM corpus from {OSF_PROJECT} (folder text_data/: "
                f"{KNOWN[name]} and dev.zip) and unpack its *.train and *.dev files into {raw}, "
                f"or run `python data/prepare.py {name} --download`, or point NANOMLM_RAW at "
                f"the folder that holds {name}/.")
    return "Pass --data PATH to a folder of text files, or set NANOMLM_RAW."


def find_files(raw: Path) -> tuple[list[Path], list[Path]]:
    """(train files, dev files) of a raw folder, sorted by name so the stream order is fixed."""
    files = sorted(p for p in raw.iterdir() if p.is_file() and not p.name.startswith("."))
    stem = lambda p: p.name[:-3] if p.name.endswith(".gz") else p.name
    train = [p for p in files if stem(p).endswith(".train")]
    dev = [p for p in files if stem(p).endswith(".dev")]
    if not train:  # not the BabyLM layout: every file is training text
        train = [p for p in files if not stem(p).endswith((".dev", ".test", ".json", ".md"))]
    return train, dev


def text_bytes(data: str) -> int:
    """The size in bytes of --data's raw training text, without reading it (a gzip file's
    trailer holds its size, mod 2^32); 0 where there is no such folder yet."""
    raw, _ = resolve(data)
    total = 0
    for path in find_files(raw)[0] if raw.is_dir() else []:
        with open(path, "rb") as f:
            if f.read(2) == b"\x1f\x8b":
                f.seek(-4, os.SEEK_END)
                total += int.from_bytes(f.read(4), "little")
            else:
                total += path.stat().st_size
    return total


def read_lines(path: Path) -> list[str]:
    """Non-empty lines, stripped. gzip is detected by the file's magic bytes, not its name."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8")) as f:
            return [s for s in (line.strip() for line in f) if s]
    except (UnicodeDecodeError, OSError, EOFError) as e:
        raise SystemExit(f"error: cannot read {path} as UTF-8 text{' (gzip)' if gz else ''}: {e}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Tokenizer and token streams

def train_tokenizer(lines: list[str], vocab_size: int, word_level: bool = False) -> bytes:
    """Sentencepiece unigram model (serialized) trained on `lines`; word_level: one piece per
    distinct word (sentencepiece's "word" model keeping every word)."""
    raised = []  # what was raised while the trainer read (a signal's exit, Ctrl-C)

    def pieces():  # the trainer skips sentences over 4192 bytes; BabyLM pieces can be 500 words
        try:
            for line in lines:
                words = line.split()
                for i in range(0, len(words), 100):
                    yield " ".join(words[i:i + 100])
        except (Exception, KeyboardInterrupt, SystemExit) as e:  # (not the trainer's close)
            raised.append(e)  # the trainer would pass it on as one of its RuntimeErrors
            raise
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=pieces(), model_writer=model, num_threads=os.cpu_count(),
            minloglevel=2, **tokenizer_settings(vocab_size, word_level))
    except RuntimeError as e:  # e.g. "Vocabulary size is too high" on a tiny corpus
        if raised:
            raise raised[0] from None
        said = str(e).strip().splitlines()[-1]
        # "Vocabulary size is smaller than required_chars. 300 vs 336.": every character of the
        # corpus is a piece, so the fix is a larger vocabulary; "too high": a smaller one
        if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", said):
            raise SystemExit(f"error: --vocab-size {vocab_size} is too small for this corpus: "
                             f"its characters and the special tokens need {m[1]} pieces; give "
                             f"--vocab-size {m[1]} or more") from None
        raise SystemExit(f"error: sentencepiece could not train a {vocab_size}-piece tokenizer "
                         f"on this corpus ({said}); try a smaller --vocab-size") from None
    return model.getvalue()


def tokenizer_settings(vocab_size: int, word_level: bool = False) -> dict:
    """Sentencepiece trainer settings; word_level: vocab_size counts the words, specials apart."""
    specials = dict(pad_id=PAD, unk_id=UNK, bos_id=CLS, eos_id=SEP, pad_piece="[PAD]",
                    unk_piece="[UNK]", bos_piece="[CLS]", eos_piece="[SEP]",
                    control_symbols=["[MASK]"])  # control: never produced from text, even "[MASK]"
    if word_level:  # every distinct word, whole: no byte fallback, no digit splitting
        return dict(vocab_size=vocab_size + len(SPECIALS), model_type="word", use_all_vocab=True,
                    byte_fallback=False, split_digits=False, character_coverage=1.0,
                    input_sentence_size=0, **specials)
    return dict(vocab_size=vocab_size, model_type="unigram", byte_fallback=True, split_digits=True,
                character_coverage=0.9995, input_sentence_size=2_000_000,
                shuffle_input_sentence=True, seed_sentencepiece_size=1_000_000, **specials)


def word_level(raw: Path) -> dict | None:
    """The raw folder's tokenizer.json, a word-level vocabulary's request ({"model_type":
    "word"}, optionally "separate_sentences": [SEP] after each line, synth.py's); or None."""
    f = raw / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        spec = json.loads(f.read_text())
    except json.JSONDecodeError:
        spec = None
    if (not isinstance(spec, dict) or spec.get("model_type") != "word"
            or not set(spec) <= {"model_type", "separate_sentences"}
            or not isinstance(spec.get("separate_sentences", False), bool)):
        raise SystemExit(f'error: {f} must be {{"model_type": "word"}}, with optionally '
                         f'"separate_sentences": true or false (the only settings it takes)')
    return spec


def encode(sp: spm.SentencePieceProcessor, lines: list[str], desc: str,
           sep: bool = False) -> np.ndarray:
    """Tokenize lines on all cores (sentencepiece's own threads) into one flat uint16 stream."""
    out, chunk = [], 1024
    with bar(total=len(lines), desc=desc, unit=" lines", disable=None) as progress:
        for i in range(0, len(lines), chunk):
            ids = sp.encode(lines[i:i + chunk], num_threads=os.cpu_count())
            out += [np.asarray(x + [SEP] * sep, dtype=np.uint16) for x in ids]
            progress.update(len(ids))
    return np.concatenate(out) if out else np.zeros(0, np.uint16)


def encode_masked(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """A sentence with [MASK] in it -> [CLS] ids [SEP], each [MASK] the MASK id, the text
    between them tokenized as running text: after a [MASK] with no space, no word starts, so
    sentencepiece's word-start "▁" is dropped there (alone, or from the first piece when the
    vocabulary has it without)."""
    ids = [CLS]
    for i, chunk in enumerate(text.split("[MASK]")):
        part = sp.encode(chunk.strip()) if chunk.strip() else []
        first = sp.id_to_piece(part[0]) if part else ""
        if i and not chunk[:1].isspace() and first.startswith("\u2581"):
            if first == "\u2581":
                part = part[1:]
            elif sp.piece_to_id(first[1:]) != sp.unk_id():
                part[0] = sp.piece_to_id(first[1:])
        ids += [MASK] * bool(i) + part
    return ids + [SEP]


def load_tokenizer(folder: Path) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


def load_meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def check_tokenizer(folder: Path, tokenizer: bytes, ckpt) -> None:
    """Refuse, in one line, a prepared corpus whose tokenizer is not the one the checkpoint `ckpt`
    was trained with (`tokenizer`: its serialized sentencepiece model): its ids would mean other
    pieces to the model."""
    if (folder / "tokenizer.model").read_bytes() != tokenizer:
        raise SystemExit(f"error: {ckpt} was trained with another tokenizer than {folder}'s; "
                         f"pass the --data it was trained on")


# ---------------------------------------------------------------------------------------------
# The one entry point the scripts use

def prepared_copies(out: Path) -> list[Path]:
    """The prepared folders out-KEY of the corpus named out.name."""
    found = [p for p in out.parent.glob(out.name + "-*") if (p / "meta.json").is_file()]
    return sorted(p for p in found if load_meta(p).get("name") == out.name)


def located(data: str, vocab_size: int = VOCAB_SIZE, force: bool = False,
            say=lambda *a: None) -> Path | None:
    """A prepared folder of `data` to use as is, None when its raw text is there; else one line."""
    if (Path(data) / "meta.json").is_file() and (Path(data) / "train.bin").is_file():
        return Path(data)  # already a prepared folder: use it as it is
    raw, base = resolve(data)
    if not raw.is_dir() and (base / "meta.json").is_file() and not force:
        return base  # a prepared folder named in full (or by its name before keys)
    if not raw.is_dir():  # prepared elsewhere, raw text not copied: the one prepared copy
        copies = [p for p in prepared_copies(base)
                  if (made := load_meta(p)["tokenizer"]) == tokenizer_settings(vocab_size)
                  or made.get("model_type") == "word"]
        if len(copies) == 1 and not force:
            say(f"data: raw corpus not found at {raw}; using the prepared {copies[0]} as it is")
            return copies[0]
        if len(copies) > 1:
            raise SystemExit(f"error: no corpus folder at {raw}, and {len(copies)} prepared "
                             f"copies of {base.name} ({', '.join(p.name for p in copies)}); "
                             f"pass --data with the path of the one to use")
        env = os.environ.get("NANOMLM_RAW")
        looked = f" (NANOMLM_RAW={env})" if env is not None else ""
        raise SystemExit(f"error: no corpus folder at {raw}{looked}. {where_to_get(raw.name, raw)}")
    return None


def prepare(data: str, vocab_size: int = VOCAB_SIZE, force: bool = False,
            quiet: bool = False) -> Path:
    """The prepared folder NAME-KEY of `data`, made if need be; KEY hashes the raw files and the
    tokenizer settings, so a folder is never shared, nor changed once made."""
    say = (lambda *a: None) if quiet else functools.partial(print, flush=True)
    found = located(data, vocab_size, force, say)
    if found is not None:
        return found
    raw, base = resolve(data)
    train_files, dev_files = find_files(raw)
    if not train_files:
        advice = (where_to_get(raw.name, raw) if raw.name in KNOWN
                  else "Put text files in it, or pass --data another folder.")
        raise SystemExit(f"error: {raw} holds no text files (expected *.train and *.dev, "
                         f"plain or .gz). {advice}")
    sources = [{"split": split, "file": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)}
               for split, files in (("train", train_files), ("dev", dev_files)) for p in files]
    settings = word_level(raw) or tokenizer_settings(vocab_size)
    made_of = json.dumps([VERSION, sources, settings], sort_keys=True).encode()
    out = base.with_name(f"{base.name}-{hashlib.sha256(made_of).hexdigest()[:10]}")
    if force or not (out / "meta.json").exists():
        make(raw, out, base.name, train_files, dev_files, sources, settings, vocab_size, force,
             say)
    return out


def make(raw, out, name, train_files, dev_files, sources, settings, vocab_size, force, say):
    """Build the prepared folder `out` (build) under a temporary name, then rename it: a kill
    leaves no half-made folder under the real name, and the temporary folders of preparations
    that were killed are removed. With `force`, it replaces the one there."""
    if out.with_name(name).resolve() == raw.resolve():
        raise SystemExit(f"error: the prepared folder would be the raw folder {raw} itself; "
                         f"point NANOMLM_DATA somewhere else")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    for old in out.parent.glob(f".{out.name}.*.tmp"):  # left by a preparation that was killed
        pid = old.name.split(".")[-2]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    say(f"data: preparing {raw} -> {out}")
    try:
        build(raw, tmp, name, train_files, dev_files, sources, settings, vocab_size, say)
        if force:
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process made it meanwhile: the same content, keep theirs
            if not (out / "meta.json").exists():
                raise
    except OSError as e:
        raise SystemExit(f"error: cannot write the prepared data at {out}: {e.strerror or e}; "
                         f"nothing of it was kept") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def alive(pid: int) -> bool:
    """Is process `pid` running (on this machine)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def build(raw, out, name, train_files, dev_files, sources, settings, vocab_size, say) -> None:
    """Read, tokenize and write one prepared folder (prepare's work once it knows what to do)."""
    t0, words = time.time(), settings.get("model_type") == "word"
    sep = settings.get("separate_sentences", False)
    train_lines = [line for p in train_files for line in read_lines(p)]
    if dev_files:
        val_lines = [line for p in dev_files for line in read_lines(p)]
        val_from = "*.dev files"
    else:  # hold out every 20th line, deterministically
        val_lines = train_lines[19::20]
        train_lines = [s for i, s in enumerate(train_lines) if i % 20 != 19]
        val_from = "every 20th line of the training files"
    if not train_lines or not val_lines:
        split = "training" if not train_lines else "validation"
        raise SystemExit(f"error: {raw} has no text in its {split} files (only empty lines); "
                         f"nothing to train on")

    out.mkdir(parents=True)
    t1 = time.time()
    if words:
        vocab_size = len({w for line in train_lines for w in line.split()})
        say(f"data: a word-level vocabulary of the {vocab_size:,} distinct training words")
    else:
        say(f"data: training a {vocab_size}-piece unigram tokenizer on {len(train_lines):,} lines")
    with heartbeat("data: training the tokenizer"):
        model = train_tokenizer(train_lines, vocab_size, words)
    (out / "tokenizer.model").write_bytes(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    t2 = time.time()
    train = encode(sp, train_lines, "tokenize train", sep)
    val = encode(sp, val_lines, "tokenize val", sep)
    t3 = time.time()
    train.tofile(out / "train.bin")
    val.tofile(out / "val.bin")

    p = np.bincount(train, minlength=sp.get_piece_size()) / max(len(train), 1)
    meta = {
        "version": VERSION, "name": name, "raw": str(raw), "vocab_size": sp.get_piece_size(),
        "specials": {s: i for i, s in enumerate(SPECIALS)},
        "train_tokens": int(len(train)), "val_tokens": int(len(val)),
        "train_words": sum(len(s.split()) for s in train_lines),
        "val_words": sum(len(s.split()) for s in val_lines),
        "train_lines": len(train_lines), "val_lines": len(val_lines), "val_from": val_from,
        # entropy (nats) of the training tokens' unigram distribution: the loss of a model that
        # ignores context; a masked LM that learns anything must go well below it
        "unigram_entropy": float(-(p[p > 0] * np.log(p[p > 0])).sum()),
        "sources": sources, "tokenizer": settings,
        "seconds": {"read": round(t1 - t0, 1), "tokenizer": round(t2 - t1, 1),
                    "tokenize": round(t3 - t2, 1)},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    say(f"data: {meta['train_words']:,} train words -> {len(train):,} tokens, {len(val):,} val "
        f"tokens, unigram entropy {meta['unigram_entropy']:.3f} nats ({time.time() - t0:.0f}s: "
        f"tokenizer {t2 - t1:.0f}s, tokenize {t3 - t2:.1f}s)")


# ---------------------------------------------------------------------------------------------
# The token stream, read back as segments wrapped in [CLS] ... [SEP]

class Segments:
    """Segments of `length` tokens of a uint16 stream (np.memmap: nothing is read until used).

    Position k of the endless sequence of training segments is segment perm_e[k mod n] of epoch
    e = k // n, where each epoch draws its own permutation and shifts all segment boundaries by a
    random offset (so the same windows do not recur epoch after epoch). Validation uses neither.
    """

    def __init__(self, path, length, seed, shuffle):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self.n = (len(self.tokens) - 1) // length if shuffle else len(self.tokens) // length
        if self.n < 1:
            raise SystemExit(f"error: {path} holds {len(self.tokens)} tokens, fewer than one "
                             f"segment of {length} (--seq-len minus 2); use a bigger corpus or "
                             f"a shorter --seq-len")
        self._epoch = None
        self.on_device = None  # the stream as a device tensor, after .to(cuda)

    def starts(self, epoch):
        if not self.shuffle:
            return np.arange(self.n) * self.length
        if self._epoch != epoch:  # one permutation per epoch, drawn once
            rng = np.random.default_rng([self.seed, epoch])
            shift = rng.integers(len(self.tokens) - self.n * self.length + 1)
            self._starts, self._epoch = shift + rng.permutation(self.n) * self.length, epoch
        return self._starts

    def count_words(self, tokenizer: bytes) -> "Segments":
        """BabyLM's words (each where its first, '▁' piece is); word_cum (n_tokens + 1,)."""
        sp = spm.SentencePieceProcessor(model_proto=tokenizer)
        starts = np.array([sp.id_to_piece(i).startswith("▁") for i in range(len(sp))])
        self.word_cum = np.concatenate([[0], np.cumsum(starts[self.tokens], dtype=np.int64)])
        return self

    def words_read(self, k: int) -> np.ndarray:
        """(k,) int64: the words of training positions 0 .. k-1 (by step s's end a run, resumed
        or not, on any process, has read words_read(s * global batch).sum())."""
        parts = []
        for e in range(-(-k // self.n)):  # each epoch's segments, in its order
            s = self.starts(e)[:min(self.n, k - e * self.n)]
            parts.append(self.word_cum[s + self.length] - self.word_cum[s])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def to(self, device):
        """The stream on a GPU (20 MB for 10M words): only a batch's offsets cross the bus."""
        if device.type == "cuda":
            self.on_device = torch.from_numpy(self.tokens.astype(np.int32)).to(device)
        return self

    def batch(self, first, size) -> torch.Tensor:
        """(size, length + 2) long: segments first .. first+size-1, each as [CLS] tokens [SEP],
        gathered in one indexing operation (on the device after .to(cuda), else from the memmap)."""
        k = np.arange(first, first + size)
        starts = np.empty(size, dtype=np.int64)
        for e in np.unique(k // self.n):                      # a batch spans at most two epochs
            at = k // self.n == e
            starts[at] = self.starts(int(e))[k[at] % self.n]
        if self.on_device is not None:
            device = self.on_device.device
            # from page-locked memory, without waiting: a pageable copy stalls the host until
            # the GPU has caught up, every step
            starts = torch.from_numpy(starts).pin_memory().to(device, non_blocking=True)
            idx = starts[:, None] + torch.arange(self.length, device=device)
            body = self.on_device[idx].long()
        else:
            idx = starts[:, None] + np.arange(self.length)
            body = torch.from_numpy(self.tokens[idx].astype(np.int64))
        ends = lambda v: torch.full((size, 1), v, dtype=torch.long, device=body.device)
        return torch.cat([ends(CLS), body, ends(SEP)], 1)


# ---------------------------------------------------------------------------------------------
# Download of the official corpus (needs network; everything else works without it)

def download(name: str) -> Path:
    """Fetch train_*.zip and dev.zip from OSF and unpack their *.train/*.dev files into the raw
    folder."""
    if name not in KNOWN:
        raise SystemExit(f"error: no download known for {name!r} (known: {', '.join(KNOWN)})")
    raw = raw_root() / name

    def get(url: str) -> bytes:
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                return r.read()
        except OSError as e:  # URLError, timeouts and refused connections are all OSErrors
            raise SystemExit(f"error: could not download {url} ({e}). Without network, fetch "
                             f"{OSF_PROJECT} (text_data/{KNOWN[name]} and dev.zip) by hand and "
                             f"unpack the *.train and *.dev files into {raw}") from None

    def listing(url: str) -> dict:  # OSF API v2: {name: entry} of one folder
        return {e["attributes"]["name"]: e for e in json.loads(get(url))["data"]}

    folder = listing(OSF_API)["text_data"]["relationships"]["files"]["links"]["related"]["href"]
    files = listing(folder)
    raw.mkdir(parents=True, exist_ok=True)
    for zname, ext in ((KNOWN[name], ".train"), ("dev.zip", ".dev")):
        print(f"downloading {zname} ...")
        with zipfile.ZipFile(io.BytesIO(get(files[zname]["links"]["download"]))) as z:
            for member in z.namelist():
                if member.endswith(ext):
                    (raw / Path(member).name).write_bytes(z.read(member))
    return raw


if __name__ == "__main__":
    ap = Parser(description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="corpus name under $NANOMLM_RAW (babylm_10m, babylm_100m, ...) "
                    "or a folder path")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                    help=f"sentencepiece vocabulary size (default {VOCAB_SIZE})")
    ap.add_argument("--force", action="store_true",
                    help="rebuild even if the prepared folder is fresh")
    ap.add_argument("--download", action="store_true",
                    help="download the official BabyLM corpus first")
    args = ap.parse_args()
    if args.download:
        download(args.data)
    print(prepare(args.data, args.vocab_size, force=args.force))
