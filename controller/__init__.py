"""The agent: trade-off regression, frontier, daemon, exporter, reports. Serving (the hook, deployment
metering, the envelope guard) is `joulepilot.runtime`."""

from joulepilot.store.devicekind import device_kind as device_kind

from .daemon import Daemon as Daemon
from .daemon_config import DaemonConfig as DaemonConfig
from .daemon_config import DaemonConfigError as DaemonConfigError
from .daemon_config import load_daemon_config as load_daemon_config
from .exporter import start_exporter as start_exporter
from .features import FeatureSpace as FeatureSpace
from .frontier import frontier as frontier
from .frontier import pareto_front as pareto_front
from .frontier import plot_frontier as plot_frontier
from .instance_lock import DaemonAlreadyRunning as DaemonAlreadyRunning
from .report import build_report as build_report
from .report import build_summary as build_summary
from .report import render as render
from .status import daemon_status as daemon_status
from .tradeoff import TARGETS as TARGETS
from .tradeoff import TradeoffError as TradeoffError
from .tradeoff import TradeoffModel as TradeoffModel
from .tradeoff import cross_validate as cross_validate
from .tradeoff import fit as fit
