"""What train.py's loop calls besides the model, the objectives and the data: the optimizer and
its schedules (optim.py)."""
