"""docs/contract.md against the code it describes, so that the contract cannot drift silently.

The contract is what producers, operators and consumers read instead of the code; a metric, flag or
error code added without a line there is invisible to them. Every fact checked here is taken from the
code itself (the real argparse parser, a freshly built metrics registry, the modules' own error code
constants), so a new one is caught without anyone updating a list in this file. Pure: no broker.
"""

import argparse
import ast
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args
from unittest import mock

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel
from pydantic_settings import BaseSettings, CliSettingsSource, CliSubCommand

from sidecar.cli import DelaySidecar
from sidecar.cli_help import add_argument
from sidecar.control import cancels
from sidecar.control.cancels import CANCELLED, REJECTED, RESCHEDULED, TOO_LATE, UNKNOWN_MESSAGE_OUTCOME, Outcome
from sidecar.metrics import Metrics
from sidecar.settings import ENV_PREFIX
from sidecar.supervisor import SupervisorMetrics

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "contract.md"
SIDECAR = ROOT / "sidecar"

# Where code, configuration and prose cite the contract by section number (the docs site's pages too).
CITING_DIRS = ("sidecar", "spark", "tests", "policies", "examples", "deploy", "bench", "scripts", "docs")
CITING_FILES = ("README.md",)
CITING_SUFFIXES = frozenset({".py", ".yaml", ".yml", ".md"})

# `audit` is the Spark auditor's command: its flags are documented by its own --help, not the contract.
UNDOCUMENTED_COMMANDS = frozenset({"audit"})

_HEADING = re.compile(r"^## (\d+)\. ", re.MULTILINE)
_ANY_H2 = re.compile(r"^## ", re.MULTILINE)
# "contract section 6", "Contract section 5.", "contract sections 3 and 4", "contract (sections 1, 4
# and 5)", "docs/contract.md, sections 1, 4 and 5", "contract sections 1-5".
_CITATION = re.compile(
    r"contract(?:\.md)?[,:]?\s*\(?\s*sections?\s+(\d+(?:\s*(?:,|and|-|\u2013|to)\s*\d+)*)",
    re.IGNORECASE,
)
_RANGE = re.compile(r"(\d+)\s*(?:-|\u2013|to)\s*(\d+)")
_TABLE_ROW = re.compile(r"^\|(.+)\|\s*$", re.MULTILINE)
_CODE_SPAN = re.compile(r"`([^`]+)`")
_ERROR_CODE = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")


# ---------------------------------------------------------------------------------------------------
# Reading the contract


def contract_text() -> str:
    return CONTRACT.read_text(encoding="utf-8")


def sections(doc: str) -> dict[int, str]:
    """Section number -> its text up to the next `## ` heading, so a fact must sit where it belongs."""
    found: dict[int, str] = {}
    for match in _HEADING.finditer(doc):
        number = int(match.group(1))
        following = _ANY_H2.search(doc, match.end())
        found[number] = doc[match.start() : following.start() if following else len(doc)]
    return found


def table_rows(text: str) -> list[list[str]]:
    """Cells of each Markdown table row, outer pipes dropped; header and separator rows never match a name."""
    return [[cell.strip() for cell in row.split("|")] for row in _TABLE_ROW.findall(text)]


def spans(cell: str) -> list[str]:
    return _CODE_SPAN.findall(cell)


def subsection(text: str, title: str) -> str:
    """The `### title` part of a section: the run table must not borrow flags from `broker`'s lines."""
    start = text.index(f"### {title}\n")
    following = text.find("\n### ", start + 1)
    return text[start : following if following != -1 else len(text)]


# ---------------------------------------------------------------------------------------------------
# (a) section citations


def cited_sections(text: str) -> set[int]:
    numbers: set[int] = set()
    for match in _CITATION.finditer(text):
        listed = match.group(1)
        for low, high in _RANGE.findall(listed):
            numbers.update(range(int(low), int(high) + 1))
        numbers.update(int(n) for n in re.findall(r"\d+", _RANGE.sub("", listed)))
    return numbers


def citing_files() -> Iterator[Path]:
    this = Path(__file__).resolve()
    for name in CITING_DIRS:
        for path in sorted((ROOT / name).rglob("*")):
            if path.suffix in CITING_SUFFIXES and path.is_file() and path.resolve() != this:
                yield path
    for name in CITING_FILES:
        path = ROOT / name
        if path.is_file():
            yield path


