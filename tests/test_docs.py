"""The README and the docs site stay usable: a README read in minutes, no picture left behind that no
page shows, and a runbook section for every alert someone can receive.

`mkdocs build --strict` (./scripts/test.sh) already fails on broken links and missing pages; these
are the checks it cannot make. Pure: no broker.
"""

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DEPLOY = ROOT / "deploy"
RUNBOOK = DOCS / "operations" / "runbook.md"

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
