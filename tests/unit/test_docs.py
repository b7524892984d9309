"""The documentation: README.md, CHANGELOG.md, docs/*.md, config/README.md and
profiles/README.md.

- The site builds strictly (`make docs`: Sphinx + MyST, every warning an error), and the
  strictness is real: a broken link or anchor, and a page in no table of contents, each fail a
  build of a copy of the pages.
- What the pages name exists: every config key (backticked `section.key`, and the keys of
  every ```yaml block made of config sections) in config/schema/config.schema.yaml; every
  `gptflow` subcommand shown, with every flag shown for it in its `--help`; every `snakemake`
  flag in `snakemake --help`, every target a rule; every `make` target in the Makefile; every
  repository path and `gptflow.` module.
- The README is short (at most 250 lines) and is the package's long description.

The site is built once per module (about 10 s); the key, command and path checks read the
Markdown only, and `--help` runs in this process through the CLI's own entry point.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "config" / "README.md",
     REPO / "profiles" / "README.md", *(REPO / "docs").glob("*.md")]
)  # fmt: skip
SCHEMA = yaml.safe_load((REPO / "config" / "schema" / "config.schema.yaml").read_text())
SECTIONS = set(SCHEMA["properties"])
FENCE = re.compile(r"^(`{3,})([^\n`]*)\n(.*?)^\1[ \t]*$", re.M | re.S)
# file names, not keys: `eval.json`, `train.log`, `run.yaml`, `model.safetensors`
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "log", "lock", "html", "svg", "npy", "bin",
                 "idx", "txt", "md", "py", "sqsh", "sif", "safetensors", "id", "smk"}  # fmt: skip


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def sphinx_build(source: Path, out: Path, builder: str = "html") -> subprocess.CompletedProcess:
    """`make docs`'s build of the pages under `source` (a repository or a copy of its pages)."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-c",
         str(source / "docs"), "-b", builder, str(source), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def warnings(build: subprocess.CompletedProcess) -> list[str]:
    return [line for line in build.stderr.splitlines() if "WARNING" in line or "ERROR" in line]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    return out, sphinx_build(REPO, out)


def test_the_site_builds_strictly(site):
    out, build = site
    assert build.returncode == 0, build.stderr[-4000:]
    assert not warnings(build), warnings(build)
    for page in PAGES:
        assert (out / rel(page)).with_suffix(".html").is_file(), rel(page)


def test_makefile_docs_target_is_the_tested_build():
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^docs: ", make, re.M)
    assert "sphinx-build -W --keep-going -n -q -c docs -b html ." in make


