"""The peer of bench/bench_nack.py: retry-with-delay done by retriable-kafka-client, as its README intends.

Runs in the peer's own virtualenv (retriable-kafka-client pins confluent-kafka==2.15.1), so it imports
nothing from this repository. One `BaseConsumer` consumes the base topic and its retry topic; the target
fails the first attempt at every record, so the library commits the record, re-produces it to the retry
topic with `retriable_kafka_attempt` and `retriable_kafka_timestamp` headers, and processes it again
once that timestamp has passed. The run ends when every record was processed a second time.

Prints one JSON line on stdout: when the first retry was requested (the first failure), when the last
retried record was processed, and the counts, so the caller can compute retries per second. The bytes
the retries wrote are measured by the caller, who reads the retry topic back.
"""

import argparse
import json
import logging
import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from typing import Any

from retriable_kafka_client import BaseConsumer, ConsumerConfig, ConsumerThread, ConsumeTopicConfig


class Workload:
    """The target: fails each record's first attempt, counts the second, signals when all came back."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.attempts: dict[int, int] = {}
        self.failed_at: dict[int, float] = {}
        self.retry_delays_ms: list[float] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.first_failure_s: float | None = None
        self.last_failure_s: float | None = None
        self.first_retry_s: float | None = None
        self.last_retry_s: float | None = None
        self.retried = 0
        self.extra = 0

    def __call__(self, message: dict[str, Any]) -> None:
        now = time.time()
        record_id = int(message["id"])
        with self.lock:
            attempt = self.attempts.get(record_id, 0) + 1
            self.attempts[record_id] = attempt
            if attempt == 1:
                if self.first_failure_s is None:
                    self.first_failure_s = now
                self.last_failure_s = now
                self.failed_at[record_id] = now
            elif attempt == 2:
                self.retried += 1
                self.retry_delays_ms.append((now - self.failed_at[record_id]) * 1000)
                if self.first_retry_s is None:
                    self.first_retry_s = now
                self.last_retry_s = now
                if self.retried == self.expected:
                    self.done.set()
            else:
                self.extra += 1
        if attempt == 1:
            # The library catches this in the future's done callback and re-produces the record.
            raise RuntimeError(f"simulated failure of record {record_id}")


def percentiles(values: list[float]) -> dict[str, float]:
    """min / p50 / p99 / max of the observed failure-to-retry times, in ms."""
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)

    return {"min": round(ordered[0], 1), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True, help="base topic, pre-filled with JSON records holding an 'id'")
    parser.add_argument("--retry-topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--messages", type=int, required=True)
    parser.add_argument("--delay-ms", type=int, required=True)
    parser.add_argument("--workers", type=int, default=16, help="thread pool size = the consumer's max_concurrency")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--log-level",
        default="ERROR",
        help="level of the library's loggers; at WARNING it logs every failure with its traceback",
    )
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("retriable_kafka_client").setLevel(args.log_level)

    workload = Workload(args.messages)
    executor = ThreadPoolExecutor(max_workers=args.workers, thread_name_prefix="rkc-worker")
    config = ConsumerConfig(
        kafka_hosts=[args.bootstrap],
        username="",
        password="",
        # The library defaults to SASL_SSL with SCRAM; the bench's local broker speaks plaintext.
        additional_settings={"security.protocol": "PLAINTEXT"},
        group_id=args.group,
        target=workload,
        topics=[
            ConsumeTopicConfig(
                base_topic=args.topic,
                retry_topic=args.retry_topic,
                retries=1,
                fallback_delay=args.delay_ms / 1000,
            )
        ],
    )
    consumer = BaseConsumer(config=config, executor=executor, max_concurrency=args.workers)
    thread = ConsumerThread(consumer)
    started_s = time.time()
    thread.start()
    finished = workload.done.wait(args.timeout_s)
    stop_started = time.time()
    thread.stop()
    executor.shutdown(wait=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with workload.lock:
        first_attempts = sum(1 for a in workload.attempts.values() if a >= 1)
        result = {
            "finished": finished,
            "expected": args.messages,
            "first_attempts": first_attempts,
            "retried": workload.retried,
            "extra_attempts": workload.extra,
            "started_s": started_s,
            "first_failure_s": workload.first_failure_s,
            "last_failure_s": workload.last_failure_s,
            "first_retry_s": workload.first_retry_s,
            "last_retry_s": workload.last_retry_s,
            "stop_s": time.time() - stop_started,
            "retry_delays_ms": percentiles(workload.retry_delays_ms),
            "cpu_user_s": usage.ru_utime,
            "cpu_system_s": usage.ru_stime,
            "peak_rss_mib": usage.ru_maxrss / 1024,
            "workers": args.workers,
            "pid": os.getpid(),
            "retriable_kafka_client": version("retriable-kafka-client"),
            "confluent_kafka": version("confluent-kafka"),
        }
    print(json.dumps(result), flush=True)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
