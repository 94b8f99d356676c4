"""The reference in docs/ against the code it describes: every `bitdet` subcommand and option
(megatron_bitdet/cli), recipe key (recipe/schema.py: type and default too), rule (enforce/rules.py: its
swap too), canonical environment variable (enforce/env.py), patch declaration (patches/*.yaml) and
catalog entry (catalog/known_sources.yaml) has its doc line, and no doc line names one that does not
exist. A failure says which line to add (ready to paste, description aside) or which to remove.

The drift tests build mismatches on the real declarations (a rule, a recipe key, a subcommand, an option
added in code; a row the code lacks) and check each check catches them with that message. Last, every
relative link in README.md and docs/ resolves, every documented `bitdet` line parses, and the README's
`bitdet recipe` lines run."""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
TODO = "<what it does>"


# ---------------------------------------------------------------------------- reading the pages
def _cells(line: str) -> list[str]:
    """A markdown table row's cells (a ``\\|`` inside a cell is not a separator)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _is_row(line: str) -> bool:
    return line.startswith("|") and not re.fullmatch(r"\|[\s|:-]+\|", line.strip())


def rows_under(text: str, heading: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of the table rows below ``## heading`` (to the next ``## ``), header row included."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}")
    rows = []
    for no, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## "):
            break
        if _is_row(line):
            rows.append((no, _cells(line)))
    return rows[1:]  # the header


def _first_code(cell: str) -> str:
    found = re.match(r"`([^`]+)`", cell)
    return found.group(1) if found else ""


def _codes(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# ---------------------------------------------------------------------------- commands.md
COMMANDS_MD = DOCS / "commands.md"
HEADING = re.compile(r"^(#{2,3}) `bitdet ([a-z][a-z -]*)`\s*$")


def _subparsers(parser) -> dict:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def command_tree(parser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """'train' -> its parser, 'recipe validate' -> its parser ... every subcommand at every depth."""
    out = {}
    for name, sub in _subparsers(parser).items():
        out[prefix + name] = sub
        out.update(command_tree(sub, prefix + name + " "))
    return out


def option_name(action) -> str:
    """How a doc row names an argument: the longest option string, or a positional's metavar."""
    if action.option_strings:
        return max(action.option_strings, key=len)
    return action.metavar if isinstance(action.metavar, str) else action.dest.upper()


def options(parser) -> dict[str, argparse.Action]:
    return {option_name(a): a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))}


def option_row(action) -> str:
    name = option_name(action)
    if action.option_strings and action.nargs != 0:
        value = action.metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices
                                   else action.dest.upper())
        name = f"{name} {value}"
    elif action.nargs in ("*", "...", argparse.REMAINDER):
        name += " ..."
    help_text = (action.help or TODO).replace("%(default)s", str(action.default)).replace("|", "\\|")
    return f"| `{name}` | {help_text} |"


def command_section(name: str, parser) -> str:
    depth = "###" if " " in name else "##"
    rows = "\n".join(option_row(a) for a in options(parser).values())
    return (f"{depth} `bitdet {name}`\n\n{parser.description or TODO}\n\n| argument | meaning |\n|---|---|\n{rows}\n\n"
            f"Exit: 0 ... ; 1 ... ; 2 unusable input.")


def documented_commands(text: str) -> dict[str, dict]:
    """Per ``bitdet X`` heading: its line, the arguments its table rows name, and whether it states exit codes."""
    out, current = {}, None
    for no, line in enumerate(text.splitlines(), 1):
        head = HEADING.match(line)
        if head:
            current = out[head.group(2)] = {"line": no, "args": {}, "exit": False}
        elif line.startswith("#"):
            current = None
        elif current is not None:
            if _is_row(line):
                for code in _codes(_cells(line)[0]):
                    current["args"][code.split()[0]] = no
            current["exit"] |= line.startswith("Exit:")
    return out


