"""The load generator, run as its own process so it shares no GIL with the bench driver.

Usage: python -m bench.load --bootstrap HOST:PORT --topic T --records N [--mode none|deliver-at]
       [--base-ms MS --window-ms MS] [--value-bytes 100] [--seed 1]

Modes:
* none: no delay header (pass-through, the ceiling, a fixed-delay topic);
* deliver-at: header `deliver-at` = base-ms + a delay drawn uniformly in [0, window-ms), so the
  records fall due spread over the window whatever the order they were produced in.

Prints one JSON line: {"records", "seconds", "rate", "start_ms", "end_ms"}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from confluent_kafka import Producer


def produce(
    bootstrap: str,
    topic: str,
    records: int,
    mode: str = "none",
    base_ms: int = 0,
    window_ms: int = 0,
    value_bytes: int = 100,
    seed: int = 1,
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
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    stats = produce(
        args.bootstrap, args.topic, args.records, args.mode, args.base_ms, args.window_ms, args.value_bytes, args.seed
    )
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
