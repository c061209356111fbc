"""Which member of the sidecar's consumer group owns a partition, and where its metrics port is.

For the message lookup: a member asked about a partition it does not own names the owner, and
`delay-sidecar messages show` asks the owner directly. Members put their metrics port in their
client.id (`delay-sidecar@PORT`), which the group description reports with the member's host.
"""

import logging
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from sidecar.kafka_io import LIBRDKAFKA

logger = logging.getLogger(__name__)

CLIENT_ID_PREFIX = "delay-sidecar@"


def client_id(metrics_port: int) -> str:
    return f"{CLIENT_ID_PREFIX}{metrics_port}"


def find_owner(client_config: dict[str, Any], group_id: str, topic: str, partition: int) -> dict[str, Any] | None:
    """The owning member as {member_id, client_id, host, instance_id, metrics_port}; None when no member
    owns it now or the group cannot be described."""
    admin = AdminClient({k: v for k, v in client_config.items() if k != "error_cb"}, logger=LIBRDKAFKA)
    try:
        description = admin.describe_consumer_groups([group_id], request_timeout=10)[group_id].result(timeout=15)
    except (KafkaException, TimeoutError) as e:
        logger.warning("cannot describe the consumer group group=%s error=%s", group_id, e)
        return None
    for member in description.members:
        assigned = member.assignment.topic_partitions if member.assignment is not None else []
        if any(tp.topic == topic and tp.partition == partition for tp in assigned):
            port = None
            if member.client_id.startswith(CLIENT_ID_PREFIX) and member.client_id[len(CLIENT_ID_PREFIX) :].isdigit():
                port = int(member.client_id[len(CLIENT_ID_PREFIX) :])
            return {
                "member_id": member.member_id,
                "client_id": member.client_id,
                "host": member.host.lstrip("/"),
                "instance_id": member.group_instance_id,
                "metrics_port": port,
            }
    return None
