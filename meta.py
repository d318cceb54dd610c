"""Meta-learning the pretraining objective: a teacher network writes the student's pretraining
examples and learns from how much they help the student on a labelled task.

    python meta.py --task two_moons --labels hard     # 15 entries of ~72 s: ~9 min with 2 workers
    python meta.py --task two_moons --labels none,mlm,hard,soft  # docs/studies/ (32 min)
    python meta.py --task two_moons --labels soft --sizes 10,160 --seeds 0,1,2,3,4
    python meta.py --task two_moons --protocol shen --labels none,mlm,hard,soft,denoise \\
        --sizes 10,160 --seeds 0,1,2 --workers 16     # Shen's Appendix A: hours
    NANOMLM_RAW=../shared/data python meta.py --task glue --data babylm_10m \\
        --glue-tasks rte,mrpc,cola --labels hard --size tiny --steps 2000
    python evaluate.py finetune --ckpt runs/meta_glue_hard/ckpt.pt --task rte --data-dir ...

Shen (2021), "Meta-learning a Language Modeling Objective" (Stanford CS330 report; code:
jeffdshen/MetaLMO), which carries Meta Pseudo Labels (Pham et al. 2021) from image labels over to
whole input-output text examples. Every example of every task has one shape: an input x whose
first token names the task, and a target y of the same length, PAD meaning "no loss here":
  MLM         x = [MLM] + the masked text, y = the original token at the masked positions;
  a task      x = [TASK] + its input, y = the label's token at every position (predicted: the
              label token with the largest logit averaged over the positions).
The teacher, an encoder from model.py with a second, untied output head, reads an unlabelled x_u
and writes a pseudo example per position: x^ from one head, y^ from the other. A meta step with
the student at theta0 and a support and a query batch of one labelled task:
  (1) theta1 = the student's own AdamW step on (x^, y^)      the only update the student keeps
  (2) theta2 = theta1 - eta grad L_support(theta1)            "fine-tuning"; eta = --inner-lr
  (3) L_query(theta2); the teacher learns to lower it:
  hard labels  x^, y^ are sampled tokens; the teacher's gradient is h grad_T CE((x^, y^), T(x_u))
      with h = cos(grad L_query(theta2), theta0 - theta1): the first-order (MAML-like) MPL signal,
      in which the parameter change of the adaptive optimiser stands in for the gradient (Shen,
      eq. 8). h > 0: the pseudo example moved the student downhill on the query; make it likelier.
  soft labels  x^, y^ are the teacher's distributions (the student embeds x^ as expected word
      vectors, y^ is a soft cross-entropy target), so L_query(theta2) is a differentiable function
      of the teacher and its gradient is exact. Step (1) is unrolled as the student's own AdamW
      step, from the moments its optimiser holds (adamw_unroll; MetaLMO does it with `higher`),
      or with --unroll sgd as theta0 - eta grad L_pseudo(theta0); torch.func.functional_call
      runs the student on the unrolled weights. As in MetaLMO's soft runs, the meta term weighs
      100 and half of the steps take MLM on other text as their labelled task (--meta-weight,
      --mlm-task-p).
The support and the query batch of a labelled task never share an example. Auxiliary teacher
losses (Shen, sec. 3.4), always on: given x_u relabelled [MLM] (the teacher reads unlabelled text
under its own [U] token for the meta loss), write an MLM task (x^ -> x_m, y^ -> the relabelled
x_u, as MetaLMO's in-place relabel makes it); given x_m, perform it (x^ -> x_m, y^ -> y_m).
--labels mlm pretrains the same student with plain MLM on the same unlabelled batches; --labels
none does not pretrain at all.
"""
import sys

from data.prepare import VOCAB_SIZE, raw_root
from helpers.meta_glue import run_glue
from helpers.meta_moons import PROTOCOLS, run_two_moons
from helpers.meta_pretrain import MODEL_FLAGS
from machinery import flags
from machinery.device import pick_device
from machinery.progress import line_buffered
from machinery.run_folder import REPO, RunFolder, repo_sources
from model import PRESETS, ModelConfig


def protocol_defaults(args) -> None:
    """The flags left unset take the --protocol's values (two_moons), or ours (glue)."""
    values = PROTOCOLS[args.protocol if args.task == "two_moons" else "nanomlm"]
    for k, v in values.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.teacher_lr is None:
        args.teacher_lr = args.lr


