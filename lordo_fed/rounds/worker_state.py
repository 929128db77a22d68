"""A worker's saved state as flat named tensors plus JSON-able metadata.

`Worker.state_dict()` is nested: the optimizer's state dict, the data cursor, Δ's compression
residual (`lordo_fed.rounds.uplink`), the clients' copy θ_c (`lordo_fed.rounds.downlink`) and the
round sent (`lordo_fed.rounds.overlap`). A safetensors file or a Flower record holds flat named
tensors and a small JSON-able dict instead: tensors 'opt/<param id>/<state key>',
'wire_ef/<param>', 'client/<param>', 'sent/...' and the reply a relaying worker kept ('own_reply');
metadata the optimizer's param groups, the cursor, θ_c's round and the round sent's counters. A
worker restarted from it resumes bit for bit.
"""

from __future__ import annotations

from torch import Tensor

from lordo_fed.rounds.downlink import OWN_REPLY


def flatten(sd: dict) -> tuple[dict[str, Tensor], dict]:
    """A worker's `state_dict()` as (flat named tensors, JSON-able metadata)."""
    opt = sd["optimizer"]
    tensors = {f"opt/{pid}/{key}": value for pid, st in opt["state"].items() for key, value in st.items()}
    tensors.update(sd["wire_ef"])  # "wire_ef/<param>"
    tensors.update({f"client/{n}": t for n, t in sd["client"].items()})
    tensors.update(sd.get("sent", {}))
    tensors.update({OWN_REPLY: sd[OWN_REPLY]} if OWN_REPLY in sd else {})
    return tensors, {"param_groups": opt["param_groups"], "cursor": int(sd["cursor"]),
                     "client_round": int(sd["client_round"]), "sent": sd.get("sent_meta")}


def unflatten(tensors: dict[str, Tensor], meta: dict) -> dict:
    """The worker state dict that `flatten` gave (tensors, meta) for (absent parts: none held)."""
    state: dict[int, dict[str, Tensor]] = {}
    wire_ef, client, sent = {}, {}, {}
    own = {}
    for key, value in tensors.items():
        if key == OWN_REPLY:
            own[key] = value
            continue
        if key.startswith("sent/"):
            sent[key] = value
            continue
        if key.startswith("wire_ef/"):
            wire_ef[key] = value
            continue
        if key.startswith("client/"):
            client[key.removeprefix("client/")] = value
            continue
        _, pid, name = key.split("/", 2)
        state.setdefault(int(pid), {})[name] = value
    return {"optimizer": {"state": state, "param_groups": meta["param_groups"]},
            "cursor": meta["cursor"], "wire_ef": wire_ef, "client": client,
            "client_round": meta.get("client_round", 0), "sent": sent, "sent_meta": meta.get("sent"), **own}
