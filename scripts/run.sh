#!/usr/bin/env bash
# Run the sidecar with the example policies. Without DELAY_SIDECAR_BOOTSTRAP_SERVERS (or
# --bootstrap-servers) it starts a local broker on 127.0.0.1:9092 with data under .state/: Apache
# Kafka where Java 17+ runs (its jars fetched once with Maven), else the embedded noida-db
# (--broker-kind chooses).
set -euo pipefail
source "$(dirname "$0")/bootstrap.sh" ""
exec .venv/bin/delay-sidecar run --policies policies "$@"
