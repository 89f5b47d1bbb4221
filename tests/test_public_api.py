"""What the README and the packages' ``__all__`` promise a user imports: each name resolves, each import in
the README's Python snippets runs, and each ``offload.<name>`` those snippets call exists."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)

DOCUMENTED = [  # (module, name): the entry points the README and DESIGN.md name
    ("offload", "initialize"), ("offload", "init_context"), ("offload", "load_pretrained"), ("offload", "Engine"),
    ("offload", "OffloadError"), ("offload", "ConfigError"), ("offload", "read_config"),
    ("offload.config", "read_config"), ("offload.config", "EngineConfig"), ("offload.checkpoint", "consolidate"),
    ("offload.cli", "main"), ("offload.plan.estimate", "estimate"), ("offload.plan.memory", "plan_optimizer"),
    ("cpu_adam", "CPUAdam"), ("cpu_adam", "CPUAdamW"), ("cpu_adam", "adam_step"),
    ("swap", "TierStore"), ("daemon", "TierClient"), ("daemon", "TierClientConfig"),
]


@pytest.mark.parametrize("module,name", DOCUMENTED, ids=[f"{m}.{n}" for m, n in DOCUMENTED])
def test_a_documented_name_resolves(module, name):
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("module", ["offload", "offload.config", "offload.checkpoint", "offload.cli", "cpu_adam",
                                    "swap", "daemon"])
def test_every_name_in_all_resolves(module):
    mod = importlib.import_module(module)
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ names what it does not have: {missing}"


def test_the_readmes_imports_run():
    lines = sorted({line.strip() for block in SNIPPETS for line in block.splitlines()
                    if re.match(r"\s*(import|from) \w", line)})
    assert any(line == "import offload" for line in lines) and any("cpu_adam" in line for line in lines)
    for line in lines:
        if line.startswith("from transformers"):
            pytest.importorskip("transformers")
        exec(line, {})  # noqa: S102 (the README's own import lines)


def test_every_offload_call_in_the_readme_exists():
    import offload

    called = {m for block in SNIPPETS for m in re.findall(r"\boffload\.(\w+)\(", block)}
    assert {"initialize", "init_context"} <= called
    assert not [name for name in called if not hasattr(offload, name)]
