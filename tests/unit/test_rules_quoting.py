"""Every value a rule hands to a shell is quoted by Snakemake (`{...:q}`), never spliced.

Checked wherever a rule builds a command, read from the .smk files themselves:
- each `shell:` directive's string literals, concatenated as Python would;
- each `run:` block (and onstart/onsuccess/onerror), parsed as Python: a `shell(...)` call
  there takes one plain string whose placeholders are all `:q` (an f-string, `%`, `.format`
  or `+` splices the value before Snakemake could quote it), and no `subprocess` with
  `shell=True`, `os.system` or `os.popen`;
- the package's argv builders the rules' params call (`*_args`, `*_arg`, and whatever says it
  returns argv words): given hostile values (spaces, quotes, `;`, `$(...)`, newlines) they
  return lists of words with each value unchanged in its own word, which `:q` quotes one by
  one -- never command text joined or quoted by hand.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RULE_FILES = [*sorted((REPO / "rules").glob("*.smk")), REPO / "Snakefile"]
PLACEHOLDER = re.compile(r"(?<!\{)\{([^{}]*)\}(?!\})")


def shell_commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) of every `shell:` directive of a Snakemake file."""
    lines = path.read_text().splitlines()
    commands = []
    for i, line in enumerate(lines):
        head = re.fullmatch(r"(\s*)shell:\s*(.*)", line)
        if not head:
            continue
        indent, rest = len(head.group(1)), head.group(2)
        literal = [rest] if rest else []
        for follow in lines[i + 1 :]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                break
            if follow.strip().startswith("#"):
                continue
            literal.append(follow.strip())
        node = ast.parse("(" + "\n".join(literal) + ")", mode="eval").body
        commands.append((i + 1, plain_string(node)))
    return commands


def plain_string(node: ast.AST) -> str:
    """The text of a plain string literal; SPLICED when the command is built in Python
    (f-string, %, .format, +, a name): the value would reach the shell before `:q` could quote
    it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return SPLICED


SPLICED = "<command text built in Python>"


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every `run:`, `onstart:`, `onsuccess:` and `onerror:` block of a
    Snakemake file: Python code, dedented."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        head = re.fullmatch(r"(\s*)(run|onstart|onsuccess|onerror):\s*(#.*)?", line)
        if not head:
            continue
        indent, body = len(head.group(1)), []
        for follow in lines[i + 1 :]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                break
            body.append(follow)
        blocks.append((i + 2, textwrap.dedent("\n".join(body))))
    return blocks


def run_block_commands(source: str) -> list[tuple[int, str]]:
    """(line within the block, command) of each `shell(...)` call of a run: block, and
    SPLICED for a subprocess with shell=True, os.system or os.popen."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
        if name == "shell" and node.args:
            found.append((node.lineno, plain_string(node.args[0])))
        elif (owner == "os" and name in ("system", "popen")) or (
            owner == "subprocess"
            and any(k.arg == "shell" and not is_false(k.value) for k in node.keywords)
        ):
            found.append((node.lineno, SPLICED))
    return sorted(found)


def is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not node.value


def unquoted(paths: list[Path]) -> list[str]:
    """Every command (shell: directive or run: block) that splices a value unquoted."""
    commands = [
        (path, line, command) for path in paths for line, command in shell_commands(path)
    ] + [
        (path, start + line - 1, command)
        for path in paths
        for start, source in python_blocks(path)
        for line, command in run_block_commands(source)
    ]
    bad = []
    for path, line, command in commands:
        if command == SPLICED:
            bad.append(f"{path.name}:{line}: {command}")
        bad += [
            f"{path.name}:{line}: {{{name}}} in {command!r}"
            for name in PLACEHOLDER.findall(command)
            if not name.endswith(":q")
        ]
    return bad


def test_the_rules_have_shell_commands_to_check():
    found = {p.name: len(shell_commands(p)) for p in RULE_FILES}
    assert sum(found.values()) >= 15, found
    assert found["tokenize.smk"] >= 7 and found["download.smk"] == 2, found


def test_every_placeholder_of_every_shell_command_is_quoted():
    assert unquoted(RULE_FILES) == []
    # the hooks are read too (they build no command today)
    assert [src.strip() for p in RULE_FILES for _, src in python_blocks(p)] == [
        "refuse_placeholders()", "record_config()", "record_refused_submissions(log)"
    ]  # fmt: skip


