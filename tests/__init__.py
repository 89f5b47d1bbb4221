import os


def child_pythonpath(root) -> str:
    """PYTHONPATH for a child process: the repo first, then whatever the caller's already held
    (a GPU machine's wheels installed with --target live there)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
