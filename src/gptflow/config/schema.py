"""gptflow's config files, read and validated: YAML without duplicate keys, JSON schema with
errors in the config's own terms (the key, the value, the fix), defaults filled from the schema.

The bottom of the configuration layer: it knows no gptflow setting, only how to read and check
a document against a schema (config/schema/config.schema.yaml, the dataset catalog's entries).
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from gptflow.errors import GptflowError

_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class DuplicateKeyError(Exception):
    """A mapping gives one key twice (YAML and JSON parsers silently keep the last)."""

    def __init__(self, key: str, line: int | None, first_line: int | None = None) -> None:
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line

    def describe(self, path: str | os.PathLike) -> str:
        where = f"{path}:{self.line}" if self.line else str(path)
        also = f" (first on line {self.first_line})" if self.first_line else ""
        return (
            f"{where}: key '{self.key}' is given twice{also}; only the last would count. "
            f"Remove one of them from {path}."
        )


class UniqueKeyLoader(_BaseLoader):
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last).

    Keys merged in with ``<<`` may be overridden, as YAML intends."""

    def construct_document(self, node):
        self._root_node = node
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                    key_node, yaml.ScalarNode
                ):
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    parent = _node_path(getattr(self, "_root_node", node), node)
                    raise DuplicateKeyError(_dotted([*parent, key]), line, seen[key])
                seen[key] = line
        return super().construct_mapping(node, deep)


def _node_path(root, target) -> list:
    """Keys and indices from the document's root node to `target` (a composed YAML node)."""
    stack, visited = [(root, [])], set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append((v, [*path, k.value if isinstance(k, yaml.ScalarNode) else "?"]))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, [*path, i]) for i, v in enumerate(node.value))
    return []


def parse_yaml(text: str, where: str | os.PathLike, loader: type = UniqueKeyLoader) -> Any:
    """Parse YAML text; a syntax error or a key given twice names `where` and the line.
    `loader`: UniqueKeyLoader or a subclass (one that knows more tags)."""
    try:
        return yaml.load(text, Loader=loader)
    except DuplicateKeyError as e:
        raise GptflowError(e.describe(where)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark else str(where)
        raise GptflowError(f"{at}: invalid YAML ({getattr(e, 'problem', e)})") from None


def load_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file; a syntax error or a key given twice names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise GptflowError(f"{path}: no such file")
    return parse_yaml(path.read_text(encoding="utf-8"), path)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key, None)
        out[key] = value
    return out


def check_config_file(path: str | os.PathLike) -> None:
    """Re-read a config file Snakemake merged: a key given twice is an error naming the file,
    the line and the key (Snakemake keeps the last). Read as Snakemake reads it: JSON first,
    else YAML."""
    path = Path(path)
    if not path.is_file():
        raise GptflowError(f"{path}: config file not found")
    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text, object_pairs_hook=_unique_pairs)
    except DuplicateKeyError as e:
        try:  # JSON is YAML: the YAML parser names the line and the full key
            yaml.load(text, Loader=UniqueKeyLoader)
        except DuplicateKeyError as full:
            raise GptflowError(full.describe(path)) from None
        except yaml.YAMLError:
            pass
        lines = [i + 1 for i, line in enumerate(text.splitlines()) if f'"{e.key}"' in line]
        raise GptflowError(
            DuplicateKeyError(e.key, lines[-1] if lines else None).describe(path)
        ) from None
    except ValueError:  # not JSON: YAML, as Snakemake falls back to
        parse_yaml(text, path)