def copy_of_the_pages(tmp_path: Path) -> Path:
    """The pages and what they link to (config/, profiles/), with docs/conf.py: enough to build."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(REPO / "README.md", copy)
    shutil.copy(REPO / "CHANGELOG.md", copy)
    for folder in ("docs", "config", "profiles"):
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("_build"))
    return copy


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    copy = copy_of_the_pages(tmp_path)
    page = copy / "docs" / "cli.md"
    page.write_text(
        page.read_text() + "\n[gone](no-such-page.md) and [moved](data.md#no-such-heading)\n"
    )
    build = sphinx_build(copy, tmp_path / "out", "dummy")
    assert build.returncode != 0
    found = warnings(build)
    assert any("no-such-page.md" in w for w in found), found
    assert any("no-such-heading" in w for w in found), found
    assert len(found) == 2, found  # the copy itself builds clean


def test_an_orphan_page_fails_the_build(tmp_path):
    copy = copy_of_the_pages(tmp_path)
    (copy / "docs" / "orphan.md").write_text("# A page no table of contents lists\n")
    build = sphinx_build(copy, tmp_path / "out", "dummy")
    assert build.returncode != 0
    found = warnings(build)
    assert len(found) == 1 and "orphan.md" in found[0] and "toctree" in found[0], found


def test_the_front_page_lists_every_page_of_its_tables_of_contents():
    """docs/index.md's Markdown list (what a code host shows) and its {toctree} (the site's
    navigation) name the same pages."""
    index = (REPO / "docs" / "index.md").read_text()
    trees = re.findall(r"^```\{toctree\}\n(.*?)^```", index, re.M | re.S)
    entries = {line.strip() for tree in trees for line in tree.splitlines()
               if line.strip() and not line.startswith(":")}  # fmt: skip
    listed = set(re.findall(r"^- \[[^]]+\]\(([^)#]+)\.md\)", index, re.M))
    assert entries - {"../README"} == listed, entries ^ listed
    assert {rel(p) for p in PAGES} == {
        str(Path("docs", e).with_suffix(".md")).replace("docs/../", "") for e in entries
    } | {"docs/index.md"}


# --------------------------------------------------------------------------- config keys


def resolve(node: dict) -> dict:
    while isinstance(node, dict) and "$ref" in node and len(node) == 1:
        node = ref(node["$ref"])
    return node


def ref(pointer: str) -> dict:
    node = SCHEMA
    for part in pointer.removeprefix("#/").split("/"):
        node = node[part]
    return node


def branches(node: dict, instance=None) -> list[dict]:
    """`node` and every subschema that may apply to `instance` (None: any instance):
    $ref, allOf, anyOf, oneOf, and if/then/else decided on the instance where there is one."""
    node = resolve(node)
    if not isinstance(node, dict):
        return []
    found = [node]
    if "$ref" in node:
        found += branches(ref(node["$ref"]), instance)
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in node.get(key, []):
            found += branches(sub, instance)
    if "if" in node:
        applies = None if instance is None else jsonschema.Draft202012Validator(
            node["if"]).is_valid(instance)  # fmt: skip
        for key, wanted in (("then", True), ("else", False)):
            if key in node and applies in (None, wanted):
                found += branches(node[key], instance)
    return found


def children(node: dict, key: str, instance=None) -> list[dict] | None:
    """The schemas of `key` inside `node`: [] when the key is allowed but not described
    (an open object), None when the schema refuses it."""
    found, closed, open_ = [], False, False
    for b in branches(node, instance):
        if key in b.get("properties", {}):
            found.append(b["properties"][key])
        for pattern, sub in b.get("patternProperties", {}).items():
            if re.search(pattern, key):
                found.append(sub)
        extra = b.get("additionalProperties")
        if isinstance(extra, dict):
            found.append(extra)
        elif extra is False or b.get("unevaluatedProperties") is False:
            closed = True
        elif b.get("type") == "object" and "properties" not in b and extra is None:
            open_ = True
    if found:
        return found
    return [] if open_ or not closed else None


def unknown_keys(node: dict, instance, path: tuple) -> list[str]:
    """The keys of `instance` (a parsed YAML block) the schema does not know, by dotted path."""
    if isinstance(instance, list):
        items = [b["items"] for b in branches(node) if isinstance(b.get("items"), dict)]
        return [bad for value in instance for sub in items
                for bad in unknown_keys(sub, value, path)]  # fmt: skip
    if not isinstance(instance, dict):
        return []
    bad = []
    for key, value in instance.items():
        if key == "...":  # an elided part of an example
            continue
        here = (*path, str(key))
        if path[:1] == ("study",) and len(path) == 3 and path[1] == "runs" and key in SECTIONS:
            subs = [SCHEMA["properties"][key]]  # a study run's override of a config section
        else:
            subs = children(node, str(key), instance)
        if subs is None:
            bad.append(".".join(here))
            continue
        if path == ("study",) and key == "grid" and isinstance(value, dict):
            bad += [k for k in value if not key_exists(k)]  # grid keys are dotted config keys
            continue
        errors = [unknown_keys(sub, value, here) for sub in subs]
        if errors and all(errors):
            bad += errors[0]
    return bad


def key_exists(dotted: str) -> bool:
    node: list[dict] = [SCHEMA]
    for part in dotted.split("."):
        nxt = []
        for n in node:
            subs = children(n, part)
            if subs is None:
                continue
            nxt += subs or [{}]
        if not nxt:
            return False
        node = nxt
    return True


def is_module(dotted: str) -> bool:
    """`data.quality.filters` in a page is gptflow's module, not a config key."""
    base = REPO / "src" / "gptflow" / Path(*dotted.split("."))
    return base.with_suffix(".py").is_file() or base.is_dir()


