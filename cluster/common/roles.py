"""The roles a worker plays, the modes a cluster runs in, and the routing policies: each string
defined once, as an enum whose members compare equal to their values (YAML, CLI flags, Redis)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    PREFILL = "prefill"  # runs prompts and sends their KV
    DECODE = "decode"  # reserves blocks, receives KV, streams the rest
    COLOCATED = "colocated"  # both phases in one engine


class Mode(enum.StrEnum):
    DISAGGREGATED = "disaggregated"  # prefill and decode pools
    COLOCATED = "colocated"  # one pool of colocated workers


class RoutingPolicy(enum.StrEnum):
    KV_AWARE = "kv-aware"  # prefill workers by queue and cached prefix
    LOAD = "load"  # by queue only
    ROUND_ROBIN = "round-robin"