def command_problems(parser, text: str) -> list[str]:
    tree, docs = command_tree(parser), documented_commands(text)
    problems = []
    for name, sub in tree.items():
        if name not in docs:
            problems.append(f"docs/commands.md: `bitdet {name}` (megatron_bitdet/cli) has no section; add:\n"
                            + command_section(name, sub))
            continue
        args, leaf = options(sub), not _subparsers(sub)
        for arg, action in args.items():
            if arg not in docs[name]["args"]:
                problems.append(f"docs/commands.md: section `bitdet {name}` (line {docs[name]['line']}) has no row "
                                f"for {arg}; add: {option_row(action)}")
        for arg, no in docs[name]["args"].items():
            if arg not in args:
                problems.append(f"docs/commands.md:{no}: `bitdet {name}` has no argument {arg}; remove or fix the row")
        if leaf and not docs[name]["exit"]:
            problems.append(f"docs/commands.md: section `bitdet {name}` states no exit codes; add a line 'Exit: ...'")
    problems += [f"docs/commands.md:{d['line']}: `bitdet {name}` is not a subcommand; remove the section"
                 for name, d in docs.items() if name not in tree]
    return problems


def test_every_subcommand_and_option_is_documented():
    from megatron_bitdet.cli import build_parser

    problems = command_problems(build_parser(), COMMANDS_MD.read_text())
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- recipes.md
RECIPES_MD = DOCS / "recipes.md"
KEYS_HEADING = "Every key"


def _type_text(tp, meta) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        text = "one of " + ", ".join(f"`{a}`" for a in typing.get_args(tp))
    elif origin is typing.Union:
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        text = _type_text(inner, {}) + " or null"
    elif origin in (tuple, list):
        text = f"list of {_type_text(typing.get_args(tp)[0], {})}"
    elif origin is dict:
        text = "map of str to str"
    else:
        text = tp.__name__
    bounds = [f"{sign} {meta[k]}" for k, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
              if meta.get(k) is not None]
    return ", ".join([text, *bounds])