def named_keys(text: str) -> set[str]:
    """Backticked dotted names whose first part is a config section: `train.lr`,
    `eval.harness.tasks[i]`, `train.precision bf16`, `model.init_from: DIR`."""
    names = set()
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
        m = re.match(r"([a-z_]+(?:\.[a-z_][a-z0-9_]*)+)(?=$|[\s:=\[,)])", span)
        if not m or m[1].split(".")[0] not in SECTIONS:
            continue
        if m[1].rsplit(".", 1)[1] in FILE_SUFFIXES or span[m.end() :].startswith("/"):
            continue
        names.add(m[1])
    return names


def yaml_blocks(text: str) -> list[str]:
    return [body for _, info, body in FENCE.findall(text) if info.strip() == "yaml"]


def test_every_config_key_the_pages_name_is_in_the_schema():
    unknown = []
    for page in PAGES:
        text = page.read_text()
        unknown += [f"{rel(page)}: `{k}`" for k in sorted(named_keys(text))
                    if not key_exists(k) and not is_module(k)]  # fmt: skip
        for block in yaml_blocks(text):
            tree = yaml.safe_load(block)
            if not isinstance(tree, dict) or not set(tree) & SECTIONS:
                continue  # a profile, a harness task file: not a config
            unknown += [f"{rel(page)}: ```yaml {k}" for k in set(tree) - SECTIONS]
            unknown += [f"{rel(page)}: ```yaml {k}" for k in unknown_keys(SCHEMA, tree, ())]
    assert not unknown, "not keys of config/schema/config.schema.yaml:\n" + "\n".join(unknown)


def test_the_key_check_finds_a_wrong_key():
    assert key_exists("train.zero_stage") and key_exists("data.quality")
    assert key_exists("eval.harness.tasks") and key_exists("train.wandb.enabled")
    assert not key_exists("train.zero") and not key_exists("eval.harness.task")
    tree = yaml.safe_load("datasets:\n  a: {type: local, root: x, includ: ['*']}\n"
                          "train: {lr: 1, kfac: {damping: 1, dampin: 2}}\n")  # fmt: skip
    assert sorted(unknown_keys(SCHEMA, tree, ())) == ["datasets.a.includ", "train.kfac.dampin"]
    assert named_keys("set `train.lr` or `eval.json`, `train.precision bf16`") == {
        "train.lr",
        "train.precision",
    }


# --------------------------------------------------------------------------- commands


def command_lines(text: str) -> list[str]:
    """Command lines shown: the lines of code blocks (a trailing `\\` joins the next; a line
    indented under a `gptflow` line continues it) and inline code spans, from `gptflow`,
    `snakemake` or `make` on, comments cut."""
    lines = []
    for _, info, body in FENCE.findall(text):
        if info.strip() not in ("", "bash", "sh", "console", "shell"):
            continue
        joined: list[str] = []
        for line in body.splitlines():
            if joined and (joined[-1].endswith("\\") or (line.startswith(" ") and
                           joined[-1].startswith("gptflow "))):  # fmt: skip
                joined[-1] = joined[-1].rstrip("\\") + " " + line.strip()
            else:
                joined.append(line.strip().removeprefix("$ "))
        lines += joined
    lines += re.findall(r"(?<!`)`((?:gptflow|snakemake|make) [^`\n]+)`(?!`)", text)
    out = []
    for line in lines:
        line = re.split(r"\s+#", line)[0].strip()
        m = re.search(r"(?:^|[;&|(]\s*|\btime\s+)((?:gptflow|snakemake|make)(?:\s.*)?)$", line)
        if m:
            out.append(m[1])
    return out


