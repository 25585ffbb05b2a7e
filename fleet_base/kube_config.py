"""`cluster.yaml` settings of the `kubernetes` runtime (the `kubernetes:` section): where
the API is, which image replicas run, how a Fleet capacity pool maps onto the cluster's
node pools, where models come from. Validated at the edge like the rest of the config."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
NodeProvider = Literal["gke", "eks", "aks", "generic"]
ForeignEngine = Literal["vllm", "sglang", "llama.cpp"]
ENGINE_IMAGES: dict[ForeignEngine, str] = {
    "vllm": "ghcr.io/fleet-llm/fleet-vllm:0.1.0",
    "sglang": "ghcr.io/fleet-llm/fleet-sglang:0.1.0",
    "llama.cpp": "ghcr.io/fleet-llm/fleet-llama-cpp:0.1.0",
}


def _quantity(value: str) -> str:
    if not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 16Gi)")
    return value


class Toleration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1, max_length=253)
    operator: Literal["Equal", "Exists"] = "Exists"
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", ""] = "NoSchedule"


class PoolPlacement(BaseModel):
    """How one Fleet pool (PoolInventory.name) lands on the cluster's nodes. Without an
    entry the runtime derives it from the pool record and `node_provider` (GPU model and
    spot labels of GKE, EKS or AKS); `node_pool` selects the provider's node pool by name;
    `node_selector` and `tolerations` are added last and win."""

    model_config = ConfigDict(extra="forbid")

    node_pool: str = ""
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    # the resource name of the accelerator (nvidia.com/gpu; amd.com/gpu; "" for CPU pools)
    gpu_resource: str = "nvidia.com/gpu"


class ModelVolume(BaseModel):
    """Where replicas read model files: a PersistentVolumeClaim (ReadOnlyMany, filled by
    the model-delivery pre-pull), the node's model cache directory (hostPath: the
    namespace then cannot enforce Pod Security "restricted" or "baseline"), or none (a
    model the image carries, e.g. the CPU image's smollm2-135m)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["pvc", "host_path", "none"] = "pvc"
    claim_name: str = "fleet-models"
    host_path: str = "/var/cache/fleet/models"
    mount_path: str = "/models"


class KubernetesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # API access: empty server and kubeconfig = in-cluster service account; a kubeconfig
    # path uses its current context; `server` alone is an unauthenticated URL (kubectl proxy).
    server: str = ""
    kubeconfig: str = ""
    namespace: str = Field("fleet", pattern=_DNS_LABEL)
    # The agent's own Deployment: replica pods name it as their owner, so deleting the
    # agent's objects (kubectl delete -k) garbage-collects its replicas. "" = no owner.
    owner_deployment: str = Field("fleet-agent", pattern=r"^$|" + _DNS_LABEL[1:])
    image: str = Field("ghcr.io/fleet-llm/fleet-engine-cuda:0.1.0", min_length=1, max_length=512)
    # The image of each foreign engine a deployment may name (`engine`): Fleet's images built
    # on the engines' official ones (deploy/images/engines). An entry here replaces one default.
    engine_images: dict[ForeignEngine, str] = Field(default_factory=lambda: dict(ENGINE_IMAGES))
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list)
    service_account: str = Field("fleet-replica", pattern=_DNS_LABEL)
    priority_class: str = ""
    node_provider: NodeProvider = "generic"
    pools: dict[str, PoolPlacement] = Field(default_factory=dict)
    model_volume: ModelVolume = Field(default_factory=ModelVolume)
    # The Secret holding the replicas' certificate, key and token (replica.pem, replica.key,
    # replica-token of the cluster's enrolment bundle). Required with `security`: every
    # replica then serves HTTPS with that certificate and requires that token, like a
    # process replica. Without `security`, mounted whole at /etc/fleet/credentials. "" = none.
    replica_secret: str = Field("", pattern=r"^$|" + _DNS_LABEL[1:])
    # The headless Service (in `namespace`) whose name is every replica pod's subdomain:
    # with `security`, gateways reach a replica at https://<pod hostname>.<this>.<namespace>.svc,
    # a name the replica certificate covers with `*.<this>.<namespace>.svc`.
    replica_service: str = Field("fleet-replicas", pattern=_DNS_LABEL)
    port: int = Field(8000, ge=1, le=65535)
    cpu_request: str = "4"
    memory_request: str = "16Gi"
    memory_limit: str = "32Gi"
    # /tmp of the read-only-root container (tokenizer caches, Triton's compile cache).
    scratch_size: str = "2Gi"
    # /dev/shm of a foreign engine's pod (a memory-backed emptyDir, counted against
    # memory_limit): PyTorch and NCCL share tensors between vLLM's and SGLang's workers there.
    shm_size: str = "8Gi"
    # vLLM's and SGLang's KV-cache events (prefix routing on their replicas): "off", or
    # "plaintext": each pod binds a ZMQ PUB and a replay ROUTER on kv_events_port and
    # kv_replay_port of its pod address, unauthenticated and unencrypted even with `security`
    # (the batches carry tenants' prompt token ids; replay answers whoever reaches it), so
    # only the `fleet-replicas` NetworkPolicy keeps others away. Opt in on a pod network you
    # trust (docs/engines.md).
    kv_events: Literal["off", "plaintext"] = "off"
    # Where vLLM and SGLang publish KV-cache events and replay missed ones (ZMQ, container
    # ports the agent reaches).
    kv_events_port: int = Field(5557, ge=1, le=65535)
    kv_replay_port: int = Field(5558, ge=1, le=65535)
    # A foreign engine's startup bound (its startup probe, and the runtime's own): loading a
    # 70B model from the volume and capturing CUDA graphs takes far longer than our engine.
    engine_startup_timeout_s: float = Field(1800.0, gt=0)
    # A pod the scheduler cannot place for this long is reported as missing capacity
    # (above the cluster autoscaler's scale-up time, where one adds nodes to the pool).
    unschedulable_after_s: float = Field(120.0, ge=0)
    # ... and the pool is reported short of that capacity for this long afterwards, so
    # the control plane does not place the replica straight back.
    unschedulable_hold_s: float = Field(600.0, ge=0)

    @field_validator("engine_images")
    @classmethod
    def _with_defaults(cls, value: dict[ForeignEngine, str]) -> dict[ForeignEngine, str]:
        for kind, image in value.items():
            if not image or len(image) > 512:
                raise ValueError(f"engine_images.{kind}: 1..512 characters")
        return {**ENGINE_IMAGES, **value}

    @field_validator("cpu_request", "memory_request", "memory_limit", "scratch_size", "shm_size")
    @classmethod
    def _check_quantity(cls, value: str) -> str:
        return _quantity(value)

    @model_validator(mode="after")
    def _distinct_ports(self) -> KubernetesConfig:
        ports = {
            "port": self.port,
            "kv_events_port": self.kv_events_port,
            "kv_replay_port": self.kv_replay_port,
        }
        if len(set(ports.values())) < len(ports):
            raise ValueError(f"the replicas' ports must differ: {ports}")
        return self
