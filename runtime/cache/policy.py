"""The expert cache's replacement policies (admission and eviction, numpy only).

They are defined in moeprep/profile/policy.py, which `moeprep profile` also uses for its held-out table without
importing torch: one definition, so a simulated hit rate is the runtime's. See that module for the semantics.
"""

from moeprep.profile.policy import (
    DEFAULT_POLICY,
    POLICIES,
    AdmitAfterRepeat,
    Belady,
    ClassLru,
    CostPayback,
    Lfu,
    Lfuda,
    Lru,
    Payback,
    Policy,
    Replacement,
    Replay,
    UploadCost,
    make_policy,
    next_uses,
    replay,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AdmitAfterRepeat",
    "Belady",
    "ClassLru",
    "CostPayback",
    "Lfu",
    "Lfuda",
    "Lru",
    "Payback",
    "Policy",
    "Replacement",
    "Replay",
    "UploadCost",
    "make_policy",
    "next_uses",
    "replay",
]
