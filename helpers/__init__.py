"""What the stages use that is not their method, above the model and below the stages: a training
run's set-up (training_run), fine-tuning (finetune), a study's plan and report, bench.py's
reference models and operation rows, and meta.py's tasks (Two Moons, GLUE)."""
