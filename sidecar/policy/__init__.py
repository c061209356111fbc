"""Policy: what operators allow (PIP-315 max delay, PIP-437 fixed delay) and where records go."""

from sidecar.policy.errors import PolicyError, Problem
from sidecar.policy.evaluate import Decision, decide
from sidecar.policy.loader import load_policies
from sidecar.policy.model import EffectiveDelay, PolicySet, Sourced, SubscriptionRoute, TopicRoute
from sidecar.policy.reload import PolicyDiff, PolicyWatcher, ReloadResult, diff

__all__ = [
    "Decision",
    "EffectiveDelay",
    "PolicyDiff",
    "PolicyError",
    "PolicySet",
    "PolicyWatcher",
    "Problem",
    "ReloadResult",
    "Sourced",
    "SubscriptionRoute",
    "TopicRoute",
    "decide",
    "diff",
    "load_policies",
]
