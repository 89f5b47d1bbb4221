"""The fd store player (tests/daemon/fd_store.py) against real processes: a child stores memfds
over NOTIFY_SOCKET as a daemon would (FDSTORE=1, FDNAME=, FDSTOREREMOVE=1), and a second child,
spawned as systemd restarts a service, finds them at 3, 4, ... under LISTEN_FDS/FDNAMES/PID."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.daemon.fd_store import FdStore

FD_STORE_PY = Path(__file__).resolve().parent / "fd_store.py"
TIMEOUT = 5.0

# Prepended to every sender: send(message, {memfd name: content, ...}) sends one datagram with
# those memfds attached, as sd_pid_notify_with_fds does.
SENDER = textwrap.dedent("""
    import os, socket
    ADDRESS = os.environ["NOTIFY_SOCKET"]
    def memfd(name, content):
        fd = os.memfd_create(name)
        os.write(fd, content)
        return fd
    def send(message, memfds=None):
        fds = [memfd(name, content) for name, content in (memfds or {}).items()]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            if fds:
                sock.connect(ADDRESS)  # Python < 3.13's send_fds drops its address argument
                socket.send_fds(sock, [message.encode()], fds, 0, ADDRESS)
            else:
                sock.sendto(message.encode(), ADDRESS)
        for fd in fds:
            os.close(fd)
""")

# Run under spawn: prints name=content for each fd sd_listen_fds would hand it.
READER = textwrap.dedent("""
    import os
    count = int(os.environ["LISTEN_FDS"])
    names = os.environ["LISTEN_FDNAMES"].split(":")
    assert os.environ["LISTEN_PID"] == str(os.getpid()), (os.environ["LISTEN_PID"], os.getpid())
    assert len(names) == count, (names, count)
    for index, name in enumerate(names):
        print(f"{name}={os.pread(3 + index, 100, 0).decode()}")
""")


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(dir="/tmp", prefix="fdstore-")
    yield path
    shutil.rmtree(path)


def run_sender(store: FdStore, body: str) -> None:
    env = {**os.environ, **store.env()}
    subprocess.run([sys.executable, "-c", SENDER + textwrap.dedent(body)], env=env, check=True, timeout=TIMEOUT)


def open_memfds(prefix: str) -> list[str]:
    """This process's open fds that are memfds named ``prefix...`` (readlink of /proc/self/fd)."""
    found = []
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except FileNotFoundError:  # the listing's own fd, closed by now
            continue
        if target.startswith(f"/memfd:{prefix}"):
            found.append(target)
    return found


