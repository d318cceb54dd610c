"""meta.py's two tasks, each handing the teacher-student loop its batches: Two Moons (moons.py)
and GLUE from BabyLM text (glue.py), in one (x, y) format of examples (examples.py)."""
