#!/usr/bin/env bash
# Smoke test of deploy/docker-compose.yml, run after
#   docker compose -f deploy/docker-compose.yml up -d --build
# Waits for the three sidecars' /healthz, produces records with deliver-after delays to `orders`,
# reads its outbound topics to their high watermark and checks that each record arrived once and
# not early; prints the counts. The logic is in deploy/smoke.py (flags: --help). Exit 0 when all
# came once and on time, 1 when not, 2 when the cluster never got ready. It starts and stops nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's .venv (confluent-kafka and the sidecar's contract helpers); "" = no extras, and keeps
# this script's own arguments away from bootstrap.sh.
source scripts/bootstrap.sh ""
exec .venv/bin/python deploy/smoke.py "$@"
