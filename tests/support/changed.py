"""The test files that cover what a change touches, for the loop between commits
(`make test-changed`; `make test` stays the whole suite).

    python -m tests.support.changed [BASE]     # BASE: a revision, default HEAD

The changed files are those of ``git diff BASE`` and the untracked ones. Each maps to tests:

- a test file: itself; a support module or a conftest: the tests that import it (a conftest:
  every test file beside and below it);
- a package module ``gptflow.x.y``: the test files that name it (an import, or a probe script's
  import in a string), and those naming a module that imports it directly (one level up: a
  change to ``gptflow.config.settings`` selects what names ``gptflow.train.engine``, not the whole suite);
- a rule file, the Snakefile, a profile, a script of ``workflow/``, the schema, an example, the
  README, a benchmark: the test files that name it (``setup.smk``, ``profiles/pbs``,
  ``config.schema.yaml``, ...), and for the rules the workflow's own pipeline test;
- a page of the documentation (``*.md``, ``docs/conf.py``): ``tests/unit/test_docs.py``.

Workflow tests that run the whole pipeline through Snakemake exercise every module without
naming it; a change to the package selects only the tests that name what changed. That is the
quick loop's bargain: the whole suite is `make test`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
TESTS = REPO / "tests"
IMPORT = re.compile(
    r"(?:from|import)\s+(gptflow(?:\.\w+)*)(?:[ \t]+import[ \t]+(\([^)]*\)|[\w, \t]+))?"
)
# what runs every rule: a change to the rules selects it besides the tests naming the file
RULE_TESTS = ["tests/unit/test_rules_quoting.py", "tests/workflow/test_pipeline.py"]
# what builds the documentation site and holds its pages to the code: a changed page selects it
DOCS_TEST = "tests/unit/test_docs.py"


def changed_files(base: str) -> list[str]:
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
        return [line for line in out.stdout.splitlines() if line]

    return sorted(set(git("diff", "--name-only", base)) | set(git("ls-files", "--others",
                                                                  "--exclude-standard")))  # fmt: skip


def package_modules() -> dict[str, set[str]]:
    """{gptflow module: the gptflow modules that import it directly}."""
    from tests.unit.test_imports import module_graph

    importers: dict[str, set[str]] = {}
    for module, imports in module_graph().items():
        importers.setdefault(module, set())
        for target in imports:
            importers.setdefault(target, set()).add(module)
    return importers


def named_modules(text: str, known: set[str]) -> set[str]:
    """The gptflow modules a test file's text imports, its probe scripts' strings included:
    ``import gptflow.x``, ``from gptflow.x import y`` (y a module, or a name of x)."""
    found = set()
    for m in IMPORT.finditer(text):
        base, names = m[1], m[2] or ""
        if base in known:
            found.add(base)
        for name in re.findall(r"\w+", names):
            if f"{base}.{name}" in known:
                found.add(f"{base}.{name}")
    return found


def test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def module_of(path: str) -> str | None:
    p = Path(path)
    if p.parts[:2] != ("src", "gptflow") or p.suffix != ".py":
        return None
    return ".".join(p.relative_to("src").with_suffix("").parts).removesuffix(".__init__")


def select(changed: list[str]) -> list[str]:
    importers = package_modules()
    known = set(importers)
    texts = {f: f.read_text() for f in test_files()}
    chosen: set[str] = set()

    def naming(needle: str) -> set[str]:
        return {str(f.relative_to(REPO)) for f, t in texts.items() if needle in t}

    for path in changed:
        p = Path(path)
        if p.parts[:1] == ("tests",):
            if p.name.startswith("test_") and p.suffix == ".py" and (REPO / p).exists():
                chosen.add(path)
            elif p.name == "conftest.py":
                chosen |= {str(f.relative_to(REPO)) for f in texts
                           if f.is_relative_to(REPO / p.parent)}  # fmt: skip
            elif p.suffix == ".py":
                chosen |= naming(".".join(p.with_suffix("").parts))
            continue
        module = module_of(path)
        if module is not None:
            wanted = {module} | importers.get(module, set())
            chosen |= {str(f.relative_to(REPO)) for f, t in texts.items()
                       if named_modules(t, known) & wanted}  # fmt: skip
            continue
        needles = [p.name if p.parts[:1] in (("rules",), ("bench",), ("workflow",)) else path]
        if p.parts[:1] == ("profiles",):
            needles = ["/".join(p.parts[:2])]  # profiles/pbs
        if p.parts[:1] == ("config",):  # a directory read whole: config/examples/layouts
            needles += [str(p.parent), " / ".join(f'"{part}"' for part in p.parent.parts)]
        for needle in needles:
            chosen |= naming(needle)
        if p.parts[:1] == ("rules",) or path == "Snakefile":
            chosen |= set(RULE_TESTS)
        if p.suffix == ".md" or path == "docs/conf.py":  # a page of the documentation site
            chosen.add(DOCS_TEST)
    return sorted(chosen)


def main(argv: list[str]) -> int:
    base = argv[0] if argv else "HEAD"
    for test in select(changed_files(base)):
        print(test)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