def all_command_lines() -> dict[str, list[str]]:
    return {rel(p): command_lines(p.read_text()) for p in PAGES}


def gptflow_main():
    """The installed command's function ([project.scripts] gptflow), imported here."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["gptflow"]
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        gptflow_main()([*argv, "--help"])
    assert exit_.value.code == 0, (argv, out.getvalue())
    return out.getvalue()


def flags(words: list[str]) -> set[str]:
    return {w.split("=")[0].strip("[]()|,") for w in words if re.match(r"\[?--?[A-Za-z]", w)}


def gptflow_problems(lines: list[str]) -> list[str]:
    """One `gptflow <sub> --help` per subcommand in `lines`, and every flag shown for it among
    those its help lists; `gptflow a | b | c` shows three."""
    shown: dict[str, set[str]] = {}
    for line in lines:
        if not line.startswith("gptflow"):
            continue
        words = line.split(" -- ")[0].split()[1:]  # gptflow why [...] -- SNAKEMAKE_ARGS
        if words and words[0].startswith("-"):
            subs = [""]  # gptflow --version
        elif words and re.fullmatch(r"[a-z][a-z0-9-]+", words[0]):
            subs = [words[0]]
            if words[1:2] == ["|"]:  # gptflow a | b | c
                subs = [w for w in words if re.fullmatch(r"[a-z][a-z0-9-]+", w)]
        else:
            continue  # output shown, not a command: `gptflow preflight: ...`
        for sub in subs:
            shown.setdefault(sub, set()).update(flags(words) if len(subs) == 1 else set())
    problems = []
    for sub, wanted in sorted(shown.items()):
        try:
            text = help_text([sub] if sub else [])
        except AssertionError:
            problems.append(f"gptflow {sub}: no such subcommand")
            continue
        missing = {f for f in wanted if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)}
        if missing:
            problems.append(f"gptflow {sub}: {sorted(missing)} not in its --help")
    return problems


def test_every_gptflow_command_shown_runs_its_help_with_the_flags_shown():
    lines = [line for lines in all_command_lines().values() for line in lines]
    assert len({line.split()[1] for line in lines if line.startswith("gptflow ")}) > 20
    problems = gptflow_problems(lines)
    assert not problems, "\n".join(problems)


def test_the_command_check_finds_a_wrong_subcommand_or_flag(capsys):
    assert gptflow_problems(["gptflow tokenize --input F --no-such-flag", "gptflow tokenise",
                             "gptflow why --mfu 0.4 -- --profile p"]) == [
        "gptflow tokenise: no such subcommand",
        "gptflow tokenize: ['--no-such-flag'] not in its --help",
    ]  # fmt: skip


def rule_names() -> set[str]:
    names = set()
    for smk in [REPO / "Snakefile", *(REPO / "rules").glob("*.smk")]:
        names |= set(re.findall(r"^(?:rule|use rule \w+ as) (\w+)", smk.read_text(), re.M))
    return names


@pytest.fixture(scope="module")
def snakemake_help() -> str:
    smk = subprocess.run([sys.executable, "-m", "snakemake", "--help"], capture_output=True,
                         text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert smk.returncode == 0, smk.stderr[-2000:]
    return smk.stdout


def snakemake_problems(lines: list[str], help_: str) -> list[str]:
    """Every flag shown in `snakemake --help`; a bare word shown is a rule (a target)."""
    rules, problems = rule_names(), []
    for line in lines:
        if line.startswith("gptflow why") and " -- " in line:
            line = "snakemake " + line.split(" -- ", 1)[1]
        if not line.startswith("snakemake"):
            continue
        words = line.split()[1:]
        for flag in sorted(flags(words)):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_):
                problems.append(f"snakemake {flag}")
        for i, word in enumerate(words):
            takes_value = i and words[i - 1].startswith("--") and "=" not in words[i - 1]
            if re.fullmatch(r"[a-z_]+", word) and not takes_value and word not in rules:
                problems.append(f"snakemake target {word}")
    return problems


def test_every_snakemake_command_shown_uses_real_flags_and_targets(snakemake_help):
    problems = [f"{page}: {problem}" for page, lines in all_command_lines().items()
                for problem in snakemake_problems(lines, snakemake_help)]  # fmt: skip
    assert not problems, "\n".join(problems)


def test_the_snakemake_check_finds_a_wrong_flag_or_target(snakemake_help):
    shown = ["snakemake -n --profile p --set-resource a:b=1 trian",
             "gptflow why -- --profile p --confgfile x.yaml all"]  # fmt: skip
    assert snakemake_problems(shown, snakemake_help) == [
        "snakemake --set-resource",
        "snakemake target trian",
        "snakemake --confgfile",
    ]


def test_every_make_target_shown_is_in_the_makefile():
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    problems = []
    for page, lines in all_command_lines().items():
        for line in lines:
            words = shlex.split(line)
            if words[0] != "make":
                continue
            for word in words[1:]:
                if "=" in word or word.startswith("-"):
                    continue
                if word not in targets:
                    problems.append(f"{page}: make {word}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- paths, modules

TOP = ("config/", "profiles/", "tests/", "bench/", "src/", "rules/", "envs/", "workflow/",
       "docs/", ".ci/")  # fmt: skip
# named as what is not there: profiles/README.md says why there is no default profile
ABSENT_ON_PURPOSE = {"profiles/default/"}


def is_placeholder(path: str) -> bool:
    """`config/models/NAME.yaml`, `{run}`, `<run>`, globs, elisions, and the site's output."""
    return bool(
        re.search(r"[{}<>*…$]|\.\.\.", path)
        or any(re.fullmatch(r"[A-Z][A-Z_]*(\.\w+)?", part) for part in path.split("/"))
        or path.startswith("docs/_build")
    )


