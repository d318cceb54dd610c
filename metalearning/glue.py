"""(Super)GLUE as meta.py's labelled tasks (meta.py --task glue): unlabelled text read under
[U], the tasks' training sets taking turns step by step, every batch in the (x, y) format of
metalearning/examples.py, and the words of what the teacher writes.

    NANOMLM_RAW=../shared/data python meta.py --task glue --data babylm_10m \\
        --glue-tasks rte,mrpc,cola --labels hard --size tiny --steps 2000
"""
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from metalearning.examples import (extra_tokens, label_tokens, mask_tokens, support_and_query,
                                task_batch)
from data.prepare import PAD, SPECIALS, load_tokenizer, prepare
from data.tasks import MSGS, TASKS, pad, read_task


class GlueTask(NamedTuple):
    data_dir: Path         # the prepared corpus: its tokenizer is the student's
    text_vocab: int        # V, the tokenizer's pieces; the meta tokens follow them
    ids: dict              # extra_tokens: the meta tokens' ids and the whole vocabulary's size
    unlabeled: Callable    # (step, generator) -> x_u, m_u, x_m, y_m (B, T)
    labeled: Callable      # (step, generator) -> x_s, y_s, m_s, x_q, y_q, m_q (B, T)
    words: Callable        # (T,) ids -> text


def glue_task(args, device) -> GlueTask:
    """The corpus --data (prepared first if need be) and the tasks --glue-tasks of --glue-dir,
    as the batches meta.pretrain reads; each batch a function of (--seed, step)."""
    data_dir = prepare(args.data, args.vocab_size)
    tok = load_tokenizer(data_dir)
    V = tok.get_piece_size()
    tasks = args.glue_tasks
    sets = {t: read_task(args.glue_dir, t, "train", tok, args.seq_len) for t in tasks}
    ids = extra_tokens(V, tasks)
    stream = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    label_ids = {t: torch.tensor(label_tokens(ids["task"][t], TASKS.get(t, MSGS)[1]),
                                 device=device) for t in tasks}
    seeded = lambda seed: torch.Generator().manual_seed(seed)

    def unlabeled(step, gen):
        starts = torch.randint(len(stream) - args.seq_len, (args.batch_size,),
                               generator=seeded(args.seed * 1_000_003 + step))
        x = np.stack([stream[s:s + args.seq_len - 1] for s in starts.tolist()]).astype(np.int64)
        x = torch.cat([torch.full((len(x), 1), ids["unl"]), torch.from_numpy(x)], 1).to(device)
        x_m, y_m = mask_tokens(x, gen, len(SPECIALS), V, ids["mlm"])
        return {"x_u": x, "m_u": torch.ones_like(x), "x_m": x_m, "y_m": y_m}

    def labeled(step, gen):
        t = tasks[step % len(tasks)]                                      # tasks take turns
        examples, out = sets[t], {}
        pair = support_and_query(len(examples.seqs), args.task_batch,
                                 seeded(args.seed * 7919 + step))
        for s, idx in zip("sq", pair):
            idx = idx.tolist()
            task_first = [[ids["task"][t]] + examples.seqs[i][1:] for i in idx]  # [CLS] -> [TASK]
            x = torch.from_numpy(pad(task_first)).to(device)
            labels = torch.as_tensor(examples.labels[idx], device=device)
            x, y = task_batch(x, labels, torch.arange(len(x), device=device), label_ids[t])
            out.update({f"x_{s}": x, f"y_{s}": y, f"m_{s}": (x != PAD).long()})
        return out

    meta_names = {ids["mlm"]: "[MLM]", ids["unl"]: "[U]",
                  **{v: f"[{k.upper()}]" for k, v in ids["task"].items()}}
    name = lambda i: tok.id_to_piece(i) if i < V else meta_names.get(i, f"[{i}]")
    words = lambda t: " ".join(name(i) for i in t.tolist())
    return GlueTask(data_dir, V, ids, unlabeled, labeled, words)
