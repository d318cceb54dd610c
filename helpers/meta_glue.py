"""meta.py --task glue: a teacher writes pretraining examples from unlabelled text, learning
from (Super)GLUE tasks; the student it leaves is an ordinary checkpoint that evaluate.py
fine-tunes.

    NANOMLM_RAW=../shared/data python meta.py --task glue --data babylm_10m \\
        --glue-tasks rte,mrpc,cola --labels hard --size tiny --steps 2000
"""
from dataclasses import asdict, replace

import numpy as np
import torch
from tqdm import tqdm

from data.prepare import PAD, SPECIALS, load_tokenizer, prepare
from data.tasks import MSGS, TASKS, pad, read_task
from helpers.meta_pretrain import (Teacher, extra_tokens, label_tokens, mask_tokens, model_config,
                                   optimizers, pretrain, support_and_query, task_batch)
from machinery.run_folder import RunFolder
from machinery.storage import load_state
from model import Encoder


def run_glue(args, device, folder: RunFolder):
    data_dir = prepare(args.data, args.vocab_size)
    tok = load_tokenizer(data_dir)
    V = tok.get_piece_size()
    tasks = args.glue_tasks
    sets = {t: read_task(args.glue_dir, t, "train", tok, args.seq_len) for t in tasks}
    ids = extra_tokens(V, tasks)
    cfg = model_config(args, ids["vocab"])
    folder.write("config", asdict(cfg))
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
    samples = open(folder.path / "samples.txt", "a")

    def show(step, x_u, x_hat, y_hat):
        """The first two sequences the teacher read and what it wrote (Shen's Tables 1 and 3)."""
        text = "".join(f"step {step}, sequence {r}\n  read    {words(x_u[r])}\n"
                       f"  x^      {words(x_hat[r])}\n  y^      {words(y_hat[r])}\n"
                       for r in range(min(2, len(x_u))))
        samples.write(text)
        samples.flush()
        tqdm.write(text)

    torch.manual_seed(args.seed)
    student, teacher = Encoder(cfg).to(device).train(), Teacher(cfg).to(device).train()
    opts = optimizers(student, teacher, args)
    start = 0
    if args.resume and (folder.path / "meta.pt").exists():
        state = load_state(folder.path / "meta.pt", map_location=device)
        student.load_state_dict(state["student"], strict=True)
        teacher.load_state_dict(state["teacher"], strict=True)
        for o, s in zip(opts, state["optimizers"]):
            o.load_state_dict(s)
        start = state["step"]
        folder.resume(start)
        print(f"resuming at step {start}")
    tokenizer = (data_dir / "tokenizer.model").read_bytes()

    def save(step):
        folder.save({"student": student.state_dict(), "teacher": teacher.state_dict(),
                     "step": step, "optimizers": [o.state_dict() for o in opts]}, "meta.pt")
        text_only = lambda k, v: v[:V] if k in ("word.weight", "head_bias") else v
        sd = {k: text_only(k, v) for k, v in student.state_dict().items()}  # for evaluate.py
        folder.save({"model": sd, "config": asdict(replace(cfg, vocab_size=V)),
                     "tokenizer": tokenizer, "step": step, "args": vars(args)}, "ckpt.pt")

    def log(record):
        folder.log(record)
        tqdm.write(" | ".join(f"{k} {v}" for k, v in record.items()))

    pretrain(student, teacher, unlabeled, labeled, args, device, desc=f"meta {args.labels}",
             log=log, show=show, start=start, opts=opts, save=save)
    save(args.steps)
    print(f"wrote {folder.path / 'ckpt.pt'} (the student; fine-tune it with evaluate.py finetune)")
