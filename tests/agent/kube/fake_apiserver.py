"""A FAKE Kubernetes API server: it stands in for a real kube-apiserver, which cannot run
on the test machines. It is a real HTTP server (Starlette on uvicorn, on a free port) that
the real client (lightkube) talks to, and it keeps to the API's semantics rather than to
what our runtime expects:

- every write bumps one cluster-wide `resourceVersion` (a string, opaque to clients) and
  is recorded as a watch event (ADDED / MODIFIED / DELETED);
- list returns `<Kind>List` with the collection's resourceVersion; watch without a
  resourceVersion first sends ADDED for every current object, with one it replays the
  events after it, and one older than the retained history gets an ERROR event with a
  410 `Expired` Status (the client must relist);
- label selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`;
- create of an existing name is 409 `AlreadyExists`, a missing object 404 `NotFound`,
  both as `Status` objects;
- delete of a pod that is bound to a node and has a grace period sets
  `deletionTimestamp` / `deletionGracePeriodSeconds` (MODIFIED) and the pod goes away
  when its containers stop (`finish_termination`, what the kubelet reports) or when the
  grace period runs out (the kubelet's SIGKILL); an unbound pod, or grace 0, goes at once.
  A second delete may only shorten the grace period;
- deleting an object deletes the objects whose ownerReferences name its uid (the garbage
  collector, background propagation).

- field selectors on pods: `spec.nodeName`, `metadata.name`, `metadata.namespace`,
  `status.phase` (`=`, `==`, `!=`); any other field is 400 BadRequest, as the real one;
- PATCH with `application/merge-patch+json` (RFC 7386: maps merge, null deletes, lists
  replace); a `metadata.resourceVersion` in the patch is a precondition (409 Conflict
  when the object moved on); other patch types are 415;
- with `rbac` set (`Rbac.from_manifest`), a request its rules do not allow is 403
  Forbidden, as the API server's authorizer answers a ServiceAccount.

What the scheduler and the kubelet would do to a pod's status is driven by the test
through `schedule`, `unschedulable`, `run`, `wait_container`, `terminate` and
`node_shutdown`, each a status write like theirs (resourceVersion bump + MODIFIED).
Only the resources the Fleet runtime touches are served: core/v1 pods (+ pods/log),
apps/v1 deployments, and cluster-scoped core/v1 nodes (`add_node`). Every request is
recorded in `requests` (method, resource, verb) so tests can compare what the code does
with what its Role allows.

Over ~400 lines: the API semantics the runtime relies on (versions, watches, conflicts,
status) have to be faithful together.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

HISTORY = 1000  # watch events retained (older resourceVersions get 410 Expired)

KINDS = {
    ("", "v1", "pods"): "Pod",
    ("apps", "v1", "deployments"): "Deployment",
}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, **details: Any) -> JSONResponse:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }
    return JSONResponse(body, status_code=code)


_REQ = re.compile(
    r"^\s*(!?)([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9_.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


def parse_selector(text: str) -> list[tuple[str, str, Any]]:
    """`a=b,c in (x,y),!d` -> [(key, op, value)]; ValueError on bad syntax."""
    reqs: list[tuple[str, str, Any]] = []
    if not text:
        return reqs
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for part in parts:
        m = _REQ.match(part)
        if not m:
            raise ValueError(f"unable to parse requirement: {part!r}")
        neg, key, op, value, setop, values = m.groups()
        if neg and (op or setop):
            raise ValueError(f"unable to parse requirement: {part!r}")
        if setop:
            reqs.append((key, setop, {v.strip() for v in values.split(",") if v.strip()}))
        elif op:
            reqs.append((key, "!=" if op == "!=" else "=", value))
        else:
            reqs.append((key, "!" if neg else "exists", None))
    return reqs


def selector_matches(reqs: list[tuple[str, str, Any]], labels: dict[str, str]) -> bool:
    for key, op, value in reqs:
        have = labels.get(key)
        if op == "=" and have != value:
            return False
        if op == "!=" and have == value:
            return False
        if op == "exists" and have is None:
            return False
        if op == "!" and have is not None:
            return False
        if op == "in" and have not in value:
            return False
        if op == "notin" and have in value:
            return False
    return True


POD_FIELDS = {
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName", ""),
    "metadata.name": lambda o: o["metadata"]["name"],
    "metadata.namespace": lambda o: o["metadata"].get("namespace", ""),
    "status.phase": lambda o: (o.get("status") or {}).get("phase", ""),
}


def parse_field_selector(text: str) -> list[tuple[str, bool, str]]:
    """`spec.nodeName=n1,status.phase!=Failed` -> [(field, equal, value)]; ValueError for
    bad syntax or a field the API does not index for pods."""
    reqs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.match(r"^([A-Za-z.]+)\s*(==|=|!=)\s*(.*)$", part)
        if not m:
            raise ValueError(f"invalid field selector: {part!r}")
        key, op, value = m.groups()
        if key not in POD_FIELDS:
            raise ValueError(f'field label not supported: "{key}"')
        reqs.append((key, op != "!=", value))
    return reqs


def fields_match(reqs: list[tuple[str, bool, str]], obj: dict) -> bool:
    return all((POD_FIELDS[key](obj) == value) == equal for key, equal, value in reqs)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _tolerates(toleration: dict, taint: dict) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if not toleration.get("key"):  # an empty key with Exists tolerates every taint
        return toleration.get("operator") == "Exists"
    if toleration["key"] != taint["key"]:
        return False
    return toleration.get("operator") == "Exists" or toleration.get("value", "") == taint.get("value", "")


@dataclass
class Recorded:
    method: str
    resource: str  # "pods", "pods/log", "deployments", "nodes"
    verb: str  # get, list, watch, create, delete, patch, update
    group: str = ""
    namespace: str = ""  # "" for a cluster-scoped resource
    name: str = ""


@dataclass
class Rbac:
    """What the agent's ServiceAccount may do: the rules of the Roles bound to it in its
    namespace, and of the ClusterRoles bound to it cluster-wide."""

    namespace: str
    role_rules: list[dict] = field(default_factory=list)
    cluster_rules: list[dict] = field(default_factory=list)

    @classmethod
    def from_manifest(cls, path: Path, namespace: str, service_account: str = "fleet-agent") -> Rbac:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
        return cls.from_docs(docs, namespace, service_account)

    @classmethod
    def from_docs(cls, docs: list[dict], namespace: str, service_account: str = "fleet-agent") -> Rbac:
        roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
        rbac = cls(namespace)
        for binding in docs:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(
                s["kind"] == "ServiceAccount"
                and s["name"] == service_account
                and s.get("namespace", namespace) == namespace
                for s in binding["subjects"]
            ):
                continue
            ref = binding["roleRef"]
            rules = roles[(ref["kind"], ref["name"])]["rules"]
            if binding["kind"] == "ClusterRoleBinding":
                rbac.cluster_rules.extend(rules)
            else:
                rbac.role_rules.extend(rules)
        return rbac

    @staticmethod
    def _allows(rule: dict, r: Recorded) -> bool:
        named_verbs = ("get", "update", "patch", "delete")
        return (
            (r.group in rule["apiGroups"] or "*" in rule["apiGroups"])
            and (r.resource in rule["resources"] or "*" in rule["resources"])
            and (r.verb in rule["verbs"] or "*" in rule["verbs"])
            and (not rule.get("resourceNames") or (r.verb in named_verbs and r.name in rule["resourceNames"]))
        )

    def allows(self, r: Recorded) -> bool:
        if any(self._allows(rule, r) for rule in self.cluster_rules):
            return True
        return r.namespace == self.namespace and any(self._allows(rule, r) for rule in self.role_rules)


@dataclass
class FakeApiServer:
    """State, HTTP app and the scheduler/kubelet hooks; `async with` runs it on a free port."""

    host: str = "127.0.0.1"
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # (plural, ns, name)
    events: list[tuple[int, str, str, dict]] = field(default_factory=list)  # (rv, type, plural, obj)
    requests: list[Recorded] = field(default_factory=list)
    logs: dict[tuple[str, str], str] = field(default_factory=dict)
    rv: int = 100
    compacted: int = 0  # watches from an older resourceVersion get 410 Expired
    port: int = 0
    rbac: Rbac | None = None  # None: every request is allowed

    def __post_init__(self) -> None:
        self._epoch = 0  # drop_watches() ends every open watch
        self._changed = asyncio.Condition()
        self._timers: dict[tuple[str, str, str], asyncio.TimerHandle] = {}
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        base = "/{prefix:path}/namespaces/{namespace}/{plural}"
        self.app = Starlette(
            routes=[
                Route("/api/v1/nodes", self._nodes, methods=["GET"]),
                Route("/api/v1/nodes/{name}", self._node, methods=["GET", "PATCH", "PUT", "DELETE"]),
                Route(base, self._collection, methods=["GET", "POST"]),
                Route(base + "/{name}", self._item, methods=["GET", "DELETE", "PUT", "PATCH"]),
                Route(base + "/{name}/log", self._log, methods=["GET"]),
            ]
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> FakeApiServer:
        with socket.socket() as s:
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for timer in self._timers.values():
            timer.cancel()
        assert self._server is not None and self._task is not None
        self._server.should_exit = True
        self._server.force_exit = True  # open watches would hold the shutdown
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, 10)

    # ------------------------------------------------------------- store

    def _kind(self, prefix: str, plural: str) -> tuple[str, str, str] | None:
        parts = prefix.strip("/").split("/")
        if parts[:1] == ["api"] and len(parts) == 2:
            key = ("", parts[1], plural)
        elif parts[:1] == ["apis"] and len(parts) == 3:
            key = (parts[1], parts[2], plural)
        else:
            return None
        return key if key in KINDS else None

    def _write(self, kind: str, plural: str, obj: dict) -> dict:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, plural, copy.deepcopy(obj)))
        del self.events[:-HISTORY]
        self._notify()
        return obj

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    def _remove(self, plural: str, ns: str, name: str) -> dict | None:
        obj = self.objects.pop((plural, ns, name), None)
        if obj is None:
            return None
        timer = self._timers.pop((plural, ns, name), None)
        if timer is not None:
            timer.cancel()
        self._write("DELETED", plural, obj)
        uid = obj["metadata"]["uid"]
        for (p, n, nm), dep in list(self.objects.items()):  # the garbage collector
            if n == ns and any(o.get("uid") == uid for o in dep["metadata"].get("ownerReferences", [])):
                self._remove(p, n, nm)
        return obj

    def pod(self, name: str, namespace: str = "default") -> dict:
        return self.objects[("pods", namespace, name)]

    def pods(self, namespace: str = "default") -> list[dict]:
        return [o for (p, ns, _), o in sorted(self.objects.items()) if p == "pods" and ns == namespace]

    def node(self, name: str) -> dict:
        return self.objects[("nodes", "", name)]

    def add_node(self, name: str, taints: list[dict] | None = None, unschedulable: bool = False) -> dict:
        """A Node as the kubelet registers it (plus what an admin may have set on it)."""
        obj: dict = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": _now(), "labels": {}},
            "spec": {"taints": copy.deepcopy(taints)} if taints else {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        if unschedulable:
            obj["spec"]["unschedulable"] = True
        self.objects[("nodes", "", name)] = obj
        return self._write("ADDED", "nodes", obj)

    def update_node(self, name: str, fn) -> dict:
        """Another client's write to a Node (an admin's `kubectl taint`): `fn` edits it."""
        node = self.node(name)
        fn(node)
        return self._write("MODIFIED", "nodes", node)

    def add(self, obj: dict, namespace: str = "default") -> dict:
        """Create an object as another client would (e.g. the agent's own Deployment)."""
        plural = {"Pod": "pods", "Deployment": "deployments"}[obj["kind"]]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
        self.objects[(plural, namespace, meta["name"])] = obj
        return self._write("ADDED", plural, obj)

    # ------------------------------------------------------------- scheduler / kubelet hooks

    def _update_pod(self, name: str, namespace: str, fn) -> dict:
        pod = self.pod(name, namespace)
        fn(pod)
        return self._write("MODIFIED", "pods", pod)

    @staticmethod
    def _set_condition(pod: dict, type_: str, status: str, reason: str = "", message: str = "") -> None:
        conds = [c for c in pod["status"].get("conditions", []) if c["type"] != type_]
        cond = {"type": type_, "status": status, "lastTransitionTime": _now()}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        pod["status"]["conditions"] = [*conds, cond]

    def why_not_fits(self, pod: dict, node: str) -> str:
        """What the scheduler's node filters would say about placing `pod` on `node` (only
        cordons and NoSchedule/NoExecute taints, not resources): "" when it fits. A node this
        fake does not hold fits (tests that do not model nodes)."""
        obj = self.objects.get(("nodes", "", node))
        if obj is None:
            return ""
        if obj["spec"].get("unschedulable"):
            return f"node {node} is unschedulable"
        tolerations = pod["spec"].get("tolerations") or []
        for taint in obj["spec"].get("taints") or []:
            if taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            if not any(_tolerates(t, taint) for t in tolerations):
                return f"node {node} has the untolerated taint {taint['key']}={taint.get('value', '')}"
        return ""

    def schedule(self, name: str, node: str = "node-1", namespace: str = "default") -> dict:
        """Bind the pod to `node`, as the scheduler would (AssertionError if it would not)."""
        why = self.why_not_fits(self.pod(name, namespace), node)
        assert not why, f"the scheduler would not place {name}: {why}"

        def bind(pod: dict) -> None:
            pod["spec"]["nodeName"] = node
            self._set_condition(pod, "PodScheduled", "True")

        return self._update_pod(name, namespace, bind)

    def unschedulable(self, name: str, message: str, namespace: str = "default") -> dict:
        return self._update_pod(
            name,
            namespace,
            lambda pod: self._set_condition(pod, "PodScheduled", "False", "Unschedulable", message),
        )

    def _container_statuses(self, pod: dict, state: dict, ready: bool, restarts: int = 0) -> None:
        pod["status"]["containerStatuses"] = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": ready,
                "restartCount": restarts,
                "started": "running" in state,
                "state": state,
            }
            for c in pod["spec"]["containers"]
        ]

    def run(self, name: str, ready: bool, ip: str = "10.0.0.7", namespace: str = "default") -> dict:
        def running(pod: dict) -> None:
            pod["status"].update(phase="Running", podIP=ip, podIPs=[{"ip": ip}], hostIP="10.1.0.1")
            pod["status"].setdefault("startTime", _now())
            self._container_statuses(pod, {"running": {"startedAt": _now()}}, ready)
            self._set_condition(pod, "ContainersReady", "True" if ready else "False")
            self._set_condition(pod, "Ready", "True" if ready else "False")

        return self._update_pod(name, namespace, running)

    def wait_container(self, name: str, reason: str, message: str, namespace: str = "default") -> dict:
        return self._update_pod(
            name,
            namespace,
            lambda pod: self._container_statuses(
                pod, {"waiting": {"reason": reason, "message": message}}, ready=False
            ),
        )

    def terminate(
        self, name: str, exit_code: int, reason: str = "Error", namespace: str = "default", log: str = ""
    ) -> dict:
        if log:
            self.logs[(namespace, name)] = log

        def done(pod: dict) -> None:
            pod["status"]["phase"] = "Failed" if exit_code else "Succeeded"
            state = {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": _now()}}
            self._container_statuses(pod, state, ready=False)
            self._set_condition(pod, "Ready", "False", "PodFailed")

        return self._update_pod(name, namespace, done)

    def node_shutdown(self, name: str, namespace: str = "default") -> dict:
        """What the kubelet's graceful node shutdown writes when a spot VM is reclaimed."""

        def shutdown(pod: dict) -> None:
            pod["status"].update(
                phase="Failed",
                reason="Terminated",
                message="Pod was terminated in response to imminent node shutdown.",
            )
            self._set_condition(
                pod,
                "DisruptionTarget",
                "True",
                "TerminationByKubelet",
                "Pod was terminated in response to imminent node shutdown.",
            )
            self._set_condition(pod, "Ready", "False")
            state = {"terminated": {"exitCode": 143, "reason": "Error", "finishedAt": _now()}}
            self._container_statuses(pod, state, ready=False)

        return self._update_pod(name, namespace, shutdown)

    def finish_termination(self, name: str, namespace: str = "default") -> None:
        """The kubelet saw the containers of a terminating pod exit: the pod goes."""
        pod = self.pod(name, namespace)
        assert pod["metadata"].get("deletionTimestamp"), "pod is not terminating"
        self._remove("pods", namespace, name)

    # ------------------------------------------------------------- HTTP

    def _record(self, request: Request, verb: str, plural: str) -> Response | None:
        """Record the request; a 403 Status when the RBAC rules do not allow it."""
        parts = request.path_params.get("prefix", "api/v1").strip("/").split("/")
        group = parts[1] if parts[0] == "apis" else ""
        ns = request.path_params.get("namespace", "")
        name = request.path_params.get("name", "")
        recorded = Recorded(request.method, plural, verb, group, ns, name)
        self.requests.append(recorded)
        if self.rbac is None or self.rbac.allows(recorded):
            return None
        where = f'in the namespace "{ns}"' if ns else "at the cluster scope"
        resource = f"{plural}.{group}" if group else plural
        return _status(
            403,
            "Forbidden",
            f'{resource} "{name}" is forbidden: User "system:serviceaccount:{self.rbac.namespace}:fleet-agent" '
            f'cannot {verb} resource "{plural}" in API group "{group}" {where}',
        )

    async def _collection(self, request: Request) -> Response:
        key = self._kind(request.path_params["prefix"], request.path_params["plural"])
        ns, plural = request.path_params["namespace"], request.path_params["plural"]
        if key is None:
            return _status(404, "NotFound", "the server could not find the requested resource")
        kind = KINDS[key]
        if request.method == "POST":
            return self._record(request, "create", plural) or await self._create(
                request, key, kind, ns, plural
            )
        try:
            reqs = parse_selector(request.query_params.get("labelSelector", ""))
            field_reqs = parse_field_selector(request.query_params.get("fieldSelector", ""))
        except ValueError as err:
            return _status(400, "BadRequest", str(err))
        if field_reqs and plural != "pods":
            return _status(400, "BadRequest", "this fake serves field selectors on pods only")
        if request.query_params.get("watch") in ("true", "1"):
            if field_reqs:
                return _status(400, "BadRequest", "this fake serves field selectors on list only")
            if denied := self._record(request, "watch", plural):
                return denied
            return StreamingResponse(
                self._watch(plural, ns, reqs, request.query_params.get("resourceVersion", ""), request),
                media_type="application/json",
            )
        if denied := self._record(request, "list", plural):
            return denied
        items = [
            o
            for (p, n, _), o in sorted(self.objects.items())
            if p == plural
            and n == ns
            and selector_matches(reqs, o["metadata"].get("labels", {}))
            and fields_match(field_reqs, o)
        ]
        body = {
            "kind": f"{kind}List",
            "apiVersion": f"{key[0]}/{key[1]}".lstrip("/"),
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }
        return JSONResponse(body)

    async def _create(self, request: Request, key: tuple, kind: str, ns: str, plural: str) -> Response:
        try:
            obj = json.loads(await request.body())
        except ValueError:
            return _status(400, "BadRequest", "the body is not JSON")
        want_api = f"{key[0]}/{key[1]}".lstrip("/")
        if obj.get("kind") != kind or obj.get("apiVersion") != want_api:
            return _status(400, "BadRequest", f"expected {want_api} {kind}")
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            return _status(422, "Invalid", f"{kind} is invalid: metadata.name: Required value")
        if meta.get("namespace", ns) != ns:
            return _status(400, "BadRequest", "the namespace of the object does not match the request")
        if (plural, ns, name) in self.objects:
            return _status(409, "AlreadyExists", f'{plural} "{name}" already exists', name=name, kind=plural)
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        meta.pop("resourceVersion", None)
        if kind == "Pod":
            obj["status"] = {"phase": "Pending", "qosClass": "Burstable"}
        self.objects[(plural, ns, name)] = obj
        self._write("ADDED", plural, obj)
        return JSONResponse(obj, status_code=201)

    async def _item(self, request: Request) -> Response:
        key = self._kind(request.path_params["prefix"], request.path_params["plural"])
        ns, plural, name = (request.path_params[k] for k in ("namespace", "plural", "name"))
        if key is None:
            return _status(404, "NotFound", "the server could not find the requested resource")
        verb = {"GET": "get", "DELETE": "delete", "PUT": "update", "PATCH": "patch"}[request.method]
        if denied := self._record(request, verb, plural):
            return denied
        obj = self.objects.get((plural, ns, name))
        if obj is None:
            return _status(404, "NotFound", f'{plural} "{name}" not found', name=name, kind=plural)
        if request.method == "GET":
            return JSONResponse(obj)
        if request.method == "PATCH":
            return await self._patch(request, plural, ns, name, obj)
        if request.method != "DELETE":
            return _status(405, "MethodNotAllowed", f"{request.method} is not served by this fake")
        grace: int | None = None
        body = await request.body()
        if body:
            with contextlib.suppress(ValueError):
                grace = json.loads(body).get("gracePeriodSeconds")
        if "gracePeriodSeconds" in request.query_params:
            grace = int(request.query_params["gracePeriodSeconds"])
        if plural != "pods":
            return JSONResponse(self._remove(plural, ns, name))
        if grace is None:
            grace = int(obj["spec"].get("terminationGracePeriodSeconds", 30))
        meta = obj["metadata"]
        if grace <= 0 or not obj["spec"].get("nodeName"):
            return JSONResponse(self._remove(plural, ns, name))
        current = meta.get("deletionGracePeriodSeconds")
        if current is not None and grace >= current:
            return JSONResponse(obj)  # a second delete may only shorten the grace period
        meta["deletionTimestamp"] = datetime.fromtimestamp(time.time() + grace, timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        meta["deletionGracePeriodSeconds"] = grace
        self._write("MODIFIED", plural, obj)
        old = self._timers.pop((plural, ns, name), None)
        if old is not None:
            old.cancel()
        self._timers[(plural, ns, name)] = asyncio.get_running_loop().call_later(
            grace, self._remove, plural, ns, name
        )
        return JSONResponse(obj, status_code=202)

    async def _patch(self, request: Request, plural: str, ns: str, name: str, obj: dict) -> Response:
        kind = request.headers.get("content-type", "").split(";")[0].strip()
        if kind != "application/merge-patch+json":
            return _status(415, "UnsupportedMediaType", f"the fake serves merge patches only, not {kind!r}")
        try:
            patch = json.loads(await request.body())
        except ValueError:
            return _status(400, "BadRequest", "the body is not JSON")
        if not isinstance(patch, dict):
            return _status(400, "BadRequest", "a merge patch is a JSON object")
        want = (patch.get("metadata") or {}).get("resourceVersion")
        if want and want != obj["metadata"]["resourceVersion"]:
            return _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {plural} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                name=name,
                kind=plural,
            )
        patched = merge_patch(obj, patch)
        meta = patched["metadata"]
        if meta.get("name") != name or meta.get("uid") != obj["metadata"]["uid"]:
            return _status(422, "Invalid", "metadata.name and metadata.uid cannot change")
        self.objects[(plural, ns, name)] = patched
        return JSONResponse(self._write("MODIFIED", plural, patched))

    async def _nodes(self, request: Request) -> Response:
        if denied := self._record(request, "watch" if request.query_params.get("watch") else "list", "nodes"):
            return denied
        return _status(405, "MethodNotAllowed", "this fake does not list or watch nodes")

    async def _node(self, request: Request) -> Response:
        name = request.path_params["name"]
        verb = {"GET": "get", "DELETE": "delete", "PUT": "update", "PATCH": "patch"}[request.method]
        if denied := self._record(request, verb, "nodes"):
            return denied
        obj = self.objects.get(("nodes", "", name))
        if obj is None:
            return _status(404, "NotFound", f'nodes "{name}" not found', name=name, kind="nodes")
        if request.method == "GET":
            return JSONResponse(obj)
        if request.method == "PATCH":
            return await self._patch(request, "nodes", "", name, obj)
        return _status(405, "MethodNotAllowed", f"{request.method} is not served by this fake")

    async def _log(self, request: Request) -> Response:
        ns, name = request.path_params["namespace"], request.path_params["name"]
        if denied := self._record(request, "get", "pods/log"):
            return denied
        if ("pods", ns, name) not in self.objects:
            return _status(404, "NotFound", f'pods "{name}" not found')
        text = self.logs.get((ns, name), "")
        tail = request.query_params.get("tailLines")
        if tail is not None:
            text = "\n".join(text.splitlines()[-int(tail) :])
        return PlainTextResponse(text)

    async def _watch(
        self, plural: str, ns: str, reqs: list, since: str, request: Request
    ) -> AsyncIterator[bytes]:
        def line(type_: str, obj: dict) -> bytes:
            return json.dumps({"type": type_, "object": obj}).encode() + b"\n"

        def wanted(obj: dict) -> bool:
            meta = obj["metadata"]
            return meta.get("namespace") == ns and selector_matches(reqs, meta.get("labels", {}))

        if since in ("", "0"):
            cursor = self.rv
            for (p, _ns, _), obj in sorted(self.objects.items()):
                if p == plural and wanted(obj):
                    yield line("ADDED", obj)
        else:
            cursor = int(since)
            oldest = self.events[0][0] - 1 if self.events else self.rv
            if cursor < max(self.compacted, oldest):
                status = {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {cursor} ({max(self.compacted, oldest)})",
                    "reason": "Expired",
                    "code": 410,
                }
                yield line("ERROR", status)
                return
        timeout = float(request.query_params.get("timeoutSeconds", 300))
        deadline = time.monotonic() + timeout
        epoch = self._epoch
        while time.monotonic() < deadline and epoch == self._epoch:
            for rv, type_, p, obj in list(self.events):
                if rv <= cursor:
                    continue
                cursor = rv
                if p == plural and wanted(obj):
                    yield line(type_, obj)
            async with self._changed:
                if self.events and self.events[-1][0] > cursor:
                    continue
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._changed.wait(), max(0.01, min(1.0, deadline - time.monotonic()))
                    )

    def compact(self) -> None:
        """Forget the watch history (etcd compaction): older resourceVersions get 410."""
        self.compacted = self.rv
        del self.events[:]

    def drop_watches(self) -> None:
        """End every open watch stream (an API server restart, a load balancer timeout)."""
        self._epoch += 1
        self._notify()