def plain(value: Any) -> Any:
    """`value` with every mapping a dict and every sequence a list (Snakemake reads JSON config
    files into OrderedDicts, which yaml.safe_dump refuses)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def non_finite_numbers(value: Any, path: tuple = ()) -> list[tuple[str, float]]:
    """(dotted key, value) of every NaN or infinity in a config tree."""
    if isinstance(value, float) and not math.isfinite(value):
        return [(_dotted(path), value)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in non_finite_numbers(v, (*path, k))]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in non_finite_numbers(v, (*path, i))]
    return []


def non_string_keys(value: Any, path: tuple = ()) -> list[tuple[str, Any]]:
    """(dotted mapping, key) of every mapping key that is not a string (YAML reads `5:` or
    `yes:` as a number or a boolean; JSON schema checks only string keys' names)."""
    out: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                out.append((_dotted(path), k))
            out += non_string_keys(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += non_string_keys(v, (*path, i))
    return out


def _resolve(schema: dict, root: dict) -> dict:
    """Follow a local ``$ref`` ("#/$defs/x"), merging the referring schema's own keys over it."""
    ref = schema.get("$ref")
    if not ref:
        return schema
    target: Any = root
    for part in ref.lstrip("#/").split("/"):
        target = target[part]
    merged = dict(_resolve(target, root))
    merged.update({k: v for k, v in schema.items() if k != "$ref"})
    merged["properties"] = {**target.get("properties", {}), **schema.get("properties", {})}
    return merged


def fill_defaults(instance: Any, schema: dict, root: dict | None = None) -> Any:
    """Insert schema ``default`` values for absent keys (recursively, only under present parents)."""
    root = root or schema
    schema = _resolve(schema, root)
    if isinstance(instance, dict):
        for branch in schema.get("allOf", []):  # if/then on a discriminating const
            cond = branch.get("if", {}).get("properties", {})
            if cond and all(instance.get(k) == v.get("const") for k, v in cond.items()):
                fill_defaults(instance, branch["then"], root)
            elif cond and "else" in branch:  # a catalog entry: hf, else url
                fill_defaults(instance, branch["else"], root)
        props = schema.get("properties", {})
        for key, sub in props.items():
            sub = _resolve(sub, root)
            if key not in instance and "default" in sub:
                instance[key] = copy.deepcopy(sub["default"])
            if key in instance:
                fill_defaults(instance[key], sub, root)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in instance:
                if key not in props:
                    fill_defaults(instance[key], extra, root)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            fill_defaults(item, schema["items"], root)
    return instance


def _dotted(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


_JSON_TYPE_NAMES = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true/false",
    "object": "a mapping",
    "array": "a list",
    "null": "null",
}


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "null" if value is None else type(value).__name__


def _choices(schema: dict, root: dict) -> list | None:
    """The values an enum/const schema (or an anyOf of them) allows, else None."""
    schema = _resolve(schema, root)
    if "enum" in schema:
        return list(schema["enum"])
    if "const" in schema:
        return [schema["const"]]
    if "anyOf" in schema:
        out: list = []
        for sub in schema["anyOf"]:
            more = _choices(sub, root)
            if more is None:
                return None
            out += more
        return out
    return None


def _allowed_keys(schema: dict, instance: dict, root: dict) -> set[str]:
    """The keys a mapping may hold: its schema's properties and those of each allOf branch
    (if/then, else) that applies to it (a catalog entry: hf keys or url keys)."""
    schema = _resolve(schema, root)
    allowed = set(schema.get("properties", {}))
    for branch in schema.get("allOf", []):
        cond = branch.get("if", {}).get("properties", {})
        if not cond:
            continue
        applies = all(instance.get(k) == v.get("const") for k, v in cond.items())
        sub = branch.get("then" if applies else "else")
        if sub:
            allowed |= set(_resolve(sub, root).get("properties", {}))
    return allowed


def _describe_error(err, root: dict, what: str) -> str | None:
    """One line for a jsonschema ValidationError: the key, its value and what is expected;
    None for an echo of another error (a known key that a failing if/else branch left
    unevaluated, e.g. a catalog entry's url_template of the wrong type)."""
    path = list(err.absolute_path)
    key = _dotted(path)
    v = err.validator
    expected = err.schema.get("x-expected") if isinstance(err.schema, dict) else None
    if "propertyNames" in err.absolute_schema_path:  # the key itself is the bad value
        want = expected or f"a key matching {err.validator_value!r}"
        return f"'{key}' has a key {err.instance!r}; expected {want}"
    if v in ("additionalProperties", "unevaluatedProperties"):
        allowed = _allowed_keys(err.schema, err.instance, root)
        unknown = sorted(k for k in err.instance if k not in allowed)
        if not unknown:  # a known key left unevaluated by its failing branch: said there
            return None
        parts = []
        for k in unknown:
            full = _dotted([*path, k])
            close = difflib.get_close_matches(str(k), sorted(allowed), n=1)
            hint = f" (did you mean '{_dotted([*path, close[0]])}'?)" if close else ""
            parts.append(f"unknown key '{full}'{hint}")
        known = ", ".join(sorted(allowed)) or "none"
        return f"{'; '.join(parts)}; keys allowed there: {known}"
    if v == "required":
        missing = re.findall(r"'([^']+)' is a required property", err.message)
        name = _dotted([*path, missing[0]]) if missing else key
        return f"missing required key '{name}'"
    if v == "type":
        expected = err.validator_value
        expected = expected if isinstance(expected, list) else [expected]
        names = " or ".join(_JSON_TYPE_NAMES.get(t, t) for t in expected)
        return f"'{key}' is {err.instance!r} ({_type_name(err.instance)}); expected {names}"
    if v == "control":
        return (
            f"'{key}' is {err.instance!r}, which holds a control character (newline, tab, ...); "
            f"remove it"
        )
    if v in ("enum", "const"):
        choices = err.validator_value if v == "enum" else [err.validator_value]
        return f"'{key}' is {err.instance!r}; expected one of {choices}"
    if v in ("anyOf", "oneOf") and _choices(err.schema, root) is not None:
        return f"'{key}' is {err.instance!r}; expected one of {_choices(err.schema, root)}"
    if v == "pattern":
        want = expected or f"a string matching {err.validator_value!r}"
        return f"'{key}' is {err.instance!r}; expected {want}"
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        op = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[v]
        return f"'{key}' is {err.instance!r}; it must be {op} {err.validator_value}"
    if v in ("minItems", "minProperties", "minLength"):
        return f"'{key}' must not be empty"
    if v == "uniqueItems":
        return f"'{key}' is {err.instance!r}; give each item once"
    if v == "maxItems":
        return f"'{key}' is {err.instance!r}; it takes at most {err.validator_value} items"
    return f"'{key}': {err.message}"


_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def _to_end(pattern: str) -> str:
    r"""`pattern` with a final ``$`` made ``\Z``: in Python's re (which jsonschema's ``pattern``
    uses) ``$`` also matches before a trailing newline, so ``^[a-z]+$`` would accept "abc\n"."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + r"\Z"
    return pattern


@functools.cache
def _validator_class():
    """Draft 2020-12, stricter where a config value can become a path or a command word:
    ``pattern`` matches to the end of the string (see :func:`_to_end`), a string holds no
    control character unless its schema says ``x-text: true`` (free text, e.g. a prompt), and
    an integer is written as one (2.0 is a number, not an integer)."""
    from jsonschema import Draft202012Validator, ValidationError, validators

    draft_type = Draft202012Validator.VALIDATORS["type"]

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not re.search(_to_end(patrn), instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def type_(validator, types, instance, schema):
        yield from draft_type(validator, types, instance, schema)
        if (
            isinstance(instance, str)
            and not schema.get("x-text")
            and _CONTROL_CHARACTER.search(instance)
        ):
            yield ValidationError(f"{instance!r} holds a control character", validator="control")

    # An integer is an int: JSON schema also takes 2.0, which range() and ids refuse later
    checker = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, instance: isinstance(instance, int) and not isinstance(instance, bool)
    )
    return validators.extend(
        Draft202012Validator, {"pattern": pattern, "type": type_}, type_checker=checker
    )


def validate(instance: Any, schema: dict, *, source: str, root: dict | None = None) -> None:
    """Raise one GptflowError listing every violation (one clause each), naming `source`:
    the schema's, and any NaN or infinity (refused everywhere, with its key)."""
    root = root or schema
    if root is not schema:
        schema = {**schema, "$defs": root.get("$defs", {})}
    non_finite = non_finite_numbers(instance)
    lines = {
        f"'{key}' is {value!r}; numbers must be finite (no .nan/.inf in YAML, NaN/Infinity in JSON)"
        for key, value in non_finite
    }
    reported = {key for key, _ in non_finite}
    keys = {
        f"'{where}' has a key {key!r} ({_type_name(key)}); keys are names: quote it "
        f"('{key}':) or rename it"
        for where, key in non_string_keys(instance)
    }
    if keys:  # before the schema, whose messages name keys as strings
        raise GptflowError(f"{source}: {'; '.join(sorted(keys | lines))}. Fix {source}.")
    errors = list(_validator_class()(schema).iter_errors(instance))
    for err in errors:
        if _dotted(err.absolute_path) not in reported:  # a NaN is also out of range, ...
            lines.add(_describe_error(err, root, source))
    lines.discard(None)
    if errors and not lines:  # only echoes: say what the validator says
        lines = {f"'{_dotted(e.absolute_path)}': {e.message}" for e in errors}
    if lines:
        raise GptflowError(f"{source}: {'; '.join(sorted(lines))}. Fix {source}.")
