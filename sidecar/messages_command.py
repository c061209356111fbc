"""`delay-sidecar messages show TOPIC/PARTITION/OFFSET` (or `TOPIC --key KEY`): where is this message,
asked of the sidecar that owns it.

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

from sidecar.control.cancels import message_key
from sidecar.control.key_partitions import key_partitions
from sidecar.errors import ConfigError, RejectedRecord, SidecarError
from sidecar.partitions.owner import ask, find_owner, partition_count
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
    where = f"{answer['topic']}/{answer['partition']}"
    if "offset" in answer:
        where += f"/{answer['offset']}"
    lines = [f"{where}: {answer['state']}"]
    for key in ("key", "key_base64", "reason", "code", "message"):
        if answer.get(key):
            lines.append(f"  {key}: {answer[key]}")
    if answer.get("publish_ms") is not None:
        lines.append(f"  published: {_when(answer['publish_ms'])}")
    for name, sub in sorted((answer.get("subscriptions") or {}).items()):
        moved = " (rescheduled)" if sub.get("rescheduled") else ""
        if sub.get("nack"):
            moved = f" (nack, redelivery {sub.get('redelivery_count')})"
        if sub.get("newest_offset") is not None:
            moved = f" (by offset {sub['newest_offset']})"
        lines.append(f"  {name}: {sub['state']}{moved} {_when(sub.get('deliver_at'))}")
    return "\n".join(lines)


class ShowMessageCommand(KafkaSettings):
    """Print where a message is: pending (and until when), delivered, cancelled, replaced or dead-lettered."""

    message_id: CliPositionalArg[str] = Field(
        description="TOPIC/PARTITION/OFFSET, as in orders/3/1042; or TOPIC with --key or --key-base64"
    )
    key: str | None = Field(
        None, description="on a keyed topic (by_key: replace): the key, as UTF-8 text, whose newest record to show"
    )
    key_base64: str | None = Field(None, description="the key in base64 (RFC 4648, padded), for a binary key")
    group_id: str = Field("delay-sidecar", description="the sidecars' consumer group")
    metrics_port: int = Field(
        9464, ge=1, le=65535, description="metrics port of the owner when its client.id does not say"
    )
    json_output: CliToggleFlag[bool] = Field(False, alias="json", description="print JSON, as GET /messages/...")

    def cli_cmd(self) -> None:
        try:
            if not self.bootstrap_servers:
                raise ConfigError("give --bootstrap-servers HOST:PORT of the sidecars' cluster")
            config = self.client_config(self.bootstrap_servers)
            key = self._key()
            if key is None:
                topic, partition, offset = parse_message_id(self.message_id)
                answers = [self._ask(config, topic, partition, offset)]
            else:
                topic = self.message_id
                answers = [
                    self._ask(config, topic, p, key) for p in key_partitions(key, partition_count(config, topic))
                ]
                known = [a for a in answers if a.get("state") != "unknown"]
                answers = known or answers[:1]  # the partitions a producer placed the key in; else one says so
            for answer in answers:
                print(json.dumps(answer, indent=2) if self.json_output else format_answer(answer))
        except SidecarError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(EXIT_ERROR) from None

    def _key(self) -> bytes | None:
        if self.key is None and self.key_base64 is None:
            return None
        try:
            key = message_key({"key": self.key} if self.key is not None else {"key_base64": self.key_base64})
        except RejectedRecord as e:
            raise ConfigError(f"--key/--key-base64: {e.message}") from None
        if (self.key is not None and self.key_base64 is not None) or not key:
            raise ConfigError("give --key TEXT or --key-base64 B64 (a non-empty key), not both")
        if "/" in self.message_id:
            raise ConfigError(f"with --key, give the topic alone, not {self.message_id!r}")
        return key

    def _ask(self, config: dict[str, Any], topic: str, partition: int, asked: int | bytes) -> dict[str, Any]:
        owner = find_owner(config, self.group_id, topic, partition)
        if owner is None:
            raise SidecarError(
                f"no member of group {self.group_id!r} owns {topic}/{partition} now; check --group-id, "
                "and that the topic is in the sidecars' policies"
            )
        return ask(owner["host"] or "127.0.0.1", owner["metrics_port"] or self.metrics_port, topic, partition, asked)


class MessagesCommand(BaseModel):
    """Ask where a message is."""

    show: CliSubCommand[ShowMessageCommand] = Field(
        description="the fate of one message, from the sidecar that owns it"
    )

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)
