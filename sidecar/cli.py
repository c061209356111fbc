"""The command line: `delay-sidecar run | broker | demo | policies | audit | messages` (contract section 6).

pydantic-settings builds the flags from the settings models, so every flag has a matching
DELAY_SIDECAR_* environment variable and a --help line, with no second list to keep in sync.
"""

import logging
import signal
import sys
import threading
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, CliSubCommand, SettingsConfigDict

from sidecar import early_stop
from sidecar.app import SidecarApp, run_until_signalled
from sidecar.broker.local import KIND_HELP, BrokerKind, local_broker
from sidecar.cli_help import add_argument
from sidecar.demo import run_demo
from sidecar.errors import SidecarError
from sidecar.logs import setup_logging
from sidecar.messages_command import MessagesCommand
from sidecar.policy.commands import PoliciesCommand
from sidecar.settings import ENV_PREFIX, RunSettings
from sidecar.supervisor import Supervisor
from spark.command import AuditCommand

logger = logging.getLogger(__name__)


class RunCommand(RunSettings):
    """Run the sidecar (starts a local broker when no bootstrap servers are given)."""

    def cli_cmd(self) -> None:
        setup_logging(self.log_level)
        if self.workers > 1:
            run_until_signalled(Supervisor(self))
        else:
            run_until_signalled(SidecarApp(self))


class BrokerCommand(BaseSettings):
    """Run a local broker alone (Apache Kafka, or the embedded noida-db), until Ctrl-C or SIGTERM."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_kebab_case=True, extra="ignore")
    port: int = Field(
        9092,
        ge=1,
        le=65535,
        description="Kafka port of the first node; node i listens on port+i-1 and its controller on port+N+i-1. "
        "Taken: free ports, as the log says",
    )
    data_dir: Path | None = Field(
        None,
        description="Where the broker keeps its data. Default: .state/kafka (Apache Kafka), .state/broker (noida-db)",
    )
    host: str = Field("127.0.0.1", description="Address to bind")
    nodes: int = Field(
        1, ge=1, le=9, description="Nodes of the cluster, each a broker and a controller (Apache Kafka only)"
    )
    broker_kind: BrokerKind = Field("auto", description=KIND_HELP)

    def cli_cmd(self) -> None:
        setup_logging("INFO")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        with local_broker(self.broker_kind, self.data_dir, port=self.port, host=self.host, nodes=self.nodes) as broker:
            print(
                f"broker ready: {broker.description}, bootstrap servers {broker.bootstrap_servers} (Ctrl-C stops)",
                flush=True,
            )
            stop.wait()


class DemoCommand(BaseSettings):
    """Start a broker and the sidecar, produce delayed records, and watch them arrive."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, cli_kebab_case=True, extra="ignore")
    policies: Path = Field(Path("policies"), description="Policy YAML with the demo topic 'orders'")
    records: int = Field(6, ge=2, le=11, description="How many delayed records to produce")
    broker_kind: BrokerKind = Field("auto", description=KIND_HELP)

    def cli_cmd(self) -> None:
        setup_logging("WARNING")
        sys.exit(run_demo(self.policies, self.records, broker_kind=self.broker_kind))


class DelaySidecar(BaseSettings):
    """Pulsar-style delayed delivery for Kafka."""

    model_config = SettingsConfigDict(cli_prog_name="delay-sidecar", cli_kebab_case=True)

    run: CliSubCommand[RunCommand]
    broker: CliSubCommand[BrokerCommand]
    demo: CliSubCommand[DemoCommand]
    policies: CliSubCommand[PoliciesCommand]
    audit: CliSubCommand[AuditCommand]
    messages: CliSubCommand[MessagesCommand]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    stopped = early_stop.take()
    if stopped is not None:
        print(f"delay-sidecar: {stopped} while starting; stopped before doing anything", file=sys.stderr)
        sys.exit(0)
    source: CliSettingsSource[DelaySidecar] = CliSettingsSource(DelaySidecar, add_argument_method=add_argument)
    try:
        CliApp.run(DelaySidecar, cli_args=sys.argv[1:] if argv is None else argv, cli_settings_source=source)
    except ValidationError as e:
        problems = "; ".join(
            f"--{'-'.join(str(p) for p in err['loc'][1:]).replace('_', '-')}: {err['msg']}" for err in e.errors()
        )
        print(f"delay-sidecar: error: {problems}", file=sys.stderr)
        sys.exit(2)
    except SidecarError as e:
        print(f"delay-sidecar: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
