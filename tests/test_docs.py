"""The README and the docs site stay usable: a README read in minutes, no picture left behind that no
page shows, every page reachable from the site's navigation, and a runbook section for every alert
someone can receive.

`mkdocs build --strict` (./scripts/test.sh) already fails on broken links and missing pages; these
are the checks it cannot make, and the nav check again (mkdocs' `validation.omitted_files`), so that
a page left out of the nav fails here too, where a test run names it. The command-line page is
checked against the program's own `--help`. No broker.
"""

import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DEPLOY = ROOT / "deploy"
MKDOCS = ROOT / "mkdocs.yml"
RUNBOOK = DOCS / "operations" / "runbook.md"
MONITORING = DOCS / "operations" / "monitoring.md"

README_MAX_LINES = 200
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"})

# ![alt](path "title") and <img src="path">: what a page shows, not what it merely links to.
_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_IMAGE = re.compile(r"<img\b[^>]*\bsrc=[\"']([^\"']+)[\"']", re.IGNORECASE)
_YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^#{2,3} +`?([A-Za-z][\w-]*)`?\s*$", re.MULTILINE)


def test_readme_is_at_most_200_lines() -> None:
    """Five minutes of reading; the rest belongs on the site, where it can be found."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move sections to docs/"


_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")


def broken_links(page: Path) -> list[str]:
    """Relative links and images of a Markdown file outside the site that point at no file (mkdocs checks
    only the pages under docs/)."""
    text = page.read_text(encoding="utf-8")
    targets = (t.split("#", 1)[0] for t in _LINK.findall(text) if "://" not in t and not t.startswith("mailto:"))
    return sorted({t for t in targets if t and not (page.parent / t).exists()})


def test_the_readme_links_into_the_site() -> None:
    """The README is read on the repository's page, where mkdocs' link check does not reach: a page that
    moves must not leave it pointing nowhere."""
    readme = ROOT / "README.md"
    assert sum("](docs/" in line for line in readme.read_text(encoding="utf-8").splitlines()) >= 10
    assert broken_links(readme) == []


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# here\n")
    page = tmp_path / "README.md"
    page.write_text("[a](docs/here.md#x) [b](docs/gone.md) [c](https://example.org/x.md) ![d](docs/gone.png)\n")
    assert broken_links(page) == ["docs/gone.md", "docs/gone.png"]


def test_the_readme_keeps_the_two_commands_ci_runs() -> None:
    """CI (.ci/run) runs the README's test command on a clean clone; fresh machines follow the README."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^\./scripts/run\.sh +#", readme, re.MULTILINE)
    assert re.search(r"^\./scripts/test\.sh +#", readme, re.MULTILINE)
    assert "exec ./scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------
# Images


def shown_images(docs: Path) -> set[Path]:
    """Every image file a page under `docs` shows, resolved against the page's own folder."""
    shown: set[Path] = set()
    for page in docs.rglob("*.md"):
        text = page.read_text(encoding="utf-8")
        for target in [*_MARKDOWN_IMAGE.findall(text), *_HTML_IMAGE.findall(text)]:
            if "://" not in target:
                shown.add((page.parent / target.split("#", 1)[0]).resolve())
    return shown


def unshown_images(docs: Path) -> list[str]:
    images = {p.resolve() for p in docs.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES}
    return sorted(str(p.relative_to(docs.resolve())) for p in images - shown_images(docs))


def test_every_image_under_docs_is_shown_by_a_page() -> None:
    """A chart no page shows is a leftover of an old run: it misleads whoever finds it."""
    assert any(DOCS.rglob("*.png")), "no image found: the scan, not the tree, broke"
    assert unshown_images(DOCS) == []


