"""Writing and reading a run's files safely: atomic replacement (a kill leaves the old file or the
new one, never a torn one), checkpoints with a checksum of their content verified when read, an
OS error (a full disk, a quota, no permission) as one line naming the file, and a lock file that
keeps a second process from writing the same thing.

    from machinery.storage import save_checkpoint, read_checkpoint
    save_checkpoint({"model": model.state_dict(), ...}, "runs/x/ckpt.pt")
    ckpt = read_checkpoint("runs/x/ckpt.pt")        # or one line saying what is wrong with it
"""
import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import socket
from pathlib import Path

import torch


class one_line_os_errors:
    """`with one_line_os_errors(path):` turns an OS error (a full disk, a quota, no
    permission...) into one line naming the path and, for a full disk, the space needed (`need`
    bytes, if known) and free. It also sees an OSError that another error was raised while
    handling (torch.save reports a failed write as a RuntimeError whose context is the OSError)."""

    def __init__(self, path, need: int | None = None):
        self.path, self.need = Path(path), need

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        while isinstance(e, Exception) and not isinstance(e, OSError):  # not SystemExit
            e = e.__context__
        if not isinstance(e, OSError):
            return False
        space = ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            there = next(p for p in [self.path, *self.path.parents] if p.exists())
            need = f"about {self.need / 2**20:,.0f} MiB needed, " if self.need else ""
            space = f" ({need}{shutil.disk_usage(there).free / 2**20:,.0f} MiB free)"
        raise SystemExit(f"error: cannot write {self.path}: "
                         f"{e.strerror or type(e).__name__}{space}") from None


def file_to_write(path, error, what: str) -> Path:
    """An --out that names a file to write, checked before the work: a folder is refused by
    `error` (the parser's, one line: give `what`), and the file's folder is made now, so that one
    that cannot be made stops in one line too, not after hours of work."""
    out = Path(path)
    if out.is_dir():
        error(f"--out {out} is a folder; give {what}")
    with one_line_os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    return out


def hold_lock(path, what: str, advice: str):
    """Take the lock file `path` (flock) for as long as the returned file stays open (the
    caller keeps it): a second process is refused in one line, "`what` is in use by HOLDER;
    `advice`". The kernel drops the lock of a process that dies however it dies, so a stale
    lock file is simply taken over."""
    path = Path(path)
    with one_line_os_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SystemExit(f"error: {what} is in use by {holder}; {advice}") from None
    except OSError as e:  # a filesystem without flock (some Lustre, NFS or FUSE mounts)
        print(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second process "
              f"from writing {what} at the same time")
    with one_line_os_errors(path):
        f.truncate(0)
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
    return f


def checksum(state) -> str:
    """sha256 of a checkpoint's content, in order: every tensor's dtype, shape and bytes, every
    other value's type and repr. The zip file torch.save writes carries CRCs, but torch.load
    never checks them: bytes flipped inside a tensor would load as silently wrong weights."""
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)}:".encode())
            h.update(t.view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"{{{len(x)}:".encode())
            for k, v in x.items():
                feed(k)
                feed(v)
        elif isinstance(x, (list, tuple, set, frozenset)):  # a set in an order of its own
            h.update(f"[{len(x)}:".encode())
            for v in sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x:
                feed(v)
        else:
            b = x if isinstance(x, bytes) else repr(x).encode()
            h.update(f"{type(x).__name__}{len(b)}:".encode())
            h.update(b)
    feed(state)
    return h.hexdigest()


def tensors(x):
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors(v)


@contextlib.contextmanager
def atomic_write(path, need: int | None = None):
    """`with atomic_write(path) as tmp:` the block writes tmp, a temp file of this process beside
    `path`, which then replaces `path` in one rename: a kill at any moment leaves the old file or
    the new one, never a torn one. A failure removes tmp; an OS error is one line
    (`one_line_os_errors`, with `need` bytes)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with one_line_os_errors(path, need):
            yield tmp
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(state: dict, path) -> None:
    """`state` and its checksum, fsynced to a temp file and renamed (`atomic_write`)."""
    state = {k: v for k, v in state.items() if k != "checksum"}
    state["checksum"] = checksum(state)  # of the rest: the right side runs before the key exists
    with atomic_write(path, sum(t.nbytes for t in tensors(state))) as tmp, open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def load_state(path, map_location="cpu") -> dict:
    """torch.load a file save_checkpoint wrote, its checksum verified, or one line saying what is
    wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, random bytes, a pickle of something else...
        raise SystemExit(f"error: cannot read checkpoint {path} (corrupt or truncated file: "
                         f"{type(e).__name__})") from None
    if not isinstance(state, dict) or "checksum" not in state:
        raise SystemExit(f"error: {path} has no checksum: it was not written by nanoMLM")
    saved = state.pop("checksum")
    if checksum(state) != saved:
        raise SystemExit(f"error: {path} is corrupt: its content does not match the checksum "
                         f"it was saved with (damaged on disk or in a copy); use another "
                         f"checkpoint")
    return state


def checkpoint_identity(path) -> dict:
    """What stands for a checkpoint's weights in the fingerprint of work kept from them (its
    resolved path, size and modification time): a retrained file gets a new one."""
    stat = Path(path).stat()
    return {"ckpt": str(Path(path).resolve()), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


def read_checkpoint(path) -> dict:
    """The checkpoint dict, on the CPU, or a one-line error naming what is wrong with the file."""
    ckpt = load_state(path)
    if not isinstance(ckpt, dict) or not {"model", "config", "tokenizer"} <= ckpt.keys():
        raise SystemExit(f"error: {path} is not a nanoMLM checkpoint (no model/config/tokenizer)")
    return ckpt
