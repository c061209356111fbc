"""`delay-sidecar audit`: the audit job as a subcommand of the sidecar's command line.

This module imports no Spark: sidecar/cli.py can mount AuditCommand without making PySpark a
dependency of the other commands. cli_cmd() imports the job only when the audit runs.
"""

import sys

from spark.settings import AuditSettings


class AuditCommand(AuditSettings):
    """Audit delivery: every inbound record on every subscription's outbound topic on time, once, or dead-lettered."""

    def cli_cmd(self) -> None:
        from spark.audit_job import run_job  # noqa: PLC0415 (PySpark only when the audit runs)

        sys.exit(run_job(self))
