"""Policy problems as data, so `validate` can print one line each and /healthz can name the file and key."""

from collections.abc import Iterable
from dataclasses import dataclass

from sidecar.errors import ConfigError


@dataclass(frozen=True)
class Problem:
    """One thing an operator must fix: where (file, line, key path) and what was expected there."""

    file: str
    key: str
    """Dotted key path in the file (`topics.payments.orders.delayed_delivery`); empty for the whole file."""
    expected: str
    line: int | None = None
    """1-based line of the key when it could be located, so editors can jump to it."""

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.key}: {self.expected}" if self.key else f"{where}: {self.expected}"


class PolicyError(ConfigError):
    """The policies cannot be loaded; `problems` lists every problem found, not only the first."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
