"""The package's imports only go down: no module imports one that imports it back, counting
imports inside functions too (a lazy import hides a circle, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "gptflow"


def module_graph(root: Path = SRC) -> dict[str, set[str]]:
    """{module: the gptflow modules it imports}, from every import statement of every file."""
    mods = {
        ".".join(("gptflow", *p.relative_to(root).with_suffix("").parts)).removesuffix(
            ".__init__"
        ): p
        for p in root.rglob("*.py")
    }
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = next((c for c in (f"{base}.{alias.name}", base) if c in mods), None)
                    if target and target != m:
                        edges[m].add(target)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
            elif (name := imported_by_name(node)) in mods and name != m:
                edges[m].add(name)  # importlib.import_module("gptflow.x"): an import all the same
    return edges


def imported_by_name(node: ast.AST) -> str | None:
    """The module of an ``importlib.import_module("...")`` (or ``__import__``) call with a
    literal name, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    f, name = node.func, node.args[0]
    called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    if called not in ("import_module", "__import__") or not isinstance(name, ast.Constant):
        return None
    return name.value if isinstance(name.value, str) else None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of the graph, once, as the path that closes it (Tarjan's strongly
    connected components; a component of more than one module is a circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    edges = module_graph()
    assert "gptflow.config.settings" in edges
    assert "gptflow.train.run_config" in edges["gptflow.cli.train"]
    assert cycles(edges) == []


def test_a_circle_is_found(tmp_path):
    """The walk itself: a circle made of a module-level and a function-level import."""
    pkg = tmp_path / "gptflow"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from gptflow.data.shards import g\n")
    (pkg / "data" / "shards.py").write_text("from gptflow.config import f\n")
    (pkg / "model.py").write_text("from . import config\n")
    assert cycles(module_graph(pkg)) == [["gptflow.config", "gptflow.data.shards"]]
    # a module __getattr__ forwarding names through importlib is an import too
    (pkg / "export.py").write_text(
        "import importlib\n\n\ndef __getattr__(name):\n"
        "    return getattr(importlib.import_module('gptflow.evaluate'), name)\n"
    )
    (pkg / "evaluate.py").write_text("def f():\n    from gptflow.export import g\n")
    assert cycles(module_graph(pkg)) == [
        ["gptflow.config", "gptflow.data.shards"],
        ["gptflow.evaluate", "gptflow.export"],
    ]


def test_the_token_dtype_threshold_has_one_home(tmp_path):
    """uint16 below 65,500 token ids (Megatron's rule), int32 from there: the shard writer,
    the run config's record and the preflight's shard size all ask gptflow.data.indexed."""
    import numpy as np

    from gptflow.data.indexed import dtype_for_vocab
    from gptflow.data.sources import Dataset, Shard
    from gptflow.plan import run_size

    (tmp_path / "a.jsonl").write_bytes(b"x" * 400)  # 100 tokens at 4 bytes of text a token
    one = {"d": Dataset("d", "files", (Shard("00000", str(tmp_path / "a.jsonl"), "jsonl"),))}
    for vocab, dtype in ((65_499, np.uint16), (65_500, np.int32), (65_536, np.int32)):
        assert dtype_for_vocab(vocab) == np.dtype(dtype), vocab
        assert run_size.token_bytes(one, vocab) == (100 * np.dtype(dtype).itemsize, 0)
