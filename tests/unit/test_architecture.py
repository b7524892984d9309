"""docs/architecture.md tells the truth: its layer table lists every module of the package
once, and every import (lazy ones included) points to a module of a lower layer; the rules and
subcommands it names exist; a renamed module's old name is an alias that nothing uses."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_imports import module_graph

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = {"gptflow", "gptflow.data", "gptflow.train"}  # their __init__ re-export nothing else


def layers() -> dict[str, int]:
    """{module: layer} from the table between the doc's layer markers."""
    text = DOC.read_text()
    table = text.split("<!-- layers")[1].split("<!-- /layers -->")[0]
    found: dict[str, int] = {}
    for layer, cells in re.findall(r"^\| (\d+) \| (.+) \|$", table, re.M):
        for name in re.findall(r"`([a-z_.]+)`", cells):
            assert name not in found, f"{name} is listed twice"
            found[f"gptflow.{name}"] = int(layer)
    return found


def aliases() -> dict[str, set[str]]:
    """{old module: the modules it is now} from the table between the doc's alias markers."""
    text = DOC.read_text()
    table = text.split("<!-- aliases")[1].split("<!-- /aliases -->")[0]
    found: dict[str, set[str]] = {}
    for old, new in re.findall(r"^\| `([a-z_.]+)` \| (.+) \|$", table, re.M):
        found[f"gptflow.{old}"] = {f"gptflow.{n}" for n in re.findall(r"`([a-z_.]+)`", new)}
    return found


def test_every_module_is_in_the_layer_table():
    modules = set(module_graph()) - {"gptflow.__main__"} - set(aliases())
    listed = set(layers())
    assert listed - modules == set(), "listed but not in src/gptflow"
    assert modules - PACKAGES - listed == set(), "in src/gptflow but not in the table"


def test_imports_only_go_down_the_layer_table():
    level = layers()
    level.update({"gptflow.data": -1, "gptflow": -1})  # empty package files
    upward = [
        f"{m} (layer {level[m]}) imports {d} (layer {level[d]})"
        for m, deps in module_graph().items()
        if m in level
        for d in deps
        if d in level and level[d] >= level[m]
    ]
    assert upward == []


def test_the_rules_and_commands_it_names_exist():
    text = DOC.read_text()
    rules = "\n".join(p.read_text() for p in (REPO / "rules").glob("*.smk"))
    defined = set(re.findall(r"^\s*(?:rule|checkpoint) (\w+):", rules, re.M))
    defined |= set(re.findall(r"^use rule \w+ as (\w+)", rules, re.M))
    stage_table = text.split("## The stages")[1].split("##")[0]
    named = {r for r in re.findall(r"`([a-z_0-9]+)`", stage_table) if "_" in r}
    modules = {m.split(".")[-1] for m in module_graph()}
    assert named - defined - modules == set()
    from gptflow.cli import COMMANDS

    commands = {c.name for c in COMMANDS}
    shown = set(re.findall(r"`gptflow ([a-z-]+)", text))
    shown |= {w for cell in re.findall(r"`gptflow [a-z-]+`((?:, `[a-z-]+`)+)", text)
              for w in re.findall(r"`([a-z-]+)`", cell)}  # fmt: skip
    assert shown - commands == set()


def test_a_module_over_500_lines_says_why_and_none_is_over_700():
    """A module reads as one room: at most 700 lines, and one over 500 says why in its
    docstring (``Over 500 lines: ...``), so that the next addition starts a module of its own
    instead of growing it unnoticed."""
    import ast

    long, unexplained = [], []
    for path in sorted((REPO / "src" / "gptflow").rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        name = str(path.relative_to(REPO))
        if lines > 700:
            long.append(f"{name}: {lines} lines")
        elif lines > 500 and "Over 500 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{name}: {lines} lines")
    assert long == [] and unexplained == []


def test_a_function_over_80_lines_says_why():
    """A function reads on one screen; a longer one carries a comment ``# Over 80 lines ...``
    saying why (the manifest's literal fields, for one)."""
    import ast

    long = []
    for path in sorted((REPO / "src" / "gptflow").rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = lines[node.lineno - 1 : node.end_lineno]
                if len(body) > 80 and not any("# Over 80 lines" in b for b in body):
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} {len(body)}")
    assert long == []


def test_an_old_module_name_is_an_alias_that_nothing_uses():
    """A renamed module's old name imports the new one (all its public names, and the names
    that changed) and warns; nothing in the package, the rules, the scripts, the benchmarks or
    the tests imports it."""
    import importlib
    import sys
    import warnings

    graph = module_graph()
    old = aliases()
    assert old and set(old) <= set(graph), "an alias the table lists is not in src/gptflow"
    for alias, now in old.items():
        assert graph[alias] == now, alias
        assert not set(layers()) & {alias}, f"{alias} is in the layer table"
        users = [m for m, deps in graph.items() if alias in deps]
        assert users == [], f"{alias} is imported by {users}"
        sys.modules.pop(alias, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(alias)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught), alias
        for new in now:
            names = vars(importlib.import_module(new))
            public = set(names.get("__all__") or (n for n in names if not n.startswith("_")))
            assert public <= set(vars(module)), (alias, new)
    text = "\n".join(
        p.read_text()
        for d in ("src", "rules", "workflow", "bench", "tests")
        for p in (REPO / d).rglob("*")
        if p.suffix in (".py", ".smk") and p.resolve() != Path(__file__).resolve()
        and not any(p.match(f"src/gptflow/{a.removeprefix('gptflow.').replace('.', '/')}.py")
                    for a in old)
    )  # fmt: skip
    for alias in old:
        package, name = alias.rsplit(".", 1)
        assert not re.search(
            rf"\b{re.escape(alias)}\b|from {re.escape(package)} import [^\n]*\b{name}\b", text
        ), alias
