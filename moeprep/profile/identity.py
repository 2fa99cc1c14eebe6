"""Which model a profile belongs to, and the check that refuses a profile made for another one.

Two files are the same model for a profile when they route the same way: same architecture and expert geometry and
byte-identical router tensors (the gate and, where the architecture has one, the selection bias). Requantizing the
attention or the experts keeps the routers, so a profile stays valid for the requantized file; the name and the
file size are recorded for display and for the llama.cpp state-file section, not compared.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

from moeprep.errors import MoeprepError
from moeprep.gguf.anatomy import classify_tensors, moe_geometry
from moeprep.gguf.reader import GGUFModel
from moeprep.gguf.roles import TensorRole


@dataclass(frozen=True)
class ModelIdentity:
    arch: str
    name: str  # general.name
    file_size: int  # bytes, all shards
    n_layer: int
    moe_layers: tuple[int, ...]
    n_expert: int
    n_expert_used: int
    router_sha256: str  # over the router tensors' names, types, shapes and bytes, in file order

    # compared by `check_same_model`; the others describe the file the profile was made from
    ROUTING_FIELDS = ("arch", "n_layer", "moe_layers", "n_expert", "n_expert_used", "router_sha256")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "moe_layers": list(self.moe_layers)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelIdentity:
        return cls(**{f.name: d[f.name] for f in fields(cls)} | {"moe_layers": tuple(d["moe_layers"])})

    def describe(self) -> str:
        return (
            f"{self.name} ({self.arch}, {len(self.moe_layers)} MoE layers x {self.n_expert} experts, "
            f"router {self.router_sha256[:12]})"
        )


def router_fingerprint(model: GGUFModel) -> str:
    h = hashlib.sha256()
    roles, _ = classify_tensors(model)
    for t, role in roles:
        if role == TensorRole.ROUTER:
            h.update(f"{t.name}:{t.type_name}:{t.shape}\n".encode())
            h.update(model.raw(t))
    return h.hexdigest()


def identify_model(model: GGUFModel) -> ModelIdentity:
    geo = moe_geometry(model)
    return ModelIdentity(
        arch=geo.arch,
        name=model.name,
        file_size=model.file_size,
        n_layer=geo.n_layer,
        moe_layers=tuple(geo.moe_layers),
        n_expert=geo.n_expert,
        n_expert_used=geo.n_expert_used,
        router_sha256=router_fingerprint(model),
    )


def check_same_model(have: ModelIdentity, want: ModelIdentity, have_what: str, want_what: str) -> None:
    """Raise unless `have` routes like `want`; the message names both and what differs."""
    differ = [f for f in ModelIdentity.ROUTING_FIELDS if getattr(have, f) != getattr(want, f)]
    if differ:
        raise MoeprepError(
            f"{have_what}: made for another model ({have.describe()}) than {want_what} "
            f"({want.describe()}; differs in {', '.join(differ)}); profile that model instead"
        )
