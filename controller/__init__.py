"""The agent: trade-off regression, frontier, daemon, deployments, reports."""

from .deployment import MeteredModel as MeteredModel
from .deployment import attach as attach
from .features import FeatureSpace as FeatureSpace
from .features import device_kind as device_kind
from .frontier import frontier as frontier
from .frontier import pareto_front as pareto_front
from .frontier import plot_frontier as plot_frontier
from .guard import EnvelopeGuard as EnvelopeGuard
from .guard import EnvelopeWarning as EnvelopeWarning
from .report import build_report as build_report
from .report import build_summary as build_summary
from .report import render as render
from .tradeoff import TARGETS as TARGETS
from .tradeoff import TradeoffError as TradeoffError
from .tradeoff import TradeoffModel as TradeoffModel
from .tradeoff import cross_validate as cross_validate
from .tradeoff import fit as fit