def test_the_image_check_finds_an_unshown_image(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "shown.png").write_bytes(b"x")
    (tmp_path / "sub" / "also-shown.svg").write_bytes(b"x")
    (tmp_path / "linked-only.png").write_bytes(b"x")
    (tmp_path / "sub" / "page.md").write_text(
        '![a](../shown.png "title") <img alt="b" src="also-shown.svg"> [not shown](../linked-only.png)\n'
    )
    assert unshown_images(tmp_path) == ["linked-only.png"]


# ---------------------------------------------------------------------------------------------------
# Pages and the navigation


def _nav_pages(entry: Any) -> Iterator[str]:
    """The page paths in mkdocs.yml's `nav`, at any depth (a section is a mapping to a list)."""
    if isinstance(entry, str):
        if "://" not in entry:
            yield entry
    elif isinstance(entry, dict):
        for value in entry.values():
            yield from _nav_pages(value)
    elif isinstance(entry, list):
        for item in entry:
            yield from _nav_pages(item)


def _patterns(value: Any) -> list[str]:
    """mkdocs' `exclude_docs` and `not_in_nav`: gitignore-style lines; these use plain paths and folders."""
    return [line.strip() for line in str(value or "").splitlines() if line.strip() and not line.startswith("#")]


def _matches(page: str, patterns: list[str]) -> bool:
    return any(
        page.startswith(pattern) if pattern.endswith("/") else fnmatch.fnmatch(page, pattern.lstrip("/"))
        for pattern in patterns
    )


