"""study.py's plan (plan.py: a study file read into its jobs) and report (report.py: the
Multi-Bootstrap comparisons); beside them, the study files themselves (*.toml); and the
README's first screen measured (first_screen.py, run as `python -m studies.first_screen`)."""
