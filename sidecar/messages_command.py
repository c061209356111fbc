"""`delay-sidecar messages show TOPIC/PARTITION/OFFSET`: where is this message, asked of the sidecar that owns it.

The consumer group says which member owns the partition and its host; the member's client.id carries
its metrics port (partitions/owner.py). The answer is that member's GET /messages/... (contract
section 7), printed for a person or as JSON.
"""

import json
import sys
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field
from pydantic_settings import CliApp, CliPositionalArg, CliSubCommand, CliToggleFlag

from sidecar.errors import ConfigError, SidecarError
from sidecar.partitions.owner import ask, find_owner
from sidecar.settings import KafkaSettings

EXIT_ERROR = 2


def parse_message_id(text: str) -> tuple[str, int, int]:
    parts = text.rsplit("/", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        raise ConfigError(f"{text!r} is not a message id; give TOPIC/PARTITION/OFFSET, as in orders/3/1042")
    return parts[0], int(parts[1]), int(parts[2])


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def format_answer(answer: dict[str, Any]) -> str:
    lines = [f"{answer['topic']}/{answer['partition']}/{answer['offset']}: {answer['state']}"]
    for key in ("reason", "code", "message"):
        if answer.get(key):
            lines.append(f"  {key}: {answer[key]}")
    if answer.get("publish_ms") is not None:
        lines.append(f"  published: {_when(answer['publish_ms'])}")
    for name, sub in sorted((answer.get("subscriptions") or {}).items()):
        moved = " (rescheduled)" if sub.get("rescheduled") else ""
        if sub.get("nack"):
            moved = f" (nack, redelivery {sub.get('redelivery_count')})"
        lines.append(f"  {name}: {sub['state']}{moved} {_when(sub.get('deliver_at'))}")
    return "\n".join(lines)


class ShowMessageCommand(KafkaSettings):
    """Print where a message is: pending (and until when), delivered, cancelled or dead-lettered."""

    message_id: CliPositionalArg[str] = Field(description="TOPIC/PARTITION/OFFSET, as in orders/3/1042")
    group_id: str = Field("delay-sidecar", description="the sidecars' consumer group")
    metrics_port: int = Field(
        9464, ge=1, le=65535, description="metrics port of the owner when its client.id does not say"
    )
    json_output: CliToggleFlag[bool] = Field(False, alias="json", description="print JSON, as GET /messages/...")

    def cli_cmd(self) -> None:
        try:
            if not self.bootstrap_servers:
                raise ConfigError("give --bootstrap-servers HOST:PORT of the sidecars' cluster")
            topic, partition, offset = parse_message_id(self.message_id)
            owner = find_owner(self.client_config(self.bootstrap_servers), self.group_id, topic, partition)
            if owner is None:
                raise SidecarError(
                    f"no member of group {self.group_id!r} owns {topic}/{partition} now; check --group-id, "
                    "and that the topic is in the sidecars' policies"
                )
            answer = ask(
                owner["host"] or "127.0.0.1", owner["metrics_port"] or self.metrics_port, topic, partition, offset
            )
            print(json.dumps(answer, indent=2) if self.json_output else format_answer(answer))
        except SidecarError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(EXIT_ERROR) from None


class MessagesCommand(BaseModel):
    """Ask where a message is."""

    show: CliSubCommand[ShowMessageCommand] = Field(
        description="the fate of one message, from the sidecar that owns it"
    )

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
