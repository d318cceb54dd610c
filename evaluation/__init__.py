"""What evaluate.py's fine-tuning needs beside its command (finetune.py): the (Super)GLUE and
MSGS recipes, the classifier head and its training."""
