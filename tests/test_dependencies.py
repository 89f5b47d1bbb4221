"""Every dependency pyproject.toml declares for the package is imported by the package (a declared
dependency nothing imports is installed for nothing); the test extra holds what only the tests import."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imported_top_levels(packages: list[str]) -> set[str]:
    names: set[str] = set()
    for package in {p.split(".")[0] for p in packages}:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


def _distributions(names: set[str]) -> set[str]:
    """The installed distributions that provide these top-level modules, normalized."""
    providers = importlib.metadata.packages_distributions()
    return {re.sub(r"[-_.]+", "-", dist).lower() for name in names for dist in providers.get(name, [])}


def _requirement_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def test_every_declared_dependency_is_imported_by_the_package():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = {_requirement_name(r) for r in project["project"]["dependencies"]}
    imported = _distributions(_imported_top_levels(project["tool"]["setuptools"]["packages"]))
    assert declared - imported == set(), f"declared but imported by no module of the package: {declared - imported}"


def test_what_only_the_tests_import_is_in_the_test_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    core = {_requirement_name(r) for r in project["project"]["dependencies"]}
    test_extra = {_requirement_name(r) for r in project["project"]["optional-dependencies"]["test"]}
    package = _distributions(_imported_top_levels(project["tool"]["setuptools"]["packages"]))
    tests_only = _distributions(_imported_top_levels(["tests"])) - package
    third_party = tests_only - {"tiered-offload"}
    missing = {d for d in third_party if d not in core | test_extra | {"triton"}}
    assert missing == set(), f"imported by the tests, declared nowhere: {missing}"
