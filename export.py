"""Export nanoMLM checkpoints as Hugging Face model folders (the BabyLM evaluation pipeline's
input): config.json, the weights, hub/modeling_nanomlm.py, and a fast tokenizer.

    pip install -r requirements-export.txt          # transformers, tokenizers, safetensors...
    python export.py --ckpt runs/mlm/ckpt.pt --out hf_models/mlm
    python export.py --ckpt runs/mlm --out hf_models/mlm      # a run folder: its ckpt.pt, and
                        # each chck_*.pt that train.py --save-words kept, as
                        # hf_models/mlm/chck_*/mlm (the pipeline files them in results/mlm/chck_*)

Then, with transformers alone:

    from transformers import AutoModelForMaskedLM, AutoTokenizer
    model = AutoModelForMaskedLM.from_pretrained("hf_models/mlm", trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained("hf_models/mlm", trust_remote_code=True)  # [CLS] .. [SEP]

The model predicts through the path its objective trained (a BootBERT masked-autoencoder student
through its decoder, as model.load_checkpoint). The tokenizer is our sentencepiece model,
converted by transformers' SpmConverter with sentencepiece's byte fallback kept.
AutoModelForSequenceClassification loads the same folder with evaluate.py's fine-tuning head. A
gpt-bert model loads through AutoModelForCausalLM too (the pipeline's `--backend causal`), and
through AutoModelForMaskedLM for `--backend mntp`, which reads the logits before each mask.
"""
import argparse
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from data.prepare import CLS, MASK, PAD, SEP, SPECIALS, UNK
from machinery.plumbing import REPO, Parser, one_line_os_errors, read_checkpoint
from model import boot_shape


MODELING = REPO / "hub" / "modeling_nanomlm.py"
NEEDS = "pip install -r requirements-export.txt"


def need_transformers():
    """transformers and its converters, or one line saying what to install."""
    for name in ("transformers", "tokenizers", "google.protobuf"):  # protobuf: the spm model
        try:
            importlib.import_module(name)
        except ImportError:
            raise SystemExit(f"error: export needs {name}: {NEEDS}") from None


def hf_config(ckpt: dict) -> dict:
    """config.json: the encoder's ModelConfig fields, the BootBERT decoder if it predicts
    through one, the special ids, and where transformers finds the classes."""
    depth, mae = boot_shape(ckpt["heads"]) if ckpt.get("decoder") else (0, False)
    classes = {"AutoConfig": "NanoMLMConfig", "AutoModel": "NanoMLMModel",
               "AutoModelForMaskedLM": "NanoMLMForMaskedLM",
               "AutoModelForSequenceClassification": "NanoMLMForSequenceClassification"}
    if ckpt.get("predicts_before"):  # gpt-bert, trained causally too: the causal backend
        classes["AutoModelForCausalLM"] = "NanoMLMForCausalLM"
    return {**ckpt["config"], "boot_decoder_layers": depth, "boot_mae": mae,
            "model_type": "nanomlm", "architectures": ["NanoMLMForMaskedLM"],
            "auto_map": {k: f"modeling_nanomlm.{v}" for k, v in classes.items()},
            "pad_token_id": PAD, "mask_token_id": MASK, "bos_token_id": CLS, "eos_token_id": SEP,
            "objective": ckpt.get("objective"),
            "predicts_before": ckpt.get("predicts_before", False),
            "step": ckpt.get("step"),
            "words_seen": ckpt.get("words_seen"),  # read by that step; a chck_*'s mark below
            **({"words_mark": ckpt["words_mark"]} if "words_mark" in ckpt else {})}


def hf_state(ckpt: dict, config: dict) -> dict:
    """The tensors under NanoMLMForMaskedLM's names: the encoder's as nanomlm.*, a BootBERT
    student's decoder (and mask vector) as boot.* (its regression head is not needed to
    predict tokens and is left out)."""
    state = {f"nanomlm.{k}": v for k, v in ckpt["model"].items()}
    if config["boot_decoder_layers"]:
        state.update({f"boot.{k}": v for k, v in ckpt["heads"].items()
                      if k == "mask" or k.startswith("decoder.")})
    return {k: v.contiguous() for k, v in state.items()}


