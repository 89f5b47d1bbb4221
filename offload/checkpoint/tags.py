"""The tags of a checkpoint directory: the ``latest`` pointer, retention (``checkpoint.keep_last``),
and what a save that failed leaves (nothing: its partial tag is removed, ``latest`` untouched).

A tag is a directory with DCP's ``.metadata`` file, which DCP writes last, after every rank's data:
a tag without it is a save that did not finish, and is never counted or loaded as a checkpoint."""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil

from csrc.errors import CheckpointWriteError

logger = logging.getLogger(__name__)

__all__ = ["LATEST", "METADATA", "failed_save", "prune", "read_latest", "resolve_path", "saved_tags", "write_latest"]

LATEST = "latest"
METADATA = ".metadata"


def read_latest(save_dir: str) -> str | None:
    """The tag ``latest`` names, or None."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``latest`` at ``tag``: a new file renamed over the old, so it is never half written."""
    tmp = os.path.join(save_dir, f".{LATEST}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
    os.replace(tmp, os.path.join(save_dir, LATEST))


def resolve_path(load_dir: str, tag: str | None) -> str | None:
    """The directory of ``tag`` (None: the tag ``latest`` names) if it is there, else None."""
    tag = tag if tag is not None else read_latest(load_dir)
    if tag is None:
        return None
    path = os.path.join(load_dir, str(tag))
    return path if os.path.isdir(path) else None


def _natural(tag: str) -> list:
    """``global_step9`` before ``global_step10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", tag)]


def saved_tags(save_dir: str) -> list[str]:
    """The finished tags in ``save_dir``, oldest save first: by when each one's metadata was written,
    then (saves within one tick of the file system's clock) by name, numbers as numbers."""
    found = []
    for entry in os.scandir(save_dir):
        if entry.is_dir(follow_symlinks=False):
            try:
                found.append((os.stat(os.path.join(entry.path, METADATA)).st_mtime_ns, _natural(entry.name), entry.name))
            except FileNotFoundError:
                continue
    return [name for *_, name in sorted(found)]


def prune(save_dir: str, keep_last: int, current: str) -> list[str]:
    """Remove the oldest tags so that ``keep_last`` remain (0: keep all); never ``current`` nor the
    tag ``latest`` names. Returns the tags removed."""
    if keep_last <= 0:
        return []
    keep = {current, read_latest(save_dir)}
    tags = saved_tags(save_dir)
    removed = [t for t in tags[:max(0, len(tags) - keep_last)] if t not in keep]
    for tag in removed:
        shutil.rmtree(os.path.join(save_dir, tag))
    if removed:
        logger.info("checkpoint.keep_last %d: removed %s from %s", keep_last, ", ".join(removed), save_dir)
    return removed


def _os_error(err: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``err``'s chain, DCP's per-rank failures included."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        for _, (inner, _trace) in sorted(getattr(e, "failures", {}).items()):  # DCP's CheckpointException
            todo.append(inner)
        todo += [e.__cause__, e.__context__]
    return None


def failed_save(path: str, err: BaseException, *, created: bool) -> CheckpointWriteError:
    """The error for a save to ``path`` that raised ``err``, after removing the partial tag (when this
    save ``created`` it: the tag was not a finished checkpoint before). A write error of torch's own serializer carries no errno: a file system
    with no space left then makes it ENOSPC."""
    cause = _os_error(err)
    code = cause.errno if cause is not None else None
    if code is None:
        try:
            st = os.statvfs(os.path.dirname(path) or ".")
            code = errno.ENOSPC if st.f_bavail == 0 else None
        except OSError:
            pass
    if created:
        shutil.rmtree(path, ignore_errors=True)
    left = "the partial tag was removed" if created else "the tag existed before this save and may be incomplete"
    what = f"{errno.errorcode.get(code, code)} ({os.strerror(code)})" if code else f"{type(err).__name__}: {err}"[:500]
    message = f"checkpoint save to {path} failed: {what}; {left}, '{LATEST}' was not changed"
    return CheckpointWriteError(code, message) if code else CheckpointWriteError(message)