def citations() -> dict[str, set[int]]:
    """`path:line` -> the section numbers it cites."""
    found: dict[str, set[int]] = {}
    for path in citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            cited = cited_sections(line)
            if cited:
                found[f"{path.relative_to(ROOT)}:{number}"] = cited
    return found


def missing_sections(doc: str, cited: Mapping[str, set[int]]) -> list[str]:
    present = set(sections(doc))
    return [f"{where} cites section {n}" for where, numbers in cited.items() for n in sorted(numbers - present)]


@pytest.mark.parametrize(
    ("text", "numbers"),
    [
        ("(contract section 6).", {6}),
        ("# Contract section 5.", {5}),
        ("Headers ... (contract sections 3 and 4). Pure code.", {3, 4}),
        ("sidecar.client against the contract (sections 1, 4 and 5), with fakes", {1, 4, 5}),
        ("the external contract (docs/contract.md, sections 1, 4 and 5) and", {1, 4, 5}),
        ("Rules (contract sections 1-5):", {1, 2, 3, 4, 5}),
        ("one of the contract's duration strings", set()),
    ],
)
def test_citations_are_read_in_every_form_the_tree_uses(text: str, numbers: set[int]) -> None:
    """A citation form the pattern misses would pass (a) unchecked; these are the forms in the tree."""
    assert cited_sections(text) == numbers


def test_sections_are_numbered_one_to_n_in_order() -> None:
    """Citations are by number: a renumbered or skipped section silently re-points every citation."""
    numbers = [int(n) for n in _HEADING.findall(contract_text())]
    assert numbers == list(range(1, len(numbers) + 1))
    assert len(_ANY_H2.findall(contract_text())) == len(numbers), "every ## heading must be numbered"


def test_every_cited_section_exists() -> None:
    cited = citations()
    # The tree cites the contract in dozens of places; none found means the scan, not the tree, broke.
    assert len(cited) >= 10, cited
    assert missing_sections(contract_text(), cited) == []


# ---------------------------------------------------------------------------------------------------
# (b) metrics


@dataclass(frozen=True)
class MetricFact:
    kind: str
    labels: frozenset[str]


def registered_metrics() -> dict[str, MetricFact]:
    """Exposed name -> type and labels, from the metrics objects the sidecar and supervisor build.

    Both register into a registry of their own, so building them here touches nothing global. Label
    names are not in a collected family until a child exists, hence the wrapper's `_labelnames`.
    """
    facts: dict[str, MetricFact] = {}
    owners: list[object] = [Metrics(CollectorRegistry()), SupervisorMetrics()]
    for owner in owners:
        for wrapper in vars(owner).values():
            if not isinstance(wrapper, MetricWrapperBase):
                continue
            for family in wrapper.describe():
                exposed = family.name + "_total" if family.type == "counter" else family.name
                facts[exposed] = MetricFact(family.type, frozenset(wrapper._labelnames))
    return facts


def test_metrics_are_collected_from_every_registry() -> None:
    """Metrics registered outside an attribute would be missed by registered_metrics; compare with
    what each registry served on a metrics port exposes: a worker's (Metrics) and the supervisor's
    (SupervisorMetrics, served by `run --workers N`)."""
    exposed: set[str] = set()
    for registry in (Metrics(CollectorRegistry()).registry, SupervisorMetrics().registry):
        exposed |= {f.name + "_total" if f.type == "counter" else f.name for f in registry.collect()}
    assert exposed == set(registered_metrics())
    assert {"delay_sidecar_messages_in_total", "delay_sidecar_workers_restarted_total"} <= exposed


def metric_problems(section: str, facts: Mapping[str, MetricFact]) -> list[str]:
    documented: dict[str, MetricFact] = {}
    for cells in table_rows(section):
        names = spans(cells[0]) if len(cells) > 2 else []
        if len(names) == 1 and names[0].startswith("delay_sidecar_"):
            documented[names[0]] = MetricFact(cells[1], frozenset(spans(cells[2])))
    problems = [f"{name} is not in the metrics table" for name in sorted(set(facts) - set(documented))]
    problems += [f"{name} is documented but not registered" for name in sorted(set(documented) - set(facts))]
    for name in sorted(set(facts) & set(documented)):
        if facts[name] != documented[name]:
            problems.append(f"{name}: code says {facts[name]}, doc says {documented[name]}")
    return problems