def pages_outside_nav(docs: Path, config: Any) -> list[str]:
    """Pages under `docs` that the nav does not list and the config does not set aside on purpose."""
    listed = set(_nav_pages(config.get("nav")))
    aside = _patterns(config.get("exclude_docs")) + _patterns(config.get("not_in_nav"))
    pages = (p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    return sorted(p for p in pages if p not in listed and not _matches(p, aside))


def _mkdocs_config() -> Any:
    # The round-trip loader keeps the `!!python/name:` tag of the mermaid fence as a tagged value.
    return YAML(typ="rt").load(MKDOCS.read_text(encoding="utf-8"))


def test_every_page_is_in_the_nav_or_set_aside() -> None:
    """A page missing from the nav can only be found by a link or a search: a newcomer never finds it."""
    config = _mkdocs_config()
    assert "contract.md" in set(_nav_pages(config["nav"])), "the nav scan, not the config, broke"
    assert pages_outside_nav(DOCS, config) == []


def test_pages_set_aside_are_still_linked() -> None:
    """A page kept out of the nav on purpose (the benchmarks' dated history) is reached from another page."""
    config = _mkdocs_config()
    texts = {p: p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md")}
    for pattern in _patterns(config.get("not_in_nav")):
        aside = [p for p in texts if _matches(p.relative_to(DOCS).as_posix(), [pattern])]
        assert aside, f"not_in_nav names {pattern}, which matches no page"
        for page in aside:
            linked_from = [p for p, text in texts.items() if p != page and f"]({page.name}" in text]
            assert linked_from, f"{page.relative_to(DOCS)} is in no nav and no page links to it"


def test_the_nav_check_finds_a_page_outside_it(tmp_path: Path) -> None:
    for page in ("index.md", "a/listed.md", "a/forgotten.md", "history.md", "hooks/notes.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("# page\n")
    config = {
        "nav": [{"Home": "index.md"}, {"Section": [{"Listed": "a/listed.md"}, {"Out": "https://example.org"}]}],
        "exclude_docs": "hooks/\n",
        "not_in_nav": "history.md\n",
    }
    assert pages_outside_nav(tmp_path, config) == ["a/forgotten.md"]


# ---------------------------------------------------------------------------------------------------
# Alerts and their runbook


def _alerts_in(document: Any) -> Iterator[str]:
    """Alert names in a Prometheus rule file (`groups[].rules[].alert`), a Grafana alert rule
    provisioning file (`groups[].rules[].title`), or a dashboard with legacy panel alerts."""
    if isinstance(document, dict):
        for group in document.get("groups") or []:
            for rule in (group or {}).get("rules") or []:
                name = rule.get("alert") or rule.get("title")
                if name:
                    yield str(name)
        for panel in document.get("panels") or []:
            alert = (panel or {}).get("alert")
            if isinstance(alert, dict) and alert.get("name"):
                yield str(alert["name"])


def _documents(path: Path) -> Iterable[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return [json.loads(text)]
    return list(YAML(typ="safe").load_all(text))


def deploy_alerts() -> set[str]:
    found: set[str] = set()
    for path in sorted(DEPLOY.rglob("*")):
        if path.suffix in {".yml", ".yaml", ".json"}:
            for document in _documents(path):
                found.update(_alerts_in(document))
    return found


def runbook_alerts(text: str) -> set[str]:
    """The alerts of the rule groups the runbook itself proposes."""
    found: set[str] = set()
    for block in _YAML_BLOCK.findall(text):
        for document in YAML(typ="safe").load_all(block):
            found.update(_alerts_in(document))
    return found


def missing_runbook_sections(text: str, alerts: Iterable[str]) -> list[str]:
    sections = set(_HEADING.findall(text))
    return sorted(set(alerts) - sections)


def test_every_alert_has_a_runbook_section() -> None:
    """Whoever is paged reads the section named after the alert: one missing leaves them guessing."""
    text = RUNBOOK.read_text(encoding="utf-8")
    alerts = deploy_alerts() | runbook_alerts(text)
    assert "DelaySidecarLate" in alerts, "no alert found in the runbook's rules: the scan, not the page, broke"
    assert missing_runbook_sections(text, alerts) == []


def test_the_runbook_check_finds_a_missing_section(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text("groups:\n  - name: g\n    rules:\n      - alert: Shipped\n        expr: up == 0\n")
    dashboard = tmp_path / "dashboard.json"
    dashboard.write_text(json.dumps({"panels": [{"alert": {"name": "FromPanel"}}, {"title": "no alert"}]}))
    found = {name for path in (rules, dashboard) for doc in _documents(path) for name in _alerts_in(doc)}
    assert found == {"Shipped", "FromPanel"}
    page = "# Runbook\n\n## Shipped\n\ntext\n"
    assert missing_runbook_sections(page, found) == ["FromPanel"]


# ---------------------------------------------------------------------------------------------------
# The dashboard


def dashboard_panels() -> list[str]:
    titles: list[str] = []
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text(encoding="utf-8")).get("panels") or []:
            if panel.get("type") != "row" and panel.get("title"):
                titles.append(str(panel["title"]))
    return titles


def test_every_dashboard_panel_is_explained() -> None:
    """What to monitor names each panel of the shipped dashboard by its title, so a reader looking at a
    panel can find what it shows; a panel added to the dashboard and not to the page fails here."""
    titles = dashboard_panels()
    assert titles, "no panel found: the scan, not the dashboard, broke"
    text = MONITORING.read_text(encoding="utf-8")
    assert [t for t in titles if f"**{t}**" not in text] == []


# ---------------------------------------------------------------------------------------------------
# The command-line page


def _reference_hook() -> ModuleType:
    path = DOCS / "hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("docs_reference_hook", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_page_shows_what_each_command_prints() -> None:
    """The hook builds the page from the parser in-process (one import, not a process per command); this
    checks that it prints, for every command, exactly what `python -m sidecar CMD --help` prints."""
    hook = _reference_hook()
    page = {name: hook._help(parser) for name, parser in hook._parsers()}
    assert {"delay-sidecar run", "delay-sidecar messages show"} <= set(page), "the hook found no commands"
    env = {**os.environ, "COLUMNS": hook.HELP_COLUMNS}
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "sidecar", *name.split()[1:], "--help"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in page
    }
    printed = {name: run.communicate(timeout=120)[0].rstrip() for name, run in runs.items()}
    assert {name: run.returncode for name, run in runs.items()} == dict.fromkeys(page, 0)
    assert [name for name in page if printed[name] != page[name]] == []
