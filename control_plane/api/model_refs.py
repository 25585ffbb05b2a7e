"""A deployment's model as its record keeps it, checked at deploy time so a bad one is a
422 with the reason rather than a replica that fails later.

Aliases and local paths are kept as given (only the nodes know their files). A URI must
parse for its scheme (an unknown scheme, an https:// without its sha256 and the like are
refused) and is stored canonical; an `hf://` revision is pinned to its commit by asking
the hub (`HF_ENDPOINT`, `HF_TOKEN` of the control plane), so every node pulls the same
bytes. Store credentials never enter the record: agents use their own.
"""

from __future__ import annotations

from control_plane.api.errors import invalid
from fleet_base.models import BadModelUri, ModelStoreError, check_model_uri, is_remote, pin_model_uri


def model_ref(model: str) -> str:
    if not is_remote(model):
        return model
    try:
        check_model_uri(model)
    except BadModelUri as err:
        raise invalid("model", str(err)) from None
    try:
        return pin_model_uri(model)
    except ModelStoreError as err:
        raise invalid(
            "model",
            f"cannot pin {model.strip()} to a commit ({err}); name one (hf://org/repo@<40 hex digits>) to "
            "deploy without asking the hub",
        ) from None