def test_every_metric_is_documented_with_its_type_and_labels() -> None:
    assert metric_problems(sections(contract_text())[7], registered_metrics()) == []


# ---------------------------------------------------------------------------------------------------
# (c) command-line flags


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every leaf command (`run`, `policies show`, ...) with the parser `delay-sidecar` really builds."""
    source: CliSettingsSource[argparse.ArgumentParser]
    source = CliSettingsSource(DelaySidecar, add_argument_method=add_argument)
    leaves: dict[str, argparse.ArgumentParser] = {}
    pending = [(name, parser) for name, parser in subparsers(source.root_parser).items()]
    while pending:
        name, parser = pending.pop()
        children = subparsers(parser)
        if children:
            pending += [(f"{name} {child}", sub) for child, sub in children.items()]
        else:
            leaves[name] = parser
    return leaves


def long_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """`--flag` -> the DELAY_SIDECAR_* variable of its setting (pydantic-settings' rule: prefix + field)."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                flags[option] = ENV_PREFIX + action.dest.rsplit(".", 1)[-1].upper()
    return flags


def flag_problems(run_table: str, flags: Mapping[str, str]) -> list[str]:
    documented: dict[str, set[str]] = {}
    for cells in table_rows(run_table):
        if len(cells) > 1:
            for flag in (s for s in spans(cells[0]) if s.startswith("--")):
                documented[flag] = set(spans(cells[1]))
    problems = [f"{flag} is not in the run table" for flag in sorted(set(flags) - set(documented))]
    problems += [f"{flag} is documented but `run` has no such flag" for flag in sorted(set(documented) - set(flags))]
    for flag in sorted(set(flags) & set(documented)):
        if flags[flag] not in documented[flag]:
            problems.append(f"{flag}: its row does not name {flags[flag]}")
    return problems


def test_every_run_flag_is_documented_with_its_environment_variable() -> None:
    run = commands()["run"]
    flags = long_flags(run)
    assert "--bootstrap-servers" in flags, "the parser walk found no flags of run"
    assert flag_problems(subsection(sections(contract_text())[6], "`run`"), flags) == []


_SUBCOMMAND = get_args(CliSubCommand)[1]
"""The marker pydantic-settings puts on a subcommand field."""


def command_models() -> dict[str, type[BaseModel]]:
    """Every leaf command (`run`, `policies show`, ...) -> the model its flags come from."""
    leaves: dict[str, type[BaseModel]] = {}
    pending: list[tuple[str, type[BaseModel]]] = [("", DelaySidecar)]
    while pending:
        prefix, model = pending.pop()
        children = [
            (f"{prefix} {(info.alias or name).replace('_', '-')}".strip(), sub)
            for name, info in model.model_fields.items()
            if _SUBCOMMAND in info.metadata
            for sub in get_args(info.annotation)
            if isinstance(sub, type) and issubclass(sub, BaseModel)
        ]
        if children:
            pending += children
        elif prefix:
            leaves[prefix] = model
    return leaves


def _reads(info: object, variable: str) -> bool:
    """Whether a field's default factory reads `variable` (policies' `--policies`, DELAY_SIDECAR_POLICIES)."""
    sentinel = "/set-by-test-contract-doc"
    with mock.patch.dict(os.environ, {variable: sentinel}):
        return sentinel in str(info.get_default(call_default_factory=True))  # type: ignore[attr-defined]


def environment_variables(model: type[BaseModel]) -> dict[str, str]:
    """`--flag` -> the DELAY_SIDECAR_* variable the command reads for it. A settings model with the
    sidecar's prefix reads one per field (an aliased field reads its alias instead); another model
    only where a field's default comes from one."""
    settings = issubclass(model, BaseSettings) and model.model_config.get("env_prefix") == ENV_PREFIX
    found: dict[str, str] = {}
    for name, info in model.model_fields.items():
        variable = ENV_PREFIX + name.upper()
        if (settings and info.alias is None) or (info.default_factory is not None and _reads(info, variable)):
            found["--" + name.replace("_", "-")] = variable
    return found


@dataclass(frozen=True)
class CommandFacts:
    flags: frozenset[str]
    variables: Mapping[str, str]
    """Its flags that have a DELAY_SIDECAR_* variable -> the variable."""


def other_commands() -> dict[str, CommandFacts]:
    """Every documented command but `run` (its table is checked above), from its real parser and model."""
    parsers, models = commands(), command_models()
    assert set(parsers) == set(models), "the parser walk and the model walk disagree on the commands"
    facts: dict[str, CommandFacts] = {}
    for name, parser in parsers.items():
        if name == "run" or name.split()[0] in UNDOCUMENTED_COMMANDS:
            continue
        flags = frozenset(long_flags(parser))
        variables = {f: v for f, v in environment_variables(models[name]).items() if f in flags}
        facts[name] = CommandFacts(flags, variables)
    return facts


def command_part(section: str, name: str) -> str:
    """A command's own lines of section 6: its synopsis (with continuation lines) and its bullet
    under Other commands, so that a flag or variable of one command is not found in another's."""
    lines = section.splitlines()
    part: list[str] = []
    for i, line in enumerate(lines):
        synopsis = re.fullmatch(rf"delay-sidecar {re.escape(name)}(?: .*)?", line)
        bullet = re.match(rf"- \*\*`{re.escape(name)}[` ]", line)
        if synopsis or bullet:
            part.append(line)
            for following in lines[i + 1 :]:
                if not following.startswith(" "):
                    break
                part.append(following)
    return "\n".join(part)


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def other_command_problems(section: str, facts: Mapping[str, CommandFacts]) -> list[str]:
    problems: list[str] = []
    for name, fact in sorted(facts.items()):
        part = command_part(section, name)
        if not part:
            problems.append(f"{name} has no synopsis or bullet of its own")
        problems += [f"{name} {flag} is not in its part" for flag in sorted(fact.flags) if not _mentions(part, flag)]
        problems += [
            f"{name} {flag}: {variable} is not in its part"
            for flag, variable in sorted(fact.variables.items())
            if not _mentions(part, variable)
        ]
        stray = {flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", part) if flag not in fact.flags}
        problems += [f"{name} {flag} is in its part but not a flag of {name}" for flag in sorted(stray)]
    return problems


def test_every_flag_of_the_other_commands_is_documented_in_its_own_part() -> None:
    facts = other_commands()
    assert {"broker", "demo", "policies show", "policies validate", "messages show"} <= set(facts)
    assert facts["broker"].variables["--nodes"] == "DELAY_SIDECAR_NODES", "the model walk found no variables"
    assert other_command_problems(sections(contract_text())[6], facts) == []


# ---------------------------------------------------------------------------------------------------
# (d) dead-letter error codes


@dataclass
class CodeScan:
    codes: dict[str, set[str]] = field(default_factory=dict)
    """Error code -> the files that dead-letter with it."""
    unresolved: list[str] = field(default_factory=list)
    """Code arguments the scan could not read: the scan must learn them, or a code could hide there."""


def _string_constants(trees: Mapping[str, ast.Module]) -> dict[str, set[str]]:
    constants: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value
                for target in node.targets:
                    if isinstance(target, ast.Name) and isinstance(value, str):
                        constants.setdefault(target.id, set()).add(value)
    return constants


def _rejection_classes(trees: Iterable[ast.Module]) -> set[str]:
    """RejectedRecord and every class derived from it, however deep."""
    bases: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id for b in node.bases if isinstance(b, ast.Name)}
    found = {"RejectedRecord"}
    while grown := {name for name, parents in bases.items() if parents & found} - found:
        found |= grown
    return found


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _is_super_init(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "__init__"
        and isinstance(func.value, ast.Call)
        and _callee(func.value) == "super"
    )


def _code_arguments(tree: ast.Module, rejections: set[str]) -> Iterator[ast.expr]:
    """The code argument of every RejectedRecord(code, ...), super().__init__(code, ...) in a
    RejectedRecord subclass, and writer.dead_letter(topic, record, code, ...)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in rejections - {"RejectedRecord"}:
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and _is_super_init(n)):
                if (arg := _argument(call, 0, "code")) is not None:
                    yield arg
        elif isinstance(node, ast.Call):
            callee = _callee(node)
            arg = None
            if callee == "RejectedRecord":
                arg = _argument(node, 0, "code")
            elif callee == "dead_letter":
                arg = _argument(node, 2, "code")
            if arg is not None:
                yield arg


def scan_codes(sources: Mapping[str, str]) -> CodeScan:
    trees = {name: ast.parse(text, filename=name) for name, text in sources.items()}
    constants = _string_constants(trees)
    rejections = _rejection_classes(trees.values())
    scan = CodeScan()
    for name, tree in trees.items():
        for arg in _code_arguments(tree, rejections):
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                values = {arg.value}
            elif isinstance(arg, ast.Name) and arg.id in constants:
                values = constants[arg.id]
            elif isinstance(arg, ast.Attribute) and arg.attr == "code":
                continue  # `rejected.code`: passes on a code raised somewhere this scan also reads
            else:
                scan.unresolved.append(f"{name}:{arg.lineno}: {ast.unparse(arg)}")
                continue
            for value in values:
                if _ERROR_CODE.fullmatch(value):
                    scan.codes.setdefault(value, set()).add(name)
                else:
                    scan.unresolved.append(f"{name}:{arg.lineno}: {value!r} does not look like an error code")
    return scan


def sidecar_codes() -> CodeScan:
    return scan_codes({str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted(SIDECAR.rglob("*.py"))})


def table_codes(text: str) -> set[str]:
    """Codes in the first column of the tables of `text`."""
    return {s for cells in table_rows(text) for s in spans(cells[0]) if _ERROR_CODE.fullmatch(s)}


def code_problems(table_text: str, codes: Iterable[str], what: str) -> list[str]:
    documented, used = table_codes(table_text), set(codes)
    return [f"{code} is not in the {what} table" for code in sorted(used - documented)] + [
        f"{code} is in the {what} table but no code dead-letters with it" for code in sorted(documented - used)
    ]


SCAN_EXAMPLE = """
NEW_CODE = "NEW_CODE"
class Subclassed(RejectedRecord):
    def __init__(self, message):
        super().__init__("SUBCLASS_CODE", message)
def f(writer, record, rejected):
    raise RejectedRecord(NEW_CODE, "why")
    writer.dead_letter("t.dlt", record, "LITERAL_CODE", "why")
    writer.dead_letter("t.dlt", record, rejected.code, rejected.message)
    raise RejectedRecord(code=make_code(), message="why")
"""


def test_the_code_scan_finds_every_way_a_code_is_given() -> None:
    """A code added as a new constant, literal or subclass must be found, or (d) would pass blindly."""
    scan = scan_codes({"example.py": SCAN_EXAMPLE})
    assert set(scan.codes) == {"NEW_CODE", "SUBCLASS_CODE", "LITERAL_CODE"}
    assert scan.unresolved == ["example.py:10: make_code()"]


def test_every_dead_letter_code_is_documented() -> None:
    scan = sidecar_codes()
    assert scan.unresolved == []
    assert {"INVALID_DELAY_HEADER", "TOPIC_REMOVED", "INVALID_COMMAND"} <= set(scan.codes), scan.codes
    assert code_problems(sections(contract_text())[3], scan.codes, "section 3") == []


def test_every_nack_rejection_code_is_documented_with_the_control_topic() -> None:
    """Nack codes go to the control dead-letter topic, whose consumers read section 5, not section 3."""
    control = {code for code, files in sidecar_codes().codes.items() if any("control" in f for f in files)}
    assert "INVALID_COMMAND" in control
    nacks = sections(contract_text())[5].split(CANCEL_HEADING)[0]
    assert code_problems(nacks, control, "section 5") == []


CANCEL_HEADING = "### Cancel and reschedule"


def table_column(text: str, heading: str) -> set[str]:
    """The code spans in the first column of the table whose header row starts with `heading`."""
    found: set[str] = set()
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            rows = None
        elif rows is None:
            rows = [] if cells[0] == heading else None
        else:
            found.update(spans(cells[0]))
    return found


def outcome_problems(text: str) -> list[str]:
    """The outcome table against the outcomes an OutcomeRecord can carry (its type's values)."""
    values, documented = set(get_args(Outcome)), table_column(text, "outcome")
    return [f"outcome {o!r} is not in the outcome table" for o in sorted(values - documented)] + [
        f"outcome {o!r} is in the outcome table but no OutcomeRecord carries it" for o in sorted(documented - values)
    ]


def test_every_cancel_outcome_and_code_is_documented() -> None:
    """The outcomes are the values OutcomeRecord.outcome can take, and the module's constants name
    exactly those: the outcome table must list them, and nothing more. The codes are the module's
    constants."""
    text = sections(contract_text())[5].split(CANCEL_HEADING)[1]
    codes = {v for k, v in vars(cancels).items() if k == v and isinstance(v, str) and _ERROR_CODE.fullmatch(v)}
    assert {"INVALID_COMMAND", "FIXED_DELAY_TOPIC", "DEAD_LETTERED"} <= codes
    assert code_problems(text, codes, "cancel codes") == []
    assert {CANCELLED, RESCHEDULED, TOO_LATE, REJECTED, UNKNOWN_MESSAGE_OUTCOME} == set(get_args(Outcome))
    assert outcome_problems(text) == []


# ---------------------------------------------------------------------------------------------------
# The checks must fail on a drifted contract


def test_the_checks_report_a_drifted_contract() -> None:
    """Each check, run on the real contract with one fact taken out, must name what went missing."""
    doc = contract_text()
    parts = sections(doc)

    renumbered = doc.replace("## 5. ", "## 8. ", 1)
    assert missing_sections(renumbered, {"x.py:1": {5}}) == ["x.py:1 cites section 5"]

    without_metric = "\n".join(line for line in parts[7].splitlines() if "`delay_sidecar_nack_total`" not in line)
    assert metric_problems(without_metric, registered_metrics()) == [
        "delay_sidecar_nack_total is not in the metrics table"
    ]
    relabelled = parts[7].replace(
        "| `delay_sidecar_nack_total` | counter | `subscription`, ", "| `delay_sidecar_nack_total` | counter | "
    )
    assert [p.split(":")[0] for p in metric_problems(relabelled, registered_metrics())] == ["delay_sidecar_nack_total"]

    run_table = subsection(parts[6], "`run`")
    flags = long_flags(commands()["run"])
    without_flag = "\n".join(line for line in run_table.splitlines() if "`--linger-ms`" not in line)
    assert flag_problems(without_flag, flags) == ["--linger-ms is not in the run table"]
    wrong_env = run_table.replace("`DELAY_SIDECAR_LINGER_MS`", "`DELAY_SIDECAR_LINGER`")
    assert flag_problems(wrong_env, flags) == ["--linger-ms: its row does not name DELAY_SIDECAR_LINGER_MS"]

    facts = other_commands()
    known = set(other_command_problems(parts[6], facts))  # (what the contract lacks now is another test's)

    def drifted(section6: str) -> list[str]:
        return sorted(set(other_command_problems(section6, facts)) - known)

    without_variable = parts[6].replace("`DELAY_SIDECAR_NODES`", "the nodes variable")
    assert drifted(without_variable) == ["broker --nodes: DELAY_SIDECAR_NODES is not in its part"]
    # `--policies` is still in section 6 (run's table, demo's bullet): only its own part counts.
    without_flag = parts[6].replace("delay-sidecar policies show TOPIC [--json] [--policies PATH]",
                                    "delay-sidecar policies show TOPIC [--json]")  # fmt: skip
    assert drifted(without_flag) == ["policies show --policies is not in its part"]
    borrowed = parts[6].replace("  - `--records`: 2 to 11", "  - `--records` and `--nodes`: 2 to 11")
    assert drifted(borrowed) == ["demo --nodes is in its part but not a flag of demo"]

    cancel_text = parts[5].split(CANCEL_HEADING)[1]
    assert outcome_problems(cancel_text.replace("| `too-late` |", "| `too_late` |")) == [
        "outcome 'too-late' is not in the outcome table",
        "outcome 'too_late' is in the outcome table but no OutcomeRecord carries it",
    ]

    codes = sidecar_codes().codes
    without_code = "\n".join(line for line in parts[3].splitlines() if not line.startswith("| `TOPIC_REMOVED`"))
    assert code_problems(without_code, codes, "section 3") == ["TOPIC_REMOVED is not in the section 3 table"]
    assert code_problems(parts[3], [*codes, "BRAND_NEW"], "section 3") == ["BRAND_NEW is not in the section 3 table"]
