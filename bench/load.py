"""The load generator, run as its own process so it shares no GIL with the bench driver.

Usage: python -m bench.load --bootstrap HOST:PORT --topic T --records N [--mode none|deliver-at]
       [--base-ms MS --window-ms MS] [--value-bytes 100] [--rate R] [--seed 1]

Modes:
* none: no delay header (pass-through, the ceiling, a fixed-delay topic);
* deliver-at: header `deliver-at` = base-ms + a delay drawn uniformly in [0, window-ms), so the
  records fall due spread over the window whatever the order they were produced in.

--rate R paces the producer at R records/s (0: as fast as it goes): a fixed-delay topic fed live at a
set rate falls due at that rate, which is the load the issue's "produced at 40k/s" target is about.
The pace is checked every PACE_STEP records, sleeping back onto the schedule, so the rate holds over
any second while the per-record loop stays free of clock reads.

Prints one JSON line: {"records", "seconds", "rate", "start_ms", "end_ms"}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from confluent_kafka import Producer

PACE_STEP = 1_000
VALUE_BYTES = 100


def produce(
    bootstrap: str,
    topic: str,
    records: int,
    mode: str = "none",
    base_ms: int = 0,
    window_ms: int = 0,
    value_bytes: int = VALUE_BYTES,
    seed: int = 1,
    rate: float = 0.0,
) -> dict[str, float]:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 1_000_000,
            "queue.buffering.max.kbytes": 1_048_576,
        }
    )
    rng = random.Random(seed)

    # Distinct JSON-like values, padded with random hex to value_bytes: identical values would let
    # lz4 shrink whole batches to nothing and flatter every stage alike; fully random ones make a
    # 1M-record backlog exceed a 100 MB fetch response on noida-db (see docs/benchmarks.md).
    def make_value(i: int) -> bytes:
        head = b'{"order":%d,"amount":%d.%02d,"currency":"EUR","note":"' % (i, rng.randrange(10_000), i % 100)
        pad = max(value_bytes - len(head) - 2, 0)
        return head + rng.randbytes((pad + 1) // 2).hex().encode()[:pad] + b'"}'

    send = producer.produce
    poll = producer.poll
    delayed = mode == "deliver-at"
    start_ms = time.time_ns() // 1_000_000
    started = time.monotonic()
    for i in range(records):
        key = b"%d" % i
        value = make_value(i)
        while True:
            try:
                if delayed:
                    at = base_ms + int(rng.random() * window_ms)
                    send(topic, value, key, headers=[("deliver-at", b"%d" % at)])
                else:
                    send(topic, value, key)
                break
            except BufferError:
                poll(0.01)
        if i % 10_000 == 0:
            poll(0)
        if rate > 0 and i % PACE_STEP == PACE_STEP - 1:
            # On a schedule from the start, not a sleep per step: a step that ran slow (the GIL, a
            # busy broker) is made up by the next ones, so the mean rate is R and not a bit under.
            ahead_s = started + (i + 1) / rate - time.monotonic()
            if ahead_s > 0:
                poll(0)
                time.sleep(ahead_s)
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} records not acknowledged after 120 s")
    seconds = time.monotonic() - started
    return {
        "records": records,
        "seconds": seconds,
        "rate": records / seconds if seconds > 0 else 0.0,
        "start_ms": start_ms,
        "end_ms": time.time_ns() // 1_000_000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--records", type=int, required=True)
    parser.add_argument("--mode", choices=["none", "deliver-at"], default="none")
    parser.add_argument("--base-ms", type=int, default=0)
    parser.add_argument("--window-ms", type=int, default=0)
    parser.add_argument("--value-bytes", type=int, default=VALUE_BYTES)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=0.0, help="records/s to pace at (0: full speed)")
    args = parser.parse_args(argv)
    stats = produce(
        args.bootstrap,
        args.topic,
        args.records,
        args.mode,
        args.base_ms,
        args.window_ms,
        args.value_bytes,
        args.seed,
        args.rate,
    )
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
