"""The swap package's own TierStore tests, unchanged, against TierClient with the daemon in another process.

Every test of ``tests/swap/test_store.py`` that receives its store from the ``store``
fixture is collected here again, with ``store`` redefined below: a ``TierClient``
session on a daemon process serving the real TierStore, configured as that suite's
fixture configures its local store (160 MiB host, 192 MiB swap in 1 or 3 paths with
256 KiB stripes, 1 MiB chunks), over each engine kind that suite runs. The suite's other tests build
stores from parts (their own engine, pool and space) and have no TierClient form.
"""
from __future__ import annotations

import inspect
import itertools
import os
import shutil

import pytest

from tests.daemon.conftest import STORE, start_daemon

if STORE != "swap":
    pytest.skip("the swap layer is not installed: no real TierStore to serve", allow_module_level=True)

from daemon.client import TierClient, TierClientConfig  # noqa: E402
from tests.swap import conftest as suite_conftest  # noqa: E402
from tests.swap import test_store as suite  # noqa: E402

REUSED = [name for name, fn in vars(suite).items()
          if name.startswith("test_") and callable(fn) and list(inspect.signature(fn).parameters) == ["store"]]
globals().update({name: getattr(suite, name) for name in REUSED})
_jobs = itertools.count()


_KINDS = tuple(getattr(suite_conftest, "ENGINE_KINDS", ("linux_aio", "threads")))


@pytest.fixture(scope="module", params=[(k, n) for k in _KINDS for n in (1, 3)],
                ids=[f"{k}-{'one_path' if n == 1 else 'striped_3'}" for k in _KINDS for n in (1, 3)])
def suite_daemon(request):
    kind, npaths = request.param
    d = start_daemon(
        pool={"capacity_bytes": 160 << 20, "segment_bytes": 160 << 20},
        sessions={"default_quota_bytes": 160 << 20},
        io={"kind": kind, "block_size_bytes": 256 << 10, "queue_depth": 8, "num_threads": 2},
        store={"chunk_bytes": 1 << 20},
        swap_paths=npaths,
        swap={"capacity_bytes": 192 << 20, "stripe_bytes": 256 << 10},
    )
    yield d
    d.stop()
    shutil.rmtree(d.workdir, ignore_errors=True)


@pytest.fixture
def store(suite_daemon):
    c = TierClient(TierClientConfig(socket_path=suite_daemon.socket_path, job_id=f"suite-{os.getpid()}",
                                    rank=next(_jobs), timeout_seconds=60))
    yield c
    c.close()


def test_the_suite_was_found():
    assert len(REUSED) >= 7, REUSED
