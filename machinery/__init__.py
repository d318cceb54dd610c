"""The run machinery, the ground floor under the data, the model and every stage: safe saves and
the run folder, the device, flags, progress, what stops a run, the optimiser pieces, the kernels,
bench timing, result files and the Multi-Bootstrap. Nothing here imports the model or data/."""