# ---------------------------------------------------------------------------------------------
# Command line

def build_parser() -> flags.Parser:
    ap = flags.Parser(prog="meta.py", description=__doc__)
    add = ap.add_argument
    add("--task", choices=("two_moons", "glue"), default="two_moons",
        help="the toy task, or text + (Super)GLUE")
    add("--labels", default="hard", help="comma-separated, of: hard, soft (the teacher's "
        "examples), denoise (soft with y^ fixed to the text read: Shen's Appendix B), mlm (plain "
        "MLM, the baseline), none (no pretraining); --task glue takes one")
    add("--protocol", choices=tuple(PROTOCOLS), default="nanomlm",
        help="two_moons: the defaults of the flags below: nanomlm (ours: 1000 steps of 32, "
        "fine-tuned full-batch for 200 steps) or shen (his report's Appendix A: 40k steps of 16, "
        "dropout 0.1, lr/sqrt(n), fine-tuned 100 epochs, best epoch on validation) "
        "(default nanomlm)")
    add("--steps", type=int, default=None,
        help="pretraining steps (default: the protocol's; glue 1000)")
    add("--batch-size", type=int, default=None, help="unlabelled sequences per step (default: "
        "the protocol's, 32 or 16)")
    add("--task-batch", type=int, default=None,
        help="labelled examples in each of the support and query batches (default 8; shen 4)")
    add("--lr", type=float, default=None, help="the student's AdamW learning rate, the MLM "
        "baseline's too (default 3e-3; shen 0.08 x n^-1/2)")
    add("--teacher-lr", type=float, default=None,
        help="the teacher's AdamW learning rate (default: as --lr)")
    add("--inner-lr", type=float, default=0.1, help="SGD learning rate eta of the unrolled steps")
    add("--unroll", choices=("adamw", "sgd"), default="adamw",
        help="soft labels: step (1) unrolled as the student's own AdamW step (MetaLMO's) or as "
        "an SGD step at --inner-lr (default adamw)")
    add("--mlm-task-p", type=float, default=None,
        help="probability that a step's labelled task is MLM on other unlabelled text (default: "
        "0.5 for soft, as MetaLMO's soft runs; 0 otherwise)")
    add("--meta-weight", type=float, default=None,
        help="weight of the meta term against the teacher's two MLM losses (default 100 for "
        "soft and denoise labels, as MetaLMO's soft runs; 1 otherwise)")
    add("--weight-decay", type=float, default=0.01, help="AdamW weight decay, all optimisers")
    add("--clip", type=float, default=None,
        help="gradient-norm clip of every outer step (default 1; shen 5)")
    add("--seed", type=int, default=0, help="model init and batches (--task glue)")
    add("--seeds", default="0,1,2", help="two_moons: one pretraining + fine-tuning per seed")
    add("--sizes", default="10,20,40,80,160",
        help="two_moons: labelled-set sizes (even, at most 160)")
    add("--data-seed", type=int, default=0, help="two_moons: seed of the generated data")
    add("--labeled-points", choices=("random", "even"), default=None,
        help="two_moons: the labelled and validation points: random (drawn as the rest; the "
        "first n of one draw) or even (MetaLMO's make_moons(n): evenly spaced along each moon, "
        "then noise; one draw per size) (default random; shen even)")
    add("--workers", type=int, default=2,
        help="two_moons on CPU: table entries computed in parallel processes")
    add("--ft-steps", type=int, default=None,
        help="two_moons, nanomlm: full-batch fine-tuning steps (default 200)")
    add("--ft-epochs", type=int, default=None,
        help="two_moons, shen: fine-tuning epochs, the best on validation kept; 0: full-batch "
        "--ft-steps instead (default 100)")
    add("--ft-lr", type=float, default=None,
        help="two_moons: fine-tuning AdamW learning rate (default 1e-2; shen 0.04 x n^-1/2)")
    add("--data", default="babylm_10m",
        help="glue: unlabelled corpus (a name under $NANOMLM_RAW or a folder)")
    add("--vocab-size", type=int, default=VOCAB_SIZE,
        help="glue: tokenizer size when the corpus is prepared first")
    add("--glue-dir", default=None, help="glue: folder of TASK.train.jsonl files (default "
        "$NANOMLM_RAW/babylm_eval/full_eval/glue_filtered)")
    add("--glue-tasks", default="rte,mrpc,cola",
        help="glue: labelled tasks (TASK.train.jsonl), taking turns step by step")
    add("--seq-len", type=int, default=128, help="glue: sequence length (two_moons: 34, fixed)")
    add("--size", choices=tuple(PRESETS), default="tiny",
        help="glue: model preset (two_moons: 2 layers, d_model 8)")
    helps = flags.field_help(ModelConfig)
    for f in MODEL_FLAGS[:-1]:
        add(f"--{f.replace('_', '-')}", type=int, default=None,
            help=f"{helps[f]} (overrides the preset)")
    add("--position", choices=("relative", "absolute"), default=None, help=helps["position"])
    add("--dropout", type=float, default=None,
        help="dropout (default 0: small data, and exact unrolls; shen 0.1)")
    add("--log-every", type=int, default=50,
        help="glue: steps between log lines and teacher samples")
    add("--save-every", type=int, default=500, help="glue: steps between checkpoints")
    add("--out-dir", default=None, help="run folder (default runs/meta_<task>_<labels>)")
    add("--resume", action="store_true",
        help="continue the run in --out-dir (two_moons: skip finished cells)")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to train")
    return ap


