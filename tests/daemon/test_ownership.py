"""Sessions belong to their uid: no other uid reattaches to one, reads its memory, squats its job id, or
sees it in STATUS. Runs as root with two throwaway users (skipped otherwise); their clients are forked
from this process and drop to the user's uid, so they run the same code."""
from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import traceback

import numpy as np
import pytest

from csrc.errors import SessionError
from daemon.client import DaemonConnection, TierClient, TierClientConfig
from daemon.protocol import PROTOCOL_VERSION, Kind

@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to make throwaway users")
    names = [f"oflt{os.getpid() % 100000}{c}" for c in "ab"]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True, capture_output=True)
            made.append(name)
        yield [pwd.getpwnam(n).pw_uid for n in names]
    finally:
        for name in made:
            shutil.rmtree(f"/tmp/offload-{pwd.getpwnam(name).pw_uid}", ignore_errors=True)  # their tokens
            subprocess.run(["userdel", name], capture_output=True)


def run_as(uid: int, fn, *args, groups: tuple[int, ...] = ()):
    """``fn(*args)`` in a child forked from this process with ``uid`` (and supplementary ``groups``); its return
    value (JSON) or its error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, run, report, leave without cleanup of the parent's state
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(pwd.getpwuid(uid).pw_gid)
            os.setuid(uid)
            os.environ.pop("XDG_RUNTIME_DIR", None)
            out = {"ok": fn(*args)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def open_and_fill(socket_path: str, job: str, value: int, detach: bool) -> dict:
    c = TierClient(TierClientConfig(socket_path=socket_path, job_id=job, timeout_seconds=20))
    if not c.reattached:
        c.allocate("secret", 8192)
        np.frombuffer(c.host_view("secret"), np.uint8)[:] = value
        c.mark_dirty("secret")
    seen = int(np.frombuffer(c.host_view("secret"), np.uint8).max()) if c.reattached else value
    out = {"session_id": c.session_id, "reattached": c.reattached, "seen": seen}
    (c.detach if detach else c.close)()
    return out


def peek_other(socket_path: str, job: str, token: str) -> dict:
    """Another uid's attempts on ``job``: a HELLO with the job id and the (leaked) token."""
    conn = DaemonConnection(socket_path, 10)
    body = {"version": PROTOCOL_VERSION, "job_id": job, "rank": 0, "quota_bytes": 0}
    reply, fds = conn.request(Kind.HELLO, {**body, "token": token} if token else body)
    import mmap
    m = mmap.mmap(fds[0], reply["segments"][0]["nbytes"])
    nonzero = int(np.frombuffer(m, np.uint8).max())
    m.close()
    for fd in fds:
        os.close(fd)
    status = conn.request(Kind.STATUS)[0]
    conn.request(Kind.BYE)
    conn.close()
    return {"reattached": reply["reattached"], "session_id": reply["session_id"], "max_byte": nonzero,
            "status_jobs": sorted((s["job_id"], s.get("uid", -1)) for s in status["sessions"])}


def token_of(d, uid: int) -> str:
    """The token uid's TierClient kept for job "job" (root reads it where that uid's client put it)."""
    from daemon.tokens import TokenFile

    mine = TokenFile(d.socket_path, "job", 0, d.workdir + "/tokens")
    path = os.path.join(f"/tmp/offload-{uid}", os.path.basename(mine.path))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and os.stat(os.path.dirname(path)).st_uid == uid
    with open(path) as f:
        return f.read()


def test_only_the_owner_reattaches_and_sees_its_session(daemon_factory, users):
    a, b = users
    d = daemon_factory(server={"allowed_uids": [a, b], "socket_mode": 0o666},
                       sessions={"reattach_grace_seconds": 30.0})
    os.chmod(d.workdir, 0o755)
    first = run_as(a, open_and_fill, d.socket_path, "job", 0xAB, True)
    assert "ok" in first and first["ok"]["reattached"] is False, first
    # b, with a's job id and rank during a's grace period, gets a session of its own: new, empty, not a's.
    other = run_as(b, peek_other, d.socket_path, "job", "")
    assert "ok" in other, other
    assert other["ok"]["reattached"] is False and other["ok"]["max_byte"] == 0, other
    # And so it does even holding a's token (as if it leaked).
    token = token_of(d, a)
    assert token, "a's token was not kept"
    other = run_as(b, peek_other, d.socket_path, "job", token)
    assert "ok" in other, other
    assert other["ok"]["reattached"] is False and other["ok"]["session_id"] != first["ok"]["session_id"]
    assert other["ok"]["max_byte"] == 0  # recycled or fresh memory, never a's bytes
    assert other["ok"]["status_jobs"] == [["job", b]]  # a's session is not shown to b
    # a's restarted process reattaches through the token it kept, bytes intact.
    again = run_as(a, open_and_fill, d.socket_path, "job", 0, True)
    assert again["ok"] == {"session_id": first["ok"]["session_id"], "reattached": True, "seen": 0xAB}, again
    # Root sees every session with its uid; and root may reattach a's session with a's token.
    rows = {(s["job_id"], s["uid"]) for s in d.status()["sessions"]}
    assert ("job", a) in rows
    token = token_of(d, a)
    root = TierClient(TierClientConfig(socket_path=d.socket_path, job_id="job", reattach_token=token,
                                       token_dir=str(d.workdir) + "/root-tokens", timeout_seconds=20))
    assert root.reattached and root.session_id == first["ok"]["session_id"]
    assert (np.frombuffer(root.host_view("secret"), np.uint8) == 0xAB).all()
    root.close()


