"""study.py's plan (plan.py: a study file read into its jobs) and report (report.py: the
Multi-Bootstrap comparisons); beside them, the study files themselves (*.toml)."""