def spawn_reader(store: FdStore) -> str:
    proc = store.spawn([sys.executable, "-c", READER], env=dict(os.environ),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def test_stored_fds_reach_the_restarted_process_at_3_and_up(workdir):
    with FdStore(workdir) as store:
        run_sender(store, """
            send("FDSTORE=1\\nFDNAME=seg-0", {"t1-seg": b"segment zero"})
            send("FDSTORE=1\\nFDNAME=journal", {"t1-journal": b"journal bytes"})
            send("READY=1\\nSTATUS=serving")
        """)
        assert store.ready.wait(TIMEOUT), store.messages
        assert store.names() == ["seg-0", "journal"]
        assert {"READY": "1", "STATUS": "serving"} in store.messages
        assert spawn_reader(store) == "seg-0=segment zero\njournal=journal bytes\n"
        assert store.names() == ["seg-0", "journal"]  # a restart hands out copies; the store keeps its own


def test_fds_keep_arrival_order_under_a_shared_name(workdir):
    with FdStore(workdir) as store:
        run_sender(store, """
            send("FDSTORE=1\\nFDNAME=seg", {"t2-a": b"a", "t2-b": b"b"})
            send("FDSTORE=1", {"t2-c": b"c"})
            send("FDSTORE=1\\nFDNAME=seg", {"t2-d": b"d"})
            send("READY=1")
        """)
        assert store.ready.wait(TIMEOUT), store.messages
        assert store.names() == ["seg", "seg", "stored", "seg"]
        assert spawn_reader(store) == "seg=a\nseg=b\nstored=c\nseg=d\n"


def test_fdstoreremove_closes_and_forgets_every_fd_of_the_name(workdir):
    with FdStore(workdir) as store:
        run_sender(store, """
            send("FDSTORE=1\\nFDNAME=seg-0", {"t3-seg0-a": b"x", "t3-seg0-b": b"y"})
            send("FDSTORE=1\\nFDNAME=journal", {"t3-journal": b"j"})
            send("FDSTOREREMOVE=1\\nFDNAME=seg-0")
            send("READY=1")
        """)
        assert store.ready.wait(TIMEOUT), store.messages
        assert store.names() == ["journal"]
        assert open_memfds("t3-seg0") == []
        assert len(open_memfds("t3-journal")) == 1
        assert spawn_reader(store) == "journal=j\n"


def test_fds_past_max_fds_are_refused_and_counted(workdir):
    with FdStore(workdir, max_fds=2) as store:
        run_sender(store, """
            send("FDSTORE=1\\nFDNAME=seg", {"t4-a": b"a", "t4-b": b"b", "t4-c": b"c"})
            send("FDSTORE=1\\nFDNAME=late", {"t4-d": b"d"})
            send("READY=1")
        """)
        assert store.ready.wait(TIMEOUT), store.messages
        assert store.names() == ["seg", "seg"]
        assert store.refused == 2
        assert sorted(open_memfds("t4-")) == ["/memfd:t4-a (deleted)", "/memfd:t4-b (deleted)"]


def test_fds_without_fdstore_are_closed_not_kept(workdir):
    with FdStore(workdir) as store:
        run_sender(store, """
            send("FDNAME=seg-0", {"t5-stray": b"s"})
            send("STATUS=starting", {"t5-other": b"o"})
            send("READY=1")
        """)
        assert store.ready.wait(TIMEOUT), store.messages
        assert store.names() == []
        assert open_memfds("t5-") == []
        assert store.messages == [{"FDNAME": "seg-0"}, {"STATUS": "starting"}, {"READY": "1"}]


def test_spawn_with_an_empty_store_passes_no_listen_variables(workdir):
    with FdStore(workdir) as store:
        env = {**os.environ, "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b", "LISTEN_PID": "1"}
        proc = store.spawn([sys.executable, "-c", "import os; print(sorted(k for k in os.environ "
                            "if k.startswith(('LISTEN_', 'NOTIFY_'))), os.environ['NOTIFY_SOCKET'])"],
                           env=env, stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0
        assert out.decode() == f"['NOTIFY_SOCKET'] {store.socket_path}\n"


def test_exec_entry_point_moves_fds_that_sit_on_each_others_targets(workdir):
    """fds already at 3 and 4 but swapped in store order: 4 must reach 3 and 3 reach 4, neither clobbered."""
    first, second = os.memfd_create("t7-first"), os.memfd_create("t7-second")
    try:
        os.write(first, b"first")
        os.write(second, b"second")
        inner = [sys.executable, str(FD_STORE_PY), "exec", "--fds", "4,3", "--names", "second:first",
                 "--", sys.executable, "-c", READER]
        assert min(first, second) > 4
        to_3_and_4 = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
                      "os.execv(sys.argv[3], sys.argv[3:])")
        proc = subprocess.run([sys.executable, "-c", to_3_and_4, str(first), str(second), *inner],
                              pass_fds=[first, second], capture_output=True, timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout.decode() == "second=second\nfirst=first\n"
    finally:
        os.close(first)
        os.close(second)


def test_close_stops_the_reader_closes_kept_fds_and_unlinks_the_socket(workdir):
    store = FdStore(workdir)
    run_sender(store, """
        send("FDSTORE=1\\nFDNAME=seg-0", {"t8-seg": b"x"})
        send("READY=1")
    """)
    store.wait_for(lambda s: s.ready.is_set(), TIMEOUT)
    assert len(open_memfds("t8-")) == 1
    store.close()
    assert open_memfds("t8-") == []
    assert not os.path.exists(store.socket_path)


def test_wait_for_times_out_with_what_was_received(workdir):
    with FdStore(workdir) as store:
        run_sender(store, 'send("STATUS=warming up")')
        with pytest.raises(TimeoutError, match="warming up"):
            store.wait_for(lambda s: s.ready.is_set(), 0.3)


def test_a_restarted_process_storing_its_inherited_fds_again_adds_no_duplicates(workdir):
    """As systemd's same_fd check: the fd at 3 after a restart is the kept open file, so it is not kept twice."""
    with FdStore(workdir) as store:
        run_sender(store, 'send("FDSTORE=1\\nFDNAME=seg-0", {"t10-seg": b"x"})')
        store.wait_for(lambda s: s.names() == ["seg-0"], TIMEOUT)
        restore = SENDER + textwrap.dedent("""
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(ADDRESS)
                socket.send_fds(sock, [b"FDSTORE=1\\nFDNAME=seg-0"], [3], 0, ADDRESS)
            send("READY=1")
        """)
        proc = store.spawn([sys.executable, "-c", restore], env=dict(os.environ), stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err.decode()
        assert store.ready.wait(TIMEOUT), store.messages
        assert store.names() == ["seg-0"]
        assert store.duplicates == 1


def test_an_fdname_systemd_rejects_stores_under_the_default_name(workdir):
    with FdStore(workdir) as store:
        run_sender(store, """
            send("FDSTORE=1\\nFDNAME=has:colon", {"t11-a": b"a"})
            send("READY=1")
        """)
        assert store.ready.wait(TIMEOUT), store.messages
        assert store.names() == ["stored"]
