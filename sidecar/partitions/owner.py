"""Which member of the sidecar's consumer group owns a partition, and where its metrics port is.

For the message lookup: a member asked about a partition it does not own names the owner, and
`delay-sidecar messages show` asks the owner directly. The owner asks the other members for the
message's nacks: a nack lies with the owner of the control partition it came on. Members put their
metrics port in their client.id (`delay-sidecar@PORT`), which the group description reports with
the member's host.
"""

import base64
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from sidecar.errors import SidecarError
from sidecar.kafka_io import LIBRDKAFKA
from sidecar.partitions.lookup import Whereabouts, with_nacks

logger = logging.getLogger(__name__)

CLIENT_ID_PREFIX = "delay-sidecar@"


def client_id(metrics_port: int) -> str:
    return f"{CLIENT_ID_PREFIX}{metrics_port}"


def find_owner(client_config: dict[str, Any], group_id: str, topic: str, partition: int) -> dict[str, Any] | None:
    """The owning member as {member_id, client_id, host, instance_id, metrics_port}; None when no member
    owns it now or the group cannot be described."""
    for member, assigned in _members(client_config, group_id):
        if any(tp.topic == topic and tp.partition == partition for tp in assigned):
            return member
    return None


def partition_count(client_config: dict[str, Any], topic: str) -> int:
    """How many partitions the topic has: where a key may be (control.key_partitions)."""
    admin = AdminClient({k: v for k, v in client_config.items() if k != "error_cb"}, logger=LIBRDKAFKA)
    try:
        found = admin.list_topics(topic, timeout=10).topics.get(topic)
    except KafkaException as e:
        raise SidecarError(f"cannot read the metadata of topic {topic!r} ({e}); check --bootstrap-servers") from None
    if found is None or found.error is not None or not found.partitions:
        raise SidecarError(f"topic {topic!r} does not exist on this cluster; check its name")
    return len(found.partitions)


def group_members(client_config: dict[str, Any], group_id: str) -> list[dict[str, Any]]:
    """Every member, as `find_owner` gives one; empty when the group cannot be described."""
    return [member for member, _ in _members(client_config, group_id)]


def _members(client_config: dict[str, Any], group_id: str) -> list[tuple[dict[str, Any], list[Any]]]:
    admin = AdminClient({k: v for k, v in client_config.items() if k != "error_cb"}, logger=LIBRDKAFKA)
    try:
        description = admin.describe_consumer_groups([group_id], request_timeout=10)[group_id].result(timeout=15)
    except (KafkaException, TimeoutError) as e:
        logger.warning("cannot describe the consumer group group=%s error=%s", group_id, e)
        return []
    found = []
    for member in description.members:
        port = None
        if member.client_id.startswith(CLIENT_ID_PREFIX) and member.client_id[len(CLIENT_ID_PREFIX) :].isdigit():
            port = int(member.client_id[len(CLIENT_ID_PREFIX) :])
        about = {
            "member_id": member.member_id,
            "client_id": member.client_id,
            "host": member.host.lstrip("/"),
            "instance_id": member.group_instance_id,
            "metrics_port": port,
        }
        found.append((about, member.assignment.topic_partitions if member.assignment is not None else []))
    return found


def ask(
    host: str, port: int, topic: str, partition: int, asked: int | bytes, scope: str | None = None
) -> dict[str, Any]:
    """A member's GET /messages/... about an offset, or a key of a keyed topic; `scope="member"`:
    only what that member holds (its nacks)."""
    url = f"http://{host}:{port}/messages/{urllib.parse.quote(topic)}/{partition}"
    query = {} if scope is None else {"scope": scope}
    if isinstance(asked, int):
        url += f"/{asked}"
    else:
        query["key_base64"] = base64.b64encode(asked).decode()
    if query:
        url += "?" + urllib.parse.urlencode(query)
    try:
        with urllib.request.urlopen(url, timeout=15) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except urllib.error.HTTPError as e:
        raise SidecarError(f"{url} answered {e.code}: {e.read().decode(errors='replace')}") from None
    except OSError as e:
        raise SidecarError(f"cannot reach {url} ({e}); is the owner's --metrics-host reachable from here?") from None


def nacks_body(found: Whereabouts) -> dict[str, Any]:
    """GET /messages/...?scope=member: the message's nacks pending at this member."""
    return {sub: {"deliver_at": at, "redelivery_count": count} for sub, (at, count) in found.nacks.items()}


def with_members_nacks(
    client_config: dict[str, Any], group_id: str, found: Whereabouts, topic: str, partition: int, offset: int
) -> dict[str, Any]:
    """The owner's answer with the nacks the other members hold. A member that cannot be asked is
    listed under `unreachable`: its nacks, if any, are missing from the answer."""
    answer = found.answer
    assert answer is not None
    for member in group_members(client_config, group_id):
        if member["member_id"] == found.member_id:
            continue
        where = f"{member['host'] or '127.0.0.1'}:{member['metrics_port']}"
        try:
            if member["metrics_port"] is None:
                raise SidecarError(f"member {member['client_id']!r} does not say its metrics port")
            body = ask(member["host"] or "127.0.0.1", member["metrics_port"], topic, partition, offset, "member")
            nacks = {sub: (int(n["deliver_at"]), int(n["redelivery_count"])) for sub, n in body["nacks"].items()}
        except (SidecarError, KeyError, TypeError, ValueError, AttributeError) as e:
            logger.warning("a member's nacks unknown to the lookup member=%s error=%s", where, e)
            answer.setdefault("unreachable", []).append(where)
            continue
        answer = with_nacks(answer, nacks)
    return answer
