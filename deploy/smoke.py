"""Smoke test of a running deploy/docker-compose.yml: delayed records in, each out once and never early.

Run by deploy/smoke.sh (CI: .github/workflows/kafka.yml) after
`docker compose -f deploy/docker-compose.yml up -d --build`. The defaults are that file's ports:

1. wait until every sidecar's /healthz answers 200 and their consumer group is stable with all of them;
2. produce --records records with `deliver-after` delays of --min-delay-s to --max-delay-s to an
   inbound topic of the policies the sidecars run (default `orders`);
3. once the last one is due, read every outbound topic of that topic's subscriptions from the start
   to its high watermark (read_committed), again until nothing is missing or --deliver-timeout-s passes;
4. check that each record arrived once on each outbound topic, not before its deliver-at (the
   outbound record's timestamp is when the sidecar delivered it), with the `delay-deliver-at` the
   contract promises; print the counts; exit 1 when a check fails, 2 when the cluster never got ready.

Records are told apart from earlier runs by their origin (inbound partition and offset), so the
script can run again on the same cluster.
"""

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from sidecar.client import delay_headers, deliver_at, origin, outbound_consumer_config, redelivery_count
from sidecar.policy import load_policies
from sidecar.policy.model import SubscriptionRoute

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_BOOTSTRAP = "localhost:9092,localhost:9093,localhost:9094"
COMPOSE_HEALTH = ",".join(f"http://localhost:{port}/healthz" for port in (9464, 9465, 9466))


class SmokeError(Exception):
    """The cluster never became ready, or the policies do not allow the test: exit 2."""


@dataclass(frozen=True)
class Sent:
    """One inbound record as the broker stored it."""

    index: int
    timestamp_ms: int
    delay_ms: int


@dataclass
class Tally:
    """What one outbound topic got of this run's records."""

    topic: str
    expected: int
    copies: Counter[tuple[int, int]] = field(default_factory=Counter)
    early: int = 0
    wrong_deliver_at: int = 0
    redelivered: int = 0
    lateness_ms: list[int] = field(default_factory=list)

    @property
    def once(self) -> int:
        return sum(1 for n in self.copies.values() if n == 1)

    @property
    def duplicated(self) -> int:
        return sum(1 for n in self.copies.values() if n > 1)

    @property
    def missing(self) -> int:
        return self.expected - len(self.copies)

    @property
    def ok(self) -> bool:
        return (
            self.once == self.expected
            and self.duplicated == 0
            and self.early == 0
            and self.wrong_deliver_at == 0
            and self.redelivered == 0
        )


def log(message: str) -> None:
    print(f"smoke: {message}", file=sys.stderr, flush=True)


def wait_until(what: str, check: Callable[[], str | None], timeout_s: float, every_s: float = 2.0) -> None:
    """Call `check` until it returns None (done); it returns why it is not done yet, logged now and then."""
    deadline = time.monotonic() + timeout_s
    last_logged = 0.0
    while True:
        reason = check()
        if reason is None:
            log(f"{what}: yes")
            return
        if time.monotonic() >= deadline:
            raise SmokeError(f"{what}: not after {timeout_s:.0f}s ({reason})")
        if time.monotonic() - last_logged >= 15:
            log(f"{what}: not yet ({reason})")
            last_logged = time.monotonic()
        time.sleep(every_s)


def health_problem(urls: list[str]) -> str | None:
    """None when every /healthz answers 200, else what the first one that does not says."""
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                if response.status == 200:
                    continue
                return f"{url}: HTTP {response.status}"
        except urllib.error.HTTPError as e:
            try:
                reasons = json.loads(e.read()).get("reasons")
            except ValueError:
                reasons = None
            return f"{url}: HTTP {e.code} {reasons or ''}".strip()
        except OSError as e:
            return f"{url}: {e}"
    return None


def group_problem(admin: AdminClient, group: str, members: int) -> str | None:
    """None when the group is stable with at least `members` members."""
    try:
        description = admin.describe_consumer_groups([group], request_timeout=10)[group].result()
    except Exception as e:
        return f"cannot describe group {group}: {e}"
    state = description.state.name
    if state != "STABLE" or len(description.members) < members:
        return f"group {group} is {state} with {len(description.members)} of {members} members"
    return None


def partition_count(admin: AdminClient, topic: str) -> int:
    metadata = admin.list_topics(topic, timeout=10).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        return 0
    return len(metadata.partitions)