def test_no_uid_can_squat_another_uids_job_id(daemon_factory, users):
    a, b = users
    d = daemon_factory(server={"allowed_uids": [a, b], "socket_mode": 0o666})
    os.chmod(d.workdir, 0o755)
    squat = run_as(b, open_and_fill, d.socket_path, "llama", 1, True)  # b takes the job id first, and leaves
    assert "ok" in squat, squat
    owner = run_as(a, open_and_fill, d.socket_path, "llama", 2, False)
    assert "ok" in owner and owner["ok"]["reattached"] is False, owner
    assert owner["ok"]["session_id"] != squat["ok"]["session_id"]


def test_a_reattach_needs_the_token_and_tierclient_keeps_it(daemon_factory, tmp_path):
    d = daemon_factory(sessions={"reattach_grace_seconds": 30.0})
    config = TierClientConfig(socket_path=d.socket_path, job_id="tok", timeout_seconds=20, token_dir=str(tmp_path))
    c = TierClient(config)
    c.allocate("x", 4096)
    c.host_view("x")[:] = b"k" * 4096
    c.detach()
    conn = DaemonConnection(d.socket_path, 10)
    body = {"version": PROTOCOL_VERSION, "job_id": "tok", "rank": 0, "quota_bytes": 0}
    for attempt in (body, {**body, "token": "not-the-token"}):
        with pytest.raises(SessionError, match="needs the token of its last HELLO reply"):
            conn.request(Kind.HELLO, attempt)
    conn.close()
    again = TierClient(config)  # reads the token its predecessor kept
    assert again.reattached and bytes(again.host_view("x")) == b"k" * 4096
    files = os.listdir(tmp_path)
    assert len(files) == 1 and os.stat(tmp_path / files[0]).st_mode & 0o777 == 0o600
    again.close()
    assert os.listdir(tmp_path) == []  # close() ends the session: nothing left to reattach to


def open_session(socket_path: str) -> int:
    c = TierClient(TierClientConfig(socket_path=socket_path, job_id="grouped", timeout_seconds=20))
    session_id = c.session_id
    c.close()
    return session_id


def test_members_of_the_socket_group_connect_and_others_do_not(daemon_factory, users):
    """The systemd set-up: the socket 0660 in a group training users join, no allowed_uids."""
    a, b = users
    group = f"oflg{os.getpid() % 100000}"
    subprocess.run(["groupadd", "--system", group], check=True, capture_output=True)
    try:
        gid = grp.getgrnam(group).gr_gid
        d = daemon_factory(server={"socket_group": group, "socket_mode": 0o660})
        os.chmod(d.workdir, 0o755)
        st = os.stat(d.socket_path)
        assert (st.st_gid, st.st_mode & 0o777) == (gid, 0o660)
        member = run_as(a, open_session, d.socket_path, groups=(gid,))  # a supplementary group, as usermod -aG
        assert "ok" in member, member
        outsider = run_as(b, open_session, d.socket_path)
        assert outsider.get("error") == "PermissionError", outsider  # the socket's mode keeps b out
        # A socket anyone may open: the daemon itself lets in the group's members and refuses the rest.
        d.stop()
        d2 = daemon_factory(server={"socket_group": group, "socket_mode": 0o666})
        os.chmod(d2.workdir, 0o755)
        assert "ok" in run_as(a, open_session, d2.socket_path, groups=(gid,))
        refused = run_as(b, open_session, d2.socket_path)
        assert "error" in refused, refused
        assert f"refused a connection from uid {b}" in d2.log() and "not in [server] allowed_uids" in d2.log()
    finally:
        subprocess.run(["groupdel", group], capture_output=True)