def fast_tokenizer(proto: bytes):
    """Our sentencepiece model as a PreTrainedTokenizerFast: transformers' SpmConverter, with
    byte fallback kept (sentencepiece spells characters outside the vocabulary as <0x..> bytes;
    the converter would make them [UNK]), [CLS] ... [SEP] added around every sequence."""
    from tokenizers import decoders, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spm.model"
        path.write_bytes(proto)

        class Converter(SpmConverter):
            handle_byte_fallback = True

        class Source:  # what SpmConverter reads from a slow tokenizer
            vocab_file, add_prefix_space = str(path), True

        conv = Converter(Source())
        if conv.proto.trainer_spec.model_type != 1:  # 1: unigram (BabyLM); 4: word (synth.py)
            raise SystemExit("error: export converts unigram sentencepiece models only; this "
                             "checkpoint's tokenizer is word-level (a synthetic corpus's)")
        tk = conv.converted()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    cls, sep = SPECIALS[CLS], SPECIALS[SEP]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, CLS), (sep, SEP)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token=SPECIALS[PAD], unk_token=SPECIALS[UNK], cls_token=cls,
        sep_token=sep, mask_token=SPECIALS[MASK], model_max_length=None)


def export(ckpt_path: Path, out: Path) -> dict:
    """One checkpoint into one folder; returns its config."""
    ckpt = read_checkpoint(ckpt_path)
    if "code_version" in ckpt and "decoder" not in ckpt:  # as model.load_checkpoint
        raise SystemExit(f"error: {ckpt_path} predates checkpoints that say how they predict")
    config = hf_config(ckpt)
    config["model_max_length"] = config["max_position"]
    tok = fast_tokenizer(ckpt["tokenizer"])
    tok.model_max_length = config["max_position"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = hf_state(ckpt, config)
    try:
        from safetensors.torch import save_file
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        # safetensors writes through a private temporary file (0600): readable as the others
        (out / "model.safetensors").chmod((out / "config.json").stat().st_mode & 0o777)
    except ImportError:
        torch.save(state, out / "pytorch_model.bin")
    shutil.copy(MODELING, out / MODELING.name)
    tok.save_pretrained(out)
    # named by its class, so the tokenizer is built without remote code and without
    # transformers 5's class names (the BabyLM pipeline may run transformers 4): it loads with
    # trust_remote_code=False under both. Given no flag at all, transformers 5 (5.24) still asks
    # "run the custom code?", having read config.json's auto_map first; 4.51.3 does not
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    return config


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="export.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=Path, required=True,
                   help="a checkpoint (ckpt.pt, chck_10M.pt...), or a run folder: its ckpt.pt "
                        "into --out and each chck_*.pt into --out/chck_*/NAME, NAME being "
                        "--out's own name (where the BabyLM pipeline files it as a revision)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"error: --out {args.out} is a file, not a folder")
    if args.out.exists() and any(args.out.iterdir()) and not args.force:
        raise SystemExit(f"error: {args.out} exists and is not empty; pass --force to write "
                         f"into it")
    need_transformers()  # after the flags' own checks (importing it takes seconds)
    if args.ckpt.is_dir():
        # the BabyLM pipeline files a model's results under results/<its folder's stem>/<the
        # revision>/: OUT (revision main) and OUT/chck_1M/NAME (--revision_name chck_1M), NAME
        # being OUT's name, land side by side as results/NAME/main, results/NAME/chck_1M, ...
        words = lambda p: float(p.stem[5:-1]) * {"K": 1e3, "M": 1e6}[p.stem[-1]]
        jobs = sorted(args.ckpt.glob("chck_*.pt"), key=words)
        jobs = [(p, args.out / p.stem / args.out.name) for p in jobs]
        if (args.ckpt / "ckpt.pt").exists():
            jobs.append((args.ckpt / "ckpt.pt", args.out))
        if not jobs:
            raise SystemExit(f"error: nothing to export in {args.ckpt}: no ckpt.pt or chck_*.pt")
    else:
        jobs = [(args.ckpt, args.out)]
    for src, dst in jobs:
        with one_line_os_errors(dst):  # an unwritable or impossible --out: one line
            config = export(src, dst)
        print(f"{src} -> {dst} ({config['objective']}, step {config['step']})", file=sys.stderr)


if __name__ == "__main__":
    main()
