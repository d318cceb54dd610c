"""What train.py's loop calls besides the model, the objectives and the data: the optimizer and
its schedules (optim.py) and the guard that stops a diverging run (guard.py)."""
