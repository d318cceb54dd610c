"""train.py's shared run flags, one --help group each: the data and the model, the optimizer and
its schedule, the masking, the device, where a run starts from. The loop's own flags (steps,
logging, saving) and the objectives' (objectives.py, beside each loss) are declared there."""
import argparse
from dataclasses import fields

from data.masking import MASKINGS
from data.prepare import VOCAB_SIZE
from machinery import flags
from machinery.device import add_device_flag
from model import PRESETS, TRAINING_ATTENTION, ModelConfig
from training.run import COMPILE_SCOPES

# Per-size defaults, under an objective's own: `small` MLM diverged at LAMB lr 1e-2 with 128 x 128
# batches and trains stably at 5e-3; LTG-BERT's 1e-2 goes with 8x larger batches
# (docs/objectives/mlm.md, deviation 4). `tiny` keeps the CPU sweep's 1e-2 (docs/studies/).
SIZE_DEFAULTS = {"tiny": dict(lr=1e-2), "small": dict(lr=5e-3), "base": dict(lr=5e-3)}


def add_run_flags(p: flags.Parser) -> None:
    add = p.add_argument_group("data and model").add_argument
    add("--data", default="babylm_10m", help="a corpus in $NANOMLM_RAW, or a text or "
        "prepared folder")
    # the 5 specials and 256 byte pieces at least (sentencepiece may need more for a corpus)
    add("--vocab-size", type=int, default=VOCAB_SIZE, range=flags.at_least(262),
        help="sentencepiece vocabulary when the data is prepared")
    add("--seq-len", type=int, default=128, range=flags.at_least(3),
        help="tokens per sequence, [CLS] and [SEP] included")
    add("--batch-size", type=int, default=128, range=flags.at_least(1),
        help="sequences per micro-batch per process")
    add("--size", default="small", choices=PRESETS, metavar="SIZE",
        help=f"model preset: {', '.join(PRESETS)} (flags below override)")
    flags.add_fields(add, ModelConfig, {f.name: f.name for f in fields(ModelConfig)
                                        if f.name != "vocab_size"},  # the tokenizer's
                     preset=True, choices={"position": ("relative", "absolute")},
                     ranges={**dict.fromkeys(("n_layer", "n_head", "d_model", "d_ff"),
                                             flags.at_least(1)),
                             "dropout": flags.Range(0, 1, high_open=True),
                             "position_buckets": flags.at_least(2),
                             "max_position": flags.at_least(3),
                             "layer_norm_eps": flags.above(0)})

    add = p.add_argument_group("optimizer and schedule").add_argument
    add("--optim", default="lamb", choices=["adamw", "lamb"],
        help="optimizer; betas (0.9, 0.98)")
    sizes = ", ".join(f"{size} {d['lr']:g}" for size, d in SIZE_DEFAULTS.items())  # by --size
    add("--lr", type=float, default=None, range=flags.at_least(0),
        help=f"peak learning rate ({sizes})")
    add("--warmup", type=float, default=0.016, range=flags.at_least(0),
        help="warmup: a fraction of --max-steps if < 1, else steps")
    add("--schedule", default="cosine", choices=["cosine", "linear", "cosine-cooldown"],
        metavar="NAME", help="decay after warmup: cosine, linear, or cosine-cooldown (to 0 "
        "over --cooldown)")
    add("--cooldown", type=float, default=0.016, range=flags.Range(0, 1, high_open=True),
        help="cosine-cooldown: the share of steps falling linearly to 0")
    add("--min-lr", type=float, default=0.1, range=flags.Range(0, 1),
        help="final learning rate as a fraction of --lr")
    add("--weight-decay", type=float, default=0.1, range=flags.at_least(0),
        help="decoupled weight decay on weight matrices")
    add("--weight-decay-end", type=float, default=None, range=flags.at_least(0),
        help="cosine weight decay to this (default: constant)")
    add("--decay-embeddings", action=argparse.BooleanOptionalAction, default=False,
        help="decay embeddings and positions too")
    add("--eps", type=float, default=1e-6, range=flags.above(0), help="the optimizer's epsilon")
    add("--epochs", type=float, default=10.0, range=flags.above(0),
        help="without --max-steps: passes over the data (BabyLM's limit)")

    add = p.add_argument_group("masking").add_argument
    add("--masking", default="span", choices=list(MASKINGS), metavar="NAME", help="span "
        "(LTG-BERT's), token (BERT's) or uniform (the MLSM code's)")
    add("--mask-p", type=float, default=0.15, help="fraction of tokens predicted (first "
        "step)", range=flags.Range(0, 1, True, True))
    add("--mask-p-end", type=float, default=None, range=flags.Range(0, 1, True, True),
        help="falls linearly from --mask-p to this (default: constant)")

    add = p.add_argument_group("device and speed (docs/bench.md)").add_argument
    add_device_flag(add, "where to train")
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the model (default: on with CUDA)")
    add("--compile-scope", default="model", choices=COMPILE_SCOPES, metavar="NAME",
        help="model (one graph) or layers (one graph all layers reuse)")
    add("--compile-lamb", action=argparse.BooleanOptionalAction, default=False,
        help="compile LAMB's update too (a longer start)")
    add("--attention", default="gather", choices=TRAINING_ATTENTION, metavar="NAME",
        help="one function: gather, gather-fp32, onehot (no atomics) or fused (CUDA kernels)")
    add("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
        help="replay the compiled step as CUDA graphs")
    add("--bf16", action=argparse.BooleanOptionalAction, default=None,
        help="bfloat16 autocast of the forward (default: on with CUDA)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=False,
        help="deterministic kernels: bit-equal resumes on a GPU")

    add = p.add_argument_group("start from").add_argument
    add("--init-from", default=None,
        help="start from this checkpoint's weights (fresh optimizer, step 0)")
    add("--reset", default="", help="with --init-from, these fresh: embeddings, positions")
    add("--freeze", default="", help="parts not trained: embeddings (and so the tied output)")
