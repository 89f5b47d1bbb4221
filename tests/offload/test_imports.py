"""The package's modules import one way: no two modules import each other, directly or round a
longer circle (an import inside a function counts: it is the same dependency, only later). So do the
scripts in tools/bench among themselves."""
from __future__ import annotations

import ast
import pathlib

import offload

ROOT = pathlib.Path(offload.__file__).parent
BENCH = ROOT.parent / "tools" / "bench"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, names: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, wherever in the file the import sits."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in out if name in names and name != me}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    names = set(paths)
    # the package's __init__ loads its names lazily (offload.__getattr__): it is where users come in, not a room
    return {name: _imports(path, names) - {"offload"} for name, path in paths.items()}


def _bench_graph() -> dict[str, set[str]]:
    """tools/bench's scripts by file stem: they put tools/bench on sys.path and import each other as
    top-level modules (``tools.bench.x``, imported from the project root, is the same script x)."""
    stems = {path.stem for path in BENCH.glob("*.py")}
    names = stems | {f"tools.bench.{stem}" for stem in stems}
    return {path.stem: {name.removeprefix("tools.bench.") for name in _imports(path, names)} - {path.stem}
            for path in BENCH.glob("*.py")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = _graph()
    assert "offload.checkpoint.dcp" in graph["offload.engine"]  # imported inside save_checkpoint
    assert "offload.cli.demo" in graph["offload.cli.main"]


def test_no_import_circles():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_bench_graph_sees_the_benches_imports():
    graph = _bench_graph()
    assert "step_common" in graph["bench_step"]
    assert "step_stage3" in graph["bench_step"]  # imported inside main
    assert "bench_adam" in graph["bench_bf16_params"]  # as tools.bench.bench_adam


def test_no_import_circles_among_the_benches():
    cycle = _cycle(_bench_graph())
    assert cycle is None, "import circle in tools/bench: " + " -> ".join(cycle)
