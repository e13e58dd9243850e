"""Residency policies: pure decision code over a snapshot (no torch, no tiers)."""

from tensorscope.policies.base import Action, Entry, OpView, Policy, Snapshot
from tensorscope.policies.flow import Flow
from tensorscope.policies.genoa import Genoa

__all__ = ["Action", "Entry", "Flow", "Genoa", "OpView", "Policy", "Snapshot"]
