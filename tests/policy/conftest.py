"""Helpers shared by the policy tests: write YAML (from text or from data) into tmp_path."""

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML


def dump_yaml(data: Any) -> str:
    out = io.StringIO()
    YAML(typ="safe", pure=True).dump(data, out)
    return out.getvalue()


WriteYaml = Callable[..., Path]


@pytest.fixture
def write_yaml(tmp_path: Path) -> WriteYaml:
    """write_yaml(name, text_or_data) -> path of the written file in tmp_path."""

    def write(name: str, content: str | dict[str, Any]) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else dump_yaml(content), encoding="utf-8")
        return path

    return write
