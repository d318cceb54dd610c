"""Evaluation results on disk, and the metrics they hold: each evaluation writes RUN/eval/NAME.json
next to its checkpoint, with every per-example result (so that the Multi-Bootstrap can resample
examples as well as pretraining seeds); metrics are computed on confusion matrices, vectorised
over leading axes (the bootstrap's replicates).
"""
import gzip
import json
from pathlib import Path

import numpy as np

from machinery.plumbing import atomic_write, one_line_os_errors


def result_path(out, ckpt, name: str) -> Path:
    """Where an evaluation's result goes: `out` if given, else RUN/eval/NAME.json beside ckpt."""
    return Path(out) if out else Path(ckpt).parent / "eval" / f"{name}.json"


def write_result(result: dict, out, ckpt, name: str, indent=None) -> Path:
    path = result_path(out, ckpt, name)
    write_lines(path, [result], indent)
    return path


def write_lines(path: Path, rows: list, indent=None) -> None:
    """Each of `rows` as JSON on a line of its own, written whole or not at all (`atomic_write`)."""
    with one_line_os_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp:
        tmp.write_text("".join(json.dumps(r, indent=indent) + "\n" for r in rows))


def read_partial(path: Path, fingerprint: dict, key: str, value: str) -> dict:
    """{row[key]: row[value]} of the rows an interrupted evaluation appended to `path` after its
    fingerprint line (what its results depend on), if that fingerprint is `fingerprint`; a torn
    last line, cut off mid-write, is dropped. BLiMP's chunks, fine-tuning's seeds."""
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    try:
        if json.loads(lines[0]) != fingerprint:
            print(f"note: {path} was made with other settings or weights; starting over")
            return {}
    except (IndexError, ValueError):
        return {}
    done = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
        except ValueError:
            break
        done[row[key]] = row[value]
    return done


# Result files made before `evaluate.py mlm` scored two maskings hold its one masking, the
# draw it still makes as `uniform`, under other names: study.py's as val_loss and val_acc,
# evaluate.py's own as examples_loss and examples. Read, they take today's names.
OLD_NAMES = {"study-run": {"val_loss": "loss_uniform", "val_acc": "acc_uniform"},
             "mlm": {"examples_loss": "loss_uniform", "examples": "acc_uniform"}}


def read_result(path) -> dict:
    """A result JSON, plain or gzipped (study.py keeps its portable result files as .json.gz),
    its sections under today's names (OLD_NAMES)."""
    path = Path(path)
    try:
        opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
        with opener(path, "rt", encoding="utf-8") as f:
            r = json.load(f)
    except (OSError, EOFError, ValueError) as e:
        raise SystemExit(f"error: {path} is not a readable result file ({e})")
    for old, new in OLD_NAMES.get(r.get("kind") if isinstance(r, dict) else None, {}).items():
        if old in r and new not in r:
            r[new] = r.pop(old)
    return r


def confusion(labels, preds, k: int) -> np.ndarray:
    cells = np.asarray(labels) * k + np.asarray(preds)
    return np.bincount(cells, minlength=k * k).reshape(k, k).astype(float)


def accuracy(cm):
    return np.trace(cm, axis1=-2, axis2=-1) / cm.sum((-2, -1))


def f1(cm):
    """F1 of class 1 (binary tasks: MRPC, QQP); 0 when class 1 is never true nor predicted."""
    tp, fp, fn = cm[..., 1, 1], cm[..., 0, 1], cm[..., 1, 0]
    return np.divide(2 * tp, 2 * tp + fp + fn, out=np.zeros_like(tp), where=(2 * tp + fp + fn) > 0)


def mcc(cm):
    """Matthews correlation, multiclass form (Gorodkin 2004); 0 when a marginal is constant."""
    s = cm.sum((-2, -1))
    c = np.trace(cm, axis1=-2, axis2=-1)
    t, p = cm.sum(-1), cm.sum(-2)  # true and predicted counts per class
    den = np.sqrt((s ** 2 - (p ** 2).sum(-1)) * (s ** 2 - (t ** 2).sum(-1)))
    return np.divide(c * s - (t * p).sum(-1), den, out=np.zeros_like(den), where=den > 0)


METRICS = {"accuracy": accuracy, "f1": f1, "mcc": mcc}