# the values each numeric flag may take (--clip 0 would zero every gradient: no "off" here)
R = flags.Range
RANGES = {"steps": R(1), "batch_size": R(1), "task_batch": R(1), "lr": R(0), "teacher_lr": R(0),
          "inner_lr": R(0), "mlm_task_p": R(0, 1), "meta_weight": R(0), "weight_decay": R(0),
          "clip": R(0, low_open=True), "seed": R(0), "seeds": R(0), "data_seed": R(0),
          "workers": R(1), "ft_steps": R(0), "ft_epochs": R(0), "ft_lr": R(0),
          "vocab_size": R(262), "seq_len": R(3), **{f: R(1) for f in MODEL_FLAGS[:-1]},
          "dropout": R(0, 1, high_open=True), "log_every": R(1), "save_every": R(1)}


def main(argv=None):
    line_buffered()
    ap = build_parser()
    args = ap.parse_args(argv)
    args.seeds = flags.integers(ap, "seeds", args.seeds)
    args.sizes = flags.integers(ap, "sizes", args.sizes)
    flags.check_ranges(ap, args, RANGES)
    protocol_defaults(args)
    args.labels_list = args.labels.split(",")
    bad = [x for x in args.labels_list if x not in ("hard", "soft", "denoise", "mlm", "none")]
    if bad:
        ap.error(f"--labels {','.join(bad)}: each must be hard, soft, denoise, mlm or none")
    if args.task == "two_moons":
        if any(s < 2 or s > 160 or s % 2 for s in args.sizes):
            ap.error("--sizes must be even numbers from 2 to 160")
        args.seq_len = 34  # [U], 16 points, [SEP]
        if not args.ft_epochs and args.ft_steps is None:
            ap.error("--ft-epochs 0 fine-tunes full-batch for --ft-steps steps: give --ft-steps")
    else:
        if len(args.labels_list) != 1 or args.labels == "none":
            ap.error("--task glue pretrains one student: give one of --labels hard, soft or mlm")
        args.glue_tasks = args.glue_tasks.split(",")
        if args.glue_dir is None:
            args.glue_dir = str(raw_root() / "babylm_eval" / "full_eval" / "glue_filtered")
        args.glue_dir = str(args.glue_dir)
    device = pick_device(args.device)
    name = f"meta_{args.task}_{args.labels.replace(',', '+')}"
    folder = RunFolder(args.out_dir or REPO / "runs" / name)
    folder.lock()  # one process per run folder
    if not args.resume:
        folder.check_new()
    folder.start(repo_sources(), keep_log=args.resume, args=vars(args))
    print(f"meta.py {args.task} --labels {args.labels} on {device}; run folder {folder.path}",
          file=sys.stderr)
    (run_two_moons if args.task == "two_moons" else run_glue)(args, device, folder)


if __name__ == "__main__":
    main()