def _default_text(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "`null`"
    if isinstance(value, (tuple, list)):
        return f"`{list(value)}`"
    return f"`{value}`"


def schema_rows(cls, prefix: str = "") -> dict[str, tuple[str, str]]:
    """key path -> (type text, default text) for every leaf key of the recipe schema."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(schema_rows(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (_type_text(hints[f.name], f.metadata), _default_text(f))
    return out


def recipe_problems(root, text: str) -> list[str]:
    rows = {_first_code(cells[0]): (no, cells) for no, cells in rows_under(text, KEYS_HEADING)}
    expected = schema_rows(root)
    problems = []
    for key, (type_text, default) in expected.items():
        row = f"| `{key}` | {type_text} | {default} | {TODO} |"
        if key not in rows:
            problems.append(f"docs/recipes.md: recipe key {key} (recipe/schema.py) has no row under "
                            f"'## {KEYS_HEADING}'; add: {row}")
        elif rows[key][1][1:3] != [type_text, default]:
            problems.append(f"docs/recipes.md:{rows[key][0]}: {key}'s type / default columns should read "
                            f"'{type_text}' / '{default}' (recipe/schema.py)")
    problems += [f"docs/recipes.md:{no}: {key} is not a recipe key (recipe/schema.py); remove the row"
                 for key, (no, _) in rows.items() if key not in expected]
    return problems


def test_every_recipe_key_is_documented_with_its_type_and_default():
    from megatron_bitdet.recipe.schema import RecipeConfig

    problems = recipe_problems(RecipeConfig, RECIPES_MD.read_text())
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- rules.md
RULES_MD = DOCS / "rules.md"


def _named_rows_problems(text, heading, what, source, declared: dict, row_for, columns) -> list[str]:
    """``declared``: id -> the cells ``columns`` must hold (by index); ``row_for(id)``: the row to add."""
    rows = {_first_code(cells[0]): (no, cells) for no, cells in rows_under(text, heading)}
    problems = []
    for key, want in declared.items():
        if key not in rows:
            problems.append(f"docs/rules.md: {what} {key} ({source}) has no row under '## {heading}'; add: {row_for(key)}")
            continue
        no, cells = rows[key]
        for column, value in zip(columns, want):
            if cells[column] != value:
                problems.append(f"docs/rules.md:{no}: {key}: column {column + 1} should read '{value}' ({source})")
    problems += [f"docs/rules.md:{no}: {key} is not a {what} ({source}); remove the row"
                 for key, (no, _) in rows.items() if key not in declared]
    return problems


def _swap_cell(swap) -> str:
    return f"`{swap}`" if swap else "—"


def rule_problems(rules, text: str) -> list[str]:
    by_id = {r.id: r for r in rules}
    return _named_rows_problems(
        text, "Rules", "rule", "megatron_bitdet/enforce/rules.py", {r.id: [_swap_cell(r.swap)] for r in rules},
        lambda i: f"| `{i}` | {by_id[i].why} | {by_id[i].fix} | {_swap_cell(by_id[i].swap)} |", [3])


def env_problems(table, text: str) -> list[str]:
    by_name = {v.name: v for v in table}
    default = {v.name: f"`{v.default}`" if v.default is not None else "recorded only" for v in table}
    return _named_rows_problems(
        text, "Canonical environment", "canonical environment variable", "megatron_bitdet/enforce/env.py",
        {n: [default[n]] for n in by_name},
        lambda n: f"| `{n}` | {default[n]} | {by_name[n].accepted} | {by_name[n].why} |", [1])


def patch_problems(decls, text: str) -> list[str]:
    by_id = {d.id: d for d in decls}
    return _named_rows_problems(
        text, "Deterministic variants (swaps)", "patch declaration", "patches/*.yaml",
        {d.id: [f"`{d.rule}`"] for d in decls},
        lambda i: f"| `{i}` | `{by_id[i].rule}` | <what it replaces> | <how> |", [1])


def _rules_cell(rules) -> str:
    return ", ".join(f"`{r}`" for r in rules) or "—"


def catalog_problems(entries, text: str) -> list[str]:
    by_id = {e.id: e for e in entries}
    return _named_rows_problems(
        text, "Known sources (the doctor's catalog)", "catalog entry", "catalog/known_sources.yaml",
        {e.id: [_rules_cell(e.rules), e.fix.get("kind", "—")] for e in entries},
        lambda i: f"| `{i}` | {by_id[i].title} | {_rules_cell(by_id[i].rules)} | {by_id[i].fix.get('kind', '—')} |",
        [2, 3])


def test_every_rule_is_documented_with_its_swap():
    from megatron_bitdet.enforce.rules import RULES

    problems = rule_problems(RULES, RULES_MD.read_text())
    assert not problems, "\n".join(problems)


def test_every_restore_skipping_flag_is_documented_with_its_fix():
    from megatron_bitdet.megatron_lm.line_rules import RESTORE_FLAGS

    problems = _named_rows_problems(
        RULES_MD.read_text(), "Megatron-LM lines: resumes that skip restored state", "restore-skipping flag",
        "megatron_bitdet/megatron_lm/line_rules.py", {flag: [fix] for _, _, flag, _, fix in RESTORE_FLAGS},
        lambda f: next(f"| `{f}` | <on a line with> | {what} | {fix} |" for _, _, g, what, fix in RESTORE_FLAGS
                       if g == f), [3])
    assert not problems, "\n".join(problems)


def test_every_canonical_environment_variable_is_documented_with_its_default():
    from megatron_bitdet.enforce.env import ENV_TABLE

    problems = env_problems(ENV_TABLE, RULES_MD.read_text())
    assert not problems, "\n".join(problems)


def test_every_patch_declaration_is_documented_with_its_rule():
    from megatron_bitdet.compat.patching.declaration import load_declarations

    problems = patch_problems(load_declarations(), RULES_MD.read_text())
    assert not problems, "\n".join(problems)


def test_every_catalog_entry_is_documented_with_its_rules_and_fix_kind():
    from megatron_bitdet.enforce.catalog import load_catalog

    problems = catalog_problems(load_catalog().entries, RULES_MD.read_text())
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- the checks catch drift
def test_a_rule_added_in_code_or_a_row_left_behind_is_caught():
    from megatron_bitdet.enforce.rules import RULES, Rule

    text = RULES_MD.read_text()
    known = set(rule_problems(RULES, text))  # drift already there is another test's failure, not this one's
    new = Rule("example_rule", lambda r, f: None, "atomics in the epilogue", "set x: false", swap="grouped_gemm_dprob")
    assert [p for p in rule_problems([*RULES, new], text) if p not in known] == [
        "docs/rules.md: rule example_rule (megatron_bitdet/enforce/rules.py) has no row under '## Rules'; "
        "add: | `example_rule` | atomics in the epilogue | set x: false | `grouped_gemm_dprob` |"]
    dropped = [r for r in RULES if r.id != "flash_attention"]
    (problem,) = [p for p in rule_problems(dropped, text) if p not in known]
    assert re.fullmatch(r"docs/rules\.md:\d+: flash_attention is not a rule \(.*\); remove the row", problem)
    swapped = [dataclasses.replace(r, swap="ssd_scan") if r.id == "nccl_tree" else r for r in RULES]
    (problem,) = [p for p in rule_problems(swapped, text) if p not in known]
    assert "nccl_tree: column 4 should read '`ssd_scan`'" in problem


def test_a_recipe_key_added_in_code_is_caught_with_its_row():
    """Two keys added to the real schema's model.moe section (subclasses, so the rest is the real schema)."""
    from megatron_bitdet.recipe.schema import ModelConfig, MoEConfig, RecipeConfig
    from megatron_bitdet.recipe.typed import bounded

    moe = dataclasses.make_dataclass("MoEConfig", [("example_backend", typing.Literal["torch", "triton"], "torch"),
                                                   ("example_tile", int, bounded(64, ge=16))], bases=(MoEConfig,), frozen=True)
    model = dataclasses.make_dataclass("ModelConfig", [("moe", moe, dataclasses.field(default_factory=moe))],
                                       bases=(ModelConfig,), frozen=True)
    root = dataclasses.make_dataclass("RecipeConfig", [("model", model)], bases=(RecipeConfig,), frozen=True)
    known = set(recipe_problems(RecipeConfig, RECIPES_MD.read_text()))  # drift already there: another test's
    assert [p for p in recipe_problems(root, RECIPES_MD.read_text()) if p not in known] == [
        "docs/recipes.md: recipe key model.moe.example_backend (recipe/schema.py) has no row under '## Every key'; "
        f"add: | `model.moe.example_backend` | one of `torch`, `triton` | `torch` | {TODO} |",
        "docs/recipes.md: recipe key model.moe.example_tile (recipe/schema.py) has no row under '## Every key'; "
        f"add: | `model.moe.example_tile` | int, ≥ 16 | `64` | {TODO} |"]
    text = RECIPES_MD.read_text().replace("| `model.moe.top_k` |", "| `model.moe.topk` |")
    assert [p.split(": ", 1)[1] for p in recipe_problems(RecipeConfig, text) if p not in known] == [
        "recipe key model.moe.top_k (recipe/schema.py) has no row under '## Every key'; "
        f"add: | `model.moe.top_k` | int, ≥ 1 | `2` | {TODO} |",
        "model.moe.topk is not a recipe key (recipe/schema.py); remove the row"]


def test_a_subcommand_or_option_added_in_code_is_caught_with_its_section():
    from megatron_bitdet.cli import build_parser

    parser = build_parser()
    known = set(command_problems(parser, COMMANDS_MD.read_text()))  # drift already there: another test's
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    new = sub.add_parser("example-command", description="judge a launch line")
    new.add_argument("--strict", action="store_true", help="refuse warnings too")
    sub.choices["train"].add_argument("--budget", metavar="SECONDS", help="stop after SECONDS")
    problems = [p for p in command_problems(parser, COMMANDS_MD.read_text()) if p not in known]
    assert problems[0].startswith("docs/commands.md: section `bitdet train` (line ")
    assert problems[0].endswith("has no row for --budget; add: | `--budget SECONDS` | stop after SECONDS |")
    assert problems[1:] == [
        "docs/commands.md: `bitdet example-command` (megatron_bitdet/cli) has no section; add:\n"
        "## `bitdet example-command`\n\n"
        "judge a launch line\n\n| argument | meaning |\n|---|---|\n| `--strict` | refuse warnings too |\n\n"
        "Exit: 0 ... ; 1 ... ; 2 unusable input."]


def test_a_doc_section_or_row_the_code_lacks_is_caught():
    from megatron_bitdet.cli import build_parser

    known = set(command_problems(build_parser(), COMMANDS_MD.read_text()))  # drift already there: another test's
    text = COMMANDS_MD.read_text() + "\n## `bitdet frobnicate`\n\n| `--x` | y |\n\nExit: 0.\n"
    text = text.replace("| `--max-details", "| `--max-detail", 1)
    problems = [p for p in command_problems(build_parser(), text) if p not in known]
    assert len(problems) == 3, problems
    assert "section `bitdet compare`" in problems[0] and "has no row for --max-details" in problems[0]
    assert re.fullmatch(r"docs/commands\.md:\d+: `bitdet compare` has no argument --max-detail; remove or fix the row",
                        problems[1])
    assert re.fullmatch(r"docs/commands\.md:\d+: `bitdet frobnicate` is not a subcommand; remove the section",
                        problems[2])


@pytest.mark.parametrize("check, load, drop", [
    (env_problems, "megatron_bitdet.enforce.env:ENV_TABLE", "PYTHONHASHSEED"),
    (patch_problems, "megatron_bitdet.compat.patching.declaration:load_declarations", "ssd_scan"),
    (catalog_problems, "megatron_bitdet.enforce.catalog:load_catalog", "nccl_algorithm"),
])
def test_a_declaration_without_its_row_is_caught(check, load, drop):
    """The real declarations against the page with one row deleted: the check names the row to add."""
    import importlib

    module, attr = load.split(":")
    declared = getattr(importlib.import_module(module), attr)
    declared = declared() if callable(declared) else declared
    declared = getattr(declared, "entries", declared)
    known = set(check(declared, RULES_MD.read_text()))  # drift already there: another test's
    text = "\n".join(line for line in RULES_MD.read_text().splitlines() if not line.startswith(f"| `{drop}` |"))
    (problem,) = [p for p in check(declared, text) if p not in known]
    assert problem.startswith("docs/rules.md: ") and f" {drop} (" in problem and f"add: | `{drop}` |" in problem


# ---------------------------------------------------------------------------- links and command lines
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    """A link to a page or heading that moved is a dead end for the reader."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


def shell_commands(page: Path) -> list[str]:
    """Every `bitdet ...` command in the page's bash blocks (continuation lines joined, comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code = line.split("#")[0] if line.lstrip().startswith("#") else line.split(" #")[0]
            if "bitdet " in code:
                out.append(code[code.index("bitdet "):].split(";")[0].strip())
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if shell_commands(p)], ids=lambda p: p.name)
def test_every_documented_command_line_parses(page):
    """Each `bitdet` line in README.md and docs/ names a real subcommand with real options (argparse only;
    the commands the tests run end to end are checked against the tests in their own files)."""
    import contextlib
    import io
    import shlex

    from megatron_bitdet.cli import build_parser

    parser = build_parser()
    refused = []
    for command in shell_commands(page):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(shlex.split(command)[1:])
        except SystemExit:
            refused.append(f"{command}\n    {err.getvalue().strip().splitlines()[-1]}")
    assert not refused, f"{page.relative_to(REPO)}: commands argparse refuses:\n" + "\n".join(refused)


def test_the_readmes_recipe_commands_succeed(capsys):
    """The README's `bitdet recipe ...` lines run as written (they are cheap: no training), exit 0."""
    import shlex

    from megatron_bitdet.cli import main

    commands = [c for c in shell_commands(REPO / "README.md") if c.startswith("bitdet recipe ")]
    assert len(commands) >= 3, commands
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, (command, capsys.readouterr().err)
