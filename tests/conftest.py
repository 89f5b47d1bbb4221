"""Shared test settings: GPU tests are marked ``cuda`` and skip without a GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; none here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class _FileProgress:
    """With ``--file-progress`` (tools/test.sh passes it): a line as each test file starts, with the time
    since the run began and how far through the tests it is, so a long quiet run can be followed."""

    def __init__(self, config) -> None:
        import time

        self._clock = time.monotonic
        self._start = self._clock()
        self._config = config
        self._file = None
        self._done = 0
        self._total = 0

    def pytest_collection_finish(self, session) -> None:
        self._total = len(session.items)

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        path = nodeid.split("::", 1)[0]
        if path != self._file:
            self._file = path
            minutes, seconds = divmod(int(self._clock() - self._start), 60)
            reporter = self._config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                if getattr(reporter._tw, "width_of_current_line", 1):  # after this file's dots
                    reporter.write("\n")
                reporter.write_line(f"[{minutes:3d}:{seconds:02d} {self._done}/{self._total}] {path}")
        self._done += 1


def pytest_addoption(parser):
    parser.addoption("--file-progress", action="store_true",
                     help="a line per test file as it starts: elapsed time, tests run of all, the file")


def pytest_configure(config):
    if config.getoption("file_progress"):
        config.pluginmanager.register(_FileProgress(config), "file-progress")
