"""Reattach tokens kept by ``TierClient`` (see [Note: reattach token] in ``daemon.client``).

A token lives in ``<token dir>/<sha256 of socket path, job id, rank>.token`` (mode 0600),
in a directory of this uid that no one else can read: ``$XDG_RUNTIME_DIR/offload``, else
``/run/user/<uid>/offload``, else ``/tmp/offload-<uid>`` (made 0700). Files are written
whole (a temporary file renamed over the old one) and read as bytes.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat

logger = logging.getLogger(__name__)

__all__ = ["TokenFile", "token_dir_of_this_uid"]


def token_dir_of_this_uid(configured: str | None) -> str | None:
    """The token directory of this uid, made 0700, or None when it is not safe to use."""
    uid = os.getuid()
    if configured:
        path = configured
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = os.path.join(os.environ["XDG_RUNTIME_DIR"], "offload")
    elif os.path.isdir(f"/run/user/{uid}"):
        path = f"/run/user/{uid}/offload"
    else:
        path = f"/tmp/offload-{uid}"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        logger.warning("reattach tokens not kept: cannot make %s (%s)", path, exc.strerror)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        logger.warning("reattach tokens not kept: %s is not a directory of uid %d closed to others", path, uid)
        return None
    return path


class TokenFile:
    """Where one session's reattach token is kept ([Note: reattach token])."""

    def __init__(self, socket_path: str, job_id: str, rank: int, token_dir: str | None = None) -> None:
        directory = token_dir_of_this_uid(token_dir)
        key = f"{os.path.abspath(socket_path)}\0{job_id}\0{rank}".encode()
        self.path = None if directory is None else \
            os.path.join(directory, hashlib.sha256(key).hexdigest()[:32] + ".token")

    def read(self) -> str:
        if self.path is None:
            return ""
        try:
            with open(self.path, "rb") as f:
                return f.read(256).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def write(self, token: str) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, token.encode())
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("reattach token not kept in %s: %s", self.path, exc.strerror)

    def remove(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
