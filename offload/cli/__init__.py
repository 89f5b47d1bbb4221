"""The ``offload`` command and what only it uses: ``main`` parses it (``demo``, ``info``, ``daemon``,
``status``, ``estimate``, ``consolidate``), ``demo`` is the main job, ``estimate`` the estimate's
flags and report, ``termplot`` the loss curve in text. ``python -m offload.cli`` runs it too."""
from offload.cli.main import format_status, main

__all__ = ["format_status", "main"]
