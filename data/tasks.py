"""Labelled tasks ((Super)GLUE, MSGS jsonl files): evaluate.py fine-tunes on them, meta.py
meta-learns with them. TASKS says how each task's rows become text, how many classes it has and
its metrics; read_task tokenizes a split into padded arrays.
"""
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from data.prepare import CLS, PAD, SEP


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{n} is not valid JSON ({e.msg})") from None
    return rows


def pad(seqs: list[list[int]]) -> np.ndarray:
    """Token-id lists -> (len(seqs), longest) int64, [PAD] after each list's end."""
    out = np.full((len(seqs), max(map(len, seqs))), PAD, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


# task -> (its text(s) from a row, number of classes, metrics; the first one drives early stopping)
TASKS = {
    "cola": (lambda r: (r["sentence"],), 2, ("mcc", "accuracy")),
    "sst2": (lambda r: (r["sentence"],), 2, ("accuracy",)),
    "mrpc": (lambda r: (r["sentence1"], r["sentence2"]), 2, ("f1", "accuracy")),
    "qqp": (lambda r: (r["question1"], r["question2"]), 2, ("f1", "accuracy")),
    "mnli": (lambda r: (r["premise"], r["hypothesis"]), 3, ("accuracy",)),
    "qnli": (lambda r: (r["question"], r["sentence"]), 2, ("accuracy",)),
    "rte": (lambda r: (r["sentence1"], r["sentence2"]), 2, ("accuracy",)),
    "boolq": (lambda r: (r["question"], r["passage"]), 2, ("accuracy",)),
    "multirc": (lambda r: (r["paragraph"], r["question"] + " " + r["answer"]), 2, ("accuracy",)),
    "wsc": (lambda r: (r["text"], f"{r['span2_text']} refers to {r['span1_text']}"), 2,
            ("accuracy",)),
}


MSGS = (lambda r: (r["sentence"],), 2, ("mcc", "accuracy"))  # any other task name: MSGS-style files


class Examples(NamedTuple):
    """A labelled task's examples: token ids [CLS] a [SEP] (b [SEP]), labels (n,), example ids."""
    seqs: list
    labels: np.ndarray
    ids: list

    def take(self, idx) -> "Examples":
        return Examples([self.seqs[i] for i in idx], self.labels[idx], [self.ids[i] for i in idx])


def read_task(data_dir: Path, task: str, split: str, tok, max_len: int) -> Examples:
    """The examples of TASK.SPLIT.jsonl, pairs truncated longest-first to max_len tokens."""
    path = Path(data_dir) / f"{task}.{split}.jsonl"
    if not path.exists():
        have = sorted(p.name for p in Path(data_dir).glob(f"{task}.*.jsonl"))
        tasks = sorted({p.name.split(".")[0] for p in Path(data_dir).glob("*.train.jsonl")})
        only = (f" (there is only {', '.join(have)}; this task cannot be fine-tuned from here)"
                if have else f" (the tasks there: {', '.join(tasks) or 'none'})")
        raise SystemExit(f"error: no {path.name} in {data_dir}{only}")
    render, k, _ = TASKS.get(task, MSGS)
    rows = read_jsonl(path)
    if not rows:
        raise SystemExit(f"error: {path} holds no examples")
    seqs, labels, ids = [], [], []
    for n, r in enumerate(rows, 1):
        try:
            texts = render(r)
        except (KeyError, TypeError) as e:
            raise SystemExit(f"error: {path}:{n} lacks a field this task needs ({e!r})") from None
        label = r.get("label")
        if isinstance(label, bool) or not isinstance(label, int):  # "entailment", 1.0, None
            raise SystemExit(f"error: {path}:{n} has label {label!r}; labels must be integers "
                             f"0..{k - 1}")
        if not 0 <= label < k:
            raise SystemExit(f"error: {path}:{n} has label {label}, outside 0..{k - 1}")
        parts = tok.encode(list(texts))
        while sum(map(len, parts)) > max_len - 1 - len(parts):
            longest = max(parts, key=len)
            longest.pop()
        seqs.append([CLS] + [t for part in parts for t in part + [SEP]])
        labels.append(label)
        ids.append(json.dumps(r.get("idx", n)))
    return Examples(seqs, np.array(labels), ids)
