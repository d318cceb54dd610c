"""The ground floor under the data, the model and every stage: the run plumbing (plumbing.py:
the command line every script builds, safe saves and the run folder, the device, stop signals,
progress) and the alternative attention kernels (kernels.py). Nothing here
imports the model or data/."""
