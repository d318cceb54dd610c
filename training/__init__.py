"""What train.py's run keeps outside its loop (run.py): a run opened or resumed, a phase made
ready, its checkpoints and its report lines. meta.py reads the model its flags ask for here."""
