"""Every value a rule hands to a shell is quoted by Snakemake (`{...:q}`), never spliced.

The rules' commands are read from the .smk files themselves: each `shell:` block's string
literals, concatenated as Python would. A placeholder without `:q` fails here, whatever its
value is today; the parameter functions the commands call return argv words (lists), which
`:q` quotes one by one, never pre-joined command text.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
        commands.append((i + 1, ast.literal_eval("(" + "\n".join(literal) + ")")))
    return commands


def test_the_rules_have_shell_commands_to_check():
    found = {p.name: len(shell_commands(p)) for p in RULE_FILES}
    assert sum(found.values()) >= 15, found
    assert found["tokenize.smk"] >= 7 and found["download.smk"] == 2, found


def test_every_placeholder_of_every_shell_command_is_quoted():
    unquoted = [
        f"{path.name}:{line}: {{{name}}} in {command!r}"
        for path in RULE_FILES
        for line, command in shell_commands(path)
        for name in PLACEHOLDER.findall(command)
        if not name.endswith(":q")
    ]
    assert unquoted == []


def test_parameter_functions_hand_argv_words_not_command_text():
    """`shlex.quote(...)` or `" ".join(...)` in a rule helper is command text built by hand:
    the rule's `:q` would quote it as one word (or it would be spliced unquoted)."""
    common = (REPO / "rules" / "common.smk").read_text()
    assert "shlex.quote(" not in common
    assert '" ".join(' not in common
