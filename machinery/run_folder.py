"""A run folder, the same for every script (train.py, meta.py): its lock (one process per
folder), its JSON settings, its log.jsonl, the code that ran and its version.

    runs/NAME/  args.json config.json data.json  the settings, the model, the corpus' meta.json
                log.jsonl    every logged figure, one JSON record a line
                ckpt.pt ...  checkpoints (train.py: phase1.pt, dict.pt, chck_*.pt too)
                code/        every source file of the repository the run imported, at its path
                lock         held by the one process writing there
                eval/        evaluate.py's results, next to the checkpoint
"""
import functools
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from machinery.storage import hold_lock, one_line_os_errors, save_checkpoint


REPO = Path(__file__).resolve().parents[1]


def repo_sources() -> list[str]:
    """The repository's source files this process has imported (the tests' aside), as repository
    paths: what decides a run's results, so each run copies them into its code/ and hashes them
    into its checkpoints. Derived, not listed: a module a stage comes to import is never left
    out (tests/test_train.py holds it to a static reading of train.py's imports)."""
    loaded = {Path(m.__file__).resolve() for m in list(sys.modules.values())
              if getattr(m, "__file__", None) and Path(m.__file__).is_absolute()}
    return sorted(f for f in repository_files(loaded)
                  if f.endswith(".py") and not f.startswith("tests/"))


def is_repository_file(path) -> bool:
    """Whether `path` is one of the repository's own files (repository_files)."""
    return bool(repository_files([path]))


def repository_files(paths) -> list[str]:
    """Those of `paths` that are the repository's own files, as repository paths: under its
    root, not inside a Python environment there (below a folder that holds a pyvenv.cfg,
    wherever it is and whatever its name: the README's .venv/ holds torch and numpy; or in a
    site-packages or dist-packages folder), and in a git checkout files git tracks or would
    (untracked, not ignored). One call for them all, in plain loops: the tests count the calls
    of the repository's functions a run makes (tests/test_train.py)."""
    known, out = git_files(), []
    for path in paths:
        path = Path(path).resolve()
        if not path.is_relative_to(REPO):
            continue
        rel = path.relative_to(REPO)
        folders, outside = rel.parts[:-1], True
        for i in range(len(folders) + 1):
            if i and (REPO.joinpath(*folders[:i]) / "pyvenv.cfg").is_file() or (
                    i < len(folders) and folders[i] in ("site-packages", "dist-packages")):
                outside = False
                break
        if outside and (known is None or rel.as_posix() in known):
            out.append(rel.as_posix())
    return out


@functools.cache
def git_files() -> frozenset[str] | None:
    """The files git tracks in the checkout, and those it would (untracked, not ignored), as
    repository paths; None outside a git checkout (the GPU machine's copy has no .git)."""
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return frozenset(r.stdout.decode().split("\0")) - {""} if r.returncode == 0 else None


def code_version(files) -> dict:
    """The git description of the checkout and a hash of the source `files` (repository paths)."""
    digest = hashlib.sha256(b"".join((REPO / f).read_bytes() for f in files)).hexdigest()[:16]
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        git = ""
    return {"git": git or "unknown", "sha256": digest}


class RunFolder:
    """What a run leaves behind (the layout above). Only the master process writes: under DDP
    the other ranks hold one whose writes do nothing."""

    def __init__(self, path, master: bool = True):
        self.path, self.master = Path(path), master
        self.log_path = self.path / "log.jsonl"
        self._log = self._lock = None

    def lock(self) -> None:
        """Hold the folder's `lock` file (flock) until this process exits: a second process on
        the same folder is refused, naming the holder. The kernel drops the lock of a process
        that dies however it dies, so a stale lock file is simply taken over."""
        if not self.master or self._lock is not None:
            return
        f = hold_lock(self.path / "lock", self.path, "wait for it to end or choose another "
                      "--out-dir")
        with one_line_os_errors(self.path):
            for old in self.path.glob(".*.tmp"):  # a save cut off by a kill: whose is dead now
                old.unlink(missing_ok=True)
        self._lock = f  # kept open: closing the file would release the lock

    def check_new(self, marker: str | None = None) -> None:
        """A new run never writes over an old one: refuse a folder that holds `marker`, the file
        --resume would continue from, or with no marker any folder that holds anything (but the
        lock a run holds while it starts)."""
        there = self.path / marker if marker else self.path
        if there.exists() and (marker or any(p.name != "lock" for p in self.path.iterdir())):
            raise SystemExit(f"error: {there} exists; pass --resume to continue that run or "
                             f"choose another --out-dir")

    def start(self, code, keep_log: bool = False, **files) -> None:
        """Create the folder; write each of `files` ({name: dict}) as NAME.json and a copy of each
        `code` file (repository paths) into code/; start an empty log unless keep_log."""
        if not self.master:
            return
        with one_line_os_errors(self.path / "code"):
            (self.path / "code").mkdir(parents=True, exist_ok=True)
            for f in code:
                (self.path / "code" / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / f, self.path / "code" / f)
            if not keep_log:
                self.log_path.unlink(missing_ok=True)
        for name, content in files.items():
            self.write(name, content)

    def write(self, name: str, content: dict) -> None:
        """NAME.json in the folder."""
        if self.master:
            with one_line_os_errors(self.path / f"{name}.json"):
                (self.path / f"{name}.json").write_text(json.dumps(content, indent=1))

    def records(self) -> list[dict]:
        """The records of log.jsonl (none if there is no log), a line torn by a kill or a full
        disk left out, and counted in self.skipped (what a reader says it left out)."""
        records, self.skipped = [], 0
        for line in self.log_path.read_text().splitlines() if self.log_path.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "step" in record:
                records.append(record)
            else:
                self.skipped += 1
        return records

    def resume(self, step: int) -> None:
        """Continuing from a checkpoint at `step`: drop the log lines that the run which was cut
        off wrote after it, so that the log reads as one uninterrupted run."""
        if self.master and self.log_path.exists():
            records = self.records()
            with one_line_os_errors(self.log_path):
                self.log_path.write_text("".join(json.dumps(r) + "\n" for r in records
                                                 if r["step"] <= step))

    def log(self, record: dict) -> None:
        """One JSON line in log.jsonl, flushed at once (a killed run keeps what it logged)."""
        if self.master:
            with one_line_os_errors(self.log_path):
                self._log = self._log or open(self.log_path, "a")
                self._log.write(json.dumps(record) + "\n")
                self._log.flush()

    def save(self, state: dict, name: str = "ckpt.pt") -> Path:
        """save_checkpoint into the folder (atomic: a kill never leaves a torn file)."""
        if self.master:
            save_checkpoint(state, self.path / name)
        return self.path / name