def test_every_repository_path_and_module_the_pages_name_exists():
    problems = []
    for page in PAGES:
        text = page.read_text()
        for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text):
            for word in span.split():
                path = word.strip("(),;:")
                if (path.startswith(TOP) and not is_placeholder(path)
                        and not (REPO / path).exists() and path not in ABSENT_ON_PURPOSE):  # fmt: skip
                    problems.append(f"{rel(page)}: {path}")
            for name in re.findall(r"(?<![\w/.-])gptflow(?:\.\w+)+", span):
                if not module_name_exists(name):
                    problems.append(f"{rel(page)}: {name}")
    assert not problems, "names nothing in the repository:\n" + "\n".join(problems)


def module_name_exists(dotted: str) -> bool:
    """`gptflow.a.b` a module or package, `gptflow.a.b.name` a name defined at its top level
    or a method of a class there (read with ast: nothing is imported)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO / "src" / Path(*parts[:cut])
        source = (
            base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        )
        if not source.is_file():
            continue
        rest = parts[cut:]
        if not rest:
            return True
        tree = ast.parse(source.read_text())
        scope: list = tree.body
        for name in rest:
            found = [n for n in scope if name in defined(n)]
            if not found:
                return False
            scope = getattr(found[0], "body", [])
        return True
    return False


def defined(node: ast.AST) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.ImportFrom):
        return {a.asname or a.name for a in node.names}
    return set()


# --------------------------------------------------------------------------- the README


def test_the_readme_is_short_and_is_the_long_description():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make run" in readme and "make test" in readme
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["readme"] == "README.md"
    assert "readme" not in project.get("dynamic", [])