def test_a_command_moved_into_a_run_block_is_read_too(tmp_path):
    """The reader itself, on rules written the ways a value gets spliced: a shell(f"...") or
    .format or a name in a run: block, a placeholder without :q there, a subprocess with
    shell=True, an f-string shell: directive. The quoted forms pass."""
    rules = tmp_path / "r.smk"
    rules.write_text(
        """rule a:
    output:
        "a",
    run:
        for x in [1]:
            shell(f"gptflow tokenize --out {output}")
        shell("gptflow tokenize --out {output:q} --x {params.x}")
        shell("cmd {}".format(output[0]))
        shell(command)
        subprocess.run(["ls", output[0]], check=True)
        subprocess.run("ls " + output[0], shell=True)
        os.system("ls")
        shell("gptflow tokenize --out {output:q}")


rule b:
    shell:
        f"gptflow x {{params.x:q}}"


onsuccess:
    shell("echo {log}")
"""
    )
    assert unquoted([rules]) == [
        f"r.smk:17: {SPLICED}",
        f"r.smk:6: {SPLICED}",
        "r.smk:7: {params.x} in 'gptflow tokenize --out {output:q} --x {params.x}'",
        f"r.smk:8: {SPLICED}",
        f"r.smk:9: {SPLICED}",
        f"r.smk:11: {SPLICED}",
        f"r.smk:12: {SPLICED}",
        "r.smk:22: {log} in 'echo {log}'",
    ]


def test_the_gpu_jobs_commands_start_with_their_launcher_which_is_nothing_off_kubernetes():
    """evaluate, harness and harness_step: `{params.launcher:q}` first, as train_gpt's; off
    Kubernetes it is [] (tests/unit/kubernetes/test_rule_jobs.py), which Snakemake renders as
    nothing: the command the shell runs is the one it ran before the launcher."""
    from snakemake.utils import format as render

    commands = dict(shell_commands(REPO / "rules" / "evaluate.smk"))
    text = (REPO / "rules" / "evaluate.smk").read_text().splitlines()
    launched = {}
    for line, command in commands.items():
        rule = next(t for t in reversed(text[:line]) if t.startswith("rule "))[5:-1]
        launched[rule] = command.startswith("{params.launcher:q} gptflow ")
    assert launched == {"evaluate": True, "export_hf": False, "harness": True,
                        "harness_step": True}, launched  # fmt: skip
    off = render("{launcher:q} gptflow evaluate --config {c:q}", launcher=[], c="r.yaml")
    assert off == " gptflow evaluate --config r.yaml"  # the shell's words as without it
    words = ["gptflow", "kubernetes", "submit", "--spec", '{"a": "b c"}', "--"]
    on = render("{launcher:q} gptflow x", launcher=words)
    assert on == 'gptflow kubernetes submit --spec \'{"a": "b c"}\' -- gptflow x'


def test_parameter_functions_hand_argv_words_not_command_text():
    """`shlex.quote(...)` or `" ".join(...)` in a rule helper is command text built by hand:
    the rule's `:q` would quote it as one word (or it would be spliced unquoted). The helpers
    of rules/common.smk and of each stage's rules/*_functions.smk hand on what the package's
    builders return: see test_the_package_argv_builders_return_hostile_values_as_single_words."""
    helpers = [REPO / "rules" / "common.smk", *sorted((REPO / "rules").glob("*_functions.smk"))]
    assert len(helpers) > 1, helpers
    for path in helpers:
        text = path.read_text()
        assert "shlex.quote(" not in text, path.name
        assert '" ".join(' not in text, path.name
    rules = "".join(p.read_text() for p in RULE_FILES)
    for call in ("prompt_args(", "extra_args(", "build_arg_args(", "squash_options_arg(",
                 "train_launcher(", "rank_options(", ".mirror_args()", ".token_origin_args()",
                 "submit_launcher(", "job_pod_set("):  # fmt: skip
        assert call in rules, f"the rules no longer call {call}: update the builders' test"


# Values a config, a profile or a catalog could hold, each of which a shell would split,
# expand or run if it reached one unquoted
HOSTILE = ["two words", "it's", 'say "hi"', "a; rm -rf ~", "$(touch pwned)", "`id`",
           "line\nbreak", "$HOME", "*", "-starts-with-dash", "{braces}"]  # fmt: skip


def argv_builders() -> set[str]:
    """The package's functions that return argv words for a rule: named *_args / *_arg, or
    saying "argv words" in their docstring or in the comment heading their group (gptflow.cli
    excluded: it builds its own argparse and child command lines, not a rule's)."""
    found = set()
    for path in (REPO / "src" / "gptflow").rglob("*.py"):
        if path.is_relative_to(REPO / "src" / "gptflow" / "cli"):
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = (ast.get_docstring(node) or "").lower()
            if re.search(r"_args?$", node.name) or "argv words" in doc:
                found.add(node.name)
    return found


def words(value) -> list[str]:
    assert isinstance(value, list) and all(isinstance(w, str) for w in value), value
    return value