def delays_ms(count: int, low_s: float, high_s: float) -> list[int]:
    """`count` delays spread evenly over [low, high], in an order that mixes short and long ones."""
    low, high = round(low_s * 1000), round(high_s * 1000)
    step = (high - low) / max(count - 1, 1)
    spread = [low + round(i * step) for i in range(count)]
    return [spread[(i * 7919) % count] for i in range(count)] if count % 7919 else spread


def produce(bootstrap: str, topic: str, run_id: str, delays: list[int]) -> dict[tuple[int, int], Sent]:
    """Produce one record per delay; returns each by its inbound (partition, offset)."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    sent: dict[tuple[int, int], Sent] = {}
    failures: list[str] = []

    def delivered(error: KafkaError | None, message: Any, index: int, delay: int) -> None:
        if error is not None:
            failures.append(str(error))
            return
        sent[(message.partition(), message.offset())] = Sent(index, message.timestamp()[1], delay)

    for index, delay in enumerate(delays):
        value = json.dumps({"run": run_id, "index": index, "deliver_after_ms": delay}).encode()
        producer.produce(
            topic,
            value,
            key=f"{run_id}-{index}".encode(),
            headers=delay_headers(deliver_after=delay),
            timestamp=int(time.time() * 1000),
            on_delivery=lambda e, m, i=index, d=delay: delivered(e, m, i, d),
        )
        producer.poll(0)
    remaining = producer.flush(60)
    if failures or remaining:
        raise SmokeError(f"producing to {topic} failed: {remaining} unsent, errors {sorted(set(failures))[:3]}")
    return sent


def read_to_high_watermark(bootstrap: str, topics: list[str], timeout_s: float = 60) -> list[Any]:
    """Every record of every partition of `topics`, from the start to its high watermark now."""
    consumer = Consumer(
        outbound_consumer_config(
            bootstrap, f"delay-sidecar-smoke-{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": True}
        )
    )
    try:
        ends: dict[tuple[str, int], int] = {}
        for topic in topics:
            for partition in consumer.list_topics(topic, timeout=10).topics[topic].partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
                if high > low:
                    ends[(topic, partition)] = high
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in ends])
        records: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise SmokeError(f"outbound partitions not read to their high watermark: {sorted(ends)}")
            for message in consumer.consume(1000, 0.5):
                where = (message.topic(), message.partition())
                if message.error() is not None:
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise SmokeError(f"reading {where}: {message.error()}")
                    if where in ends and message.offset() >= ends[where]:
                        del ends[where]
                    continue
                if message.offset() < ends.get(where, -1):
                    records.append(message)
                    if message.offset() + 1 >= ends[where]:
                        del ends[where]
        return records
    finally:
        consumer.close()


def tally(
    inbound: str, subscriptions: list[SubscriptionRoute], sent: dict[tuple[int, int], Sent], records: list[Any]
) -> dict[str, Tally]:
    tallies = {s.outbound: Tally(s.outbound, len(sent)) for s in subscriptions}
    ordered = {s.outbound for s in subscriptions if s.ordered}
    for record in records:
        where = origin(record)
        mine = sent.get((where.partition, where.offset))
        if where.topic != inbound or mine is None:
            continue  # an earlier run's record
        found = tallies[record.topic()]
        found.copies[(where.partition, where.offset)] += 1
        # exclusive/failover subscriptions deliver at once, as in Pulsar: their deliver-at is the publish time.
        due = mine.timestamp_ms if record.topic() in ordered else mine.timestamp_ms + mine.delay_ms
        delivered_ms = record.timestamp()[1]
        found.early += delivered_ms < due
        found.wrong_deliver_at += deliver_at(record) != due
        found.redelivered += redelivery_count(record) != 0
        found.lateness_ms.append(delivered_ms - due)
    return tallies


def report(inbound: str, partitions: int, sent: dict[tuple[int, int], Sent], tallies: dict[str, Tally]) -> None:
    delays = [s.delay_ms for s in sent.values()]
    print(
        f"inbound {inbound}: {len(sent)} records on {partitions} partitions, deliver-after "
        f"{min(delays) / 1000:g}-{max(delays) / 1000:g} s"
    )
    header = ("outbound topic", "expected", "once", "duplicated", "missing", "early", "bad deliver-at", "lateness")
    rows: list[tuple[str, ...]] = [header]
    for t in tallies.values():
        lateness = (
            f"p50 {statistics.median(t.lateness_ms):.0f} ms, max {max(t.lateness_ms)} ms" if t.lateness_ms else "-"
        )
        counts = (t.expected, t.once, t.duplicated, t.missing, t.early, t.wrong_deliver_at + t.redelivered)
        rows.append((t.topic, *map(str, counts), lateness))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--bootstrap-servers", default=COMPOSE_BOOTSTRAP, help="the cluster, as the host sees it")
    parser.add_argument("--health-urls", default=COMPOSE_HEALTH, help="each sidecar's /healthz, comma-separated")
    parser.add_argument("--group-id", default="delay-sidecar", help="the sidecars' consumer group")
    parser.add_argument("--policies", type=Path, default=ROOT / "policies", help="the policies the sidecars run")
    parser.add_argument("--topic", default="orders", help="inbound topic to produce to (declared in the policies)")
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--min-delay-s", type=float, default=2.0)
    parser.add_argument("--max-delay-s", type=float, default=20.0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0, help="for /healthz and the group")
    parser.add_argument("--deliver-timeout-s", type=float, default=120.0, help="after the last record is due")
    parser.add_argument("--settle-s", type=float, default=5.0, help="read once more this long after all came")
    args = parser.parse_args(argv)
    if args.records < 1 or not 0 <= args.min_delay_s <= args.max_delay_s:
        parser.error("need --records >= 1 and 0 <= --min-delay-s <= --max-delay-s")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    route = load_policies(args.policies).route(args.topic)
    if route is None or not route.subscriptions:
        raise SmokeError(f"{args.policies} declares no subscriptions for topic {args.topic}")
    delay = route.delay
    if not delay.is_enabled or delay.fixed_ms or (delay.max_ms and delay.max_ms < args.max_delay_s * 1000):
        raise SmokeError(f"topic {args.topic}: its delay policy would change the deliver-after delays; pick another")
    outbound = [s.outbound for s in route.subscriptions]

    urls = [u for u in args.health_urls.split(",") if u]
    wait_until(f"{len(urls)} sidecars ready", lambda: health_problem(urls), args.ready_timeout_s)
    admin = AdminClient({"bootstrap.servers": args.bootstrap_servers})
    wait_until(
        f"group {args.group_id} stable",
        lambda: group_problem(admin, args.group_id, len(urls)),
        args.ready_timeout_s,
    )
    partitions = partition_count(admin, args.topic)
    if not partitions or not all(partition_count(admin, t) for t in outbound):
        raise SmokeError(f"the sidecars did not create {args.topic} and {outbound}")

    run_id = uuid.uuid4().hex[:8]
    sent = produce(
        args.bootstrap_servers, args.topic, run_id, delays_ms(args.records, args.min_delay_s, args.max_delay_s)
    )
    last_due_ms = max(s.timestamp_ms + s.delay_ms for s in sent.values())
    wait_s = max(0.0, last_due_ms / 1000 - time.time())
    log(f"run {run_id}: {len(sent)} records produced to {args.topic}; the last is due in {wait_s:.1f} s")
    time.sleep(wait_s + 1)

    deadline = time.monotonic() + args.deliver_timeout_s
    while True:
        tallies = tally(
            args.topic, list(route.subscriptions), sent, read_to_high_watermark(args.bootstrap_servers, outbound)
        )
        missing = {t.topic: t.missing for t in tallies.values() if t.missing}
        if not missing or time.monotonic() > deadline:
            break
        log(f"still missing {missing}")
        time.sleep(5)
    if not missing and args.settle_s > 0:
        time.sleep(args.settle_s)  # a duplicate would come late: read everything once more
        tallies = tally(
            args.topic, list(route.subscriptions), sent, read_to_high_watermark(args.bootstrap_servers, outbound)
        )

    report(args.topic, partitions, sent, tallies)
    failed = [t.topic for t in tallies.values() if not t.ok]
    if failed:
        print(f"FAILED: {', '.join(failed)}: not every record arrived exactly once, on time and unchanged")
        return 1
    print(f"OK: each of the {len(sent)} records reached each of {len(outbound)} outbound topics once, none early")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SmokeError as e:
        print(f"smoke: {e}", file=sys.stderr)
        sys.exit(2)