def test_the_package_argv_builders_return_hostile_values_as_single_words():
    import shlex

    from gptflow.container import image as container
    from gptflow.data.remote_files import RemoteFile
    from gptflow.data.sources import Dataset, Shard
    from gptflow.errors import GptflowError
    from gptflow.results import evaluate, harness
    from gptflow.train import distributed

    checked = set()

    def check(name, got, want):
        checked.add(name)
        assert words(got) == want, name

    check("prompt_args", evaluate.prompt_args(HOSTILE), [f"--prompt={h}" for h in HOSTILE])
    check("extra_args", evaluate.extra_args({h: [h, "p"] for h in HOSTILE}),
          [w for h in HOSTILE for p in (h, "p") for w in ("--extra", h, p)])  # fmt: skip
    remote = RemoteFile("f", ("https://h/f", *HOSTILE), HOSTILE[3])
    check("mirror_args", remote.mirror_args(), [w for h in HOSTILE for w in ("--mirror", h)])
    check("sha256_args", remote.sha256_args(), ["--sha256", HOSTILE[3]])
    for h in HOSTILE:
        shard = Shard("00000", "in", h, member=h, member_format=h, json_key=h)
        member = ["--member", h] if h != "*" else []  # "*": every member, the default
        check("member_args", shard.member_args(), member)
        check("member_format_args", shard.member_format_args(), ["--member-format", h])
        check("reader_args", shard.reader_args(),
              ["--format", h, "--json-key", h, *member, "--member-format", h])  # fmt: skip
        d = Dataset("d", "url", (shard,), token_env=h, token_origins=(h, h), token_allow_http=True)
        check("token_env_args", d.token_env_args(), ["--token-env", h])
        check("token_origin_args", d.token_origin_args(), ["--token-origin", h] * 2)
        check("token_allow_http_args", d.token_allow_http_args(), ["--token-allow-http"])
    check("build_arg_args", container.build_arg_args({h: h for h in HOSTILE}),
          [w for h in HOSTILE for w in ("--build-arg", f"{h}={h}")])  # fmt: skip
    check("build_option_args", container.build_option_args(HOSTILE),
          [f"--build-option={h}" for h in HOSTILE])  # fmt: skip
    logins = [{"server": h, "username": h, "password_env": h} for h in HOSTILE]
    check("registry_login_args", container.registry_login_args(logins),
          [w for h in HOSTILE for w in ("--registry-login", h, h, h)])  # fmt: skip
    # the mksquashfs options travel as ONE word that squash-image splits shell-style (no shell)
    squash = container.squash_options_arg(HOSTILE)
    checked.add("squash_options_arg")
    assert isinstance(squash, str) and squash.startswith("--squash-options=")
    assert shlex.split(squash.removeprefix("--squash-options=")) == HOSTILE

    srun = {"mpi": "srun", "nodes": 2, "tasks_per_node": 4}
    for h in HOSTILE:
        pyxis = {"format": "sqsh", "mounts": [h]}
        check("train_launcher", distributed.train_launcher(srun, 3, pyxis, h, h), [
            "srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=4",
            "--cpus-per-task=3", f"--container-image={h}", f"--container-mounts={h}:{h},{h}",
            f"--container-workdir={h}", "--no-container-mount-home",
        ])  # fmt: skip
        sif = {"format": "sif", "mounts": [h]}
        check("train_launcher", distributed.train_launcher({"mpi": h}, 3, sif, h, h), [
            h, "--kill-on-bad-exit=1", "--cpus-per-task=3",
            "apptainer", "exec", "--nv", "--pwd", h, "--bind", f"{h}:{h}", "--bind", h, h,
        ])  # fmt: skip
        check("srun_command", distributed.srun_command(h, tasks=2, container_options=[h]),
              [h, "--kill-on-bad-exit=1", "--ntasks=2", h])  # fmt: skip
        # an interface name is checked, not quoted: one a shell would read is refused
        if h != "-starts-with-dash":
            with pytest.raises(GptflowError, match="is not a network interface name"):
                distributed.train_launcher({"socket_ifname": h}, 1)
    check("train_launcher", distributed.train_launcher({"socket_ifname": "ib0,eth0"}, 1),
          ["env", "GLOO_SOCKET_IFNAME=ib0,eth0", "NCCL_SOCKET_IFNAME=ib0,eth0"])  # fmt: skip
    check("rank_options", distributed.rank_options({"nproc_per_node": 2}, 8),
          ["--nproc-per-node", "2", "--threads", "4"])  # fmt: skip
    harness_cfg = {"tasks": HOSTILE, "include": HOSTILE, "limit": 3}
    check("task_args", harness.task_args(harness_cfg), [w for h in HOSTILE for w in ("--task", h)])
    check("include_args", harness.include_args(harness_cfg),
          [w for h in HOSTILE for w in ("--include", h)])  # fmt: skip
    check("limit_args", harness.limit_args(harness_cfg), ["--limit", "3"])
    # the JobSet's description travels as ONE JSON word that `gptflow kubernetes submit` reads
    from gptflow.kubernetes.sizing import submit_launcher
    from gptflow.kubernetes.spec import PodSet

    for h in HOSTILE:
        p = PodSet(name=h, run=h, namespace=h, image=h, volume_claim=h, mount_path=h, nodes=2,
                   gpus_per_node=8, cpus=8, memory_mb=1, shm_mb=64, done=h, manifests_dir=h,
                   env={h: h}, node_selector={h: h}, queue=h)  # fmt: skip
        argv = submit_launcher(p)
        check("submit_launcher", argv[:4] + argv[5:],
              ["gptflow", "kubernetes", "submit", "--spec", "--"])  # fmt: skip
        assert PodSet.from_json(argv[4]) == p
    # every builder the package has is checked here: a new one is added to this test
    assert argv_builders() == checked
