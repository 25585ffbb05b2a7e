"""API keys. The secret is returned once, by create; the database keeps salt and hash.
Revoking takes effect on this API at once and on gateways when the control loops
republish `fleet_keys`. A key's webhook signing secret is derived from the fleet's webhook
master secret and the key's secret version (`fleet_base.batch.webhook_signing`): shown once
on create and on rotation, never stored."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError
from sqlalchemy import select

from control_plane.api.audit import audit
from control_plane.api.deps import PagingDep, PrincipalDep, SessionDep, kick
from control_plane.api.errors import ApiError, conflict, invalid, not_found
from control_plane.api.schemas import (
    KeyCreate,
    KeyCreated,
    KeyOut,
    KeyUpdate,
    Page,
    QuotasIn,
    WebhookSecretOut,
)
from control_plane.api.views import key_out
from control_plane.db.models import ApiKey, utcnow
from control_plane.loops.usage import initial_shares
from fleet_base.api_keys import hash_secret, new_secret
from fleet_base.batch.webhook_signing import key_secret, read_master

router = APIRouter(prefix="/v1/keys", tags=["keys"])


def make_key(
    name: str,
    scopes: list[str],
    deployments: list[str] | None,
    quotas: dict,
    residency: list[str] | None = None,
    team: str | None = None,
) -> tuple[ApiKey, str]:
    """A new ApiKey row and its secret (not stored)."""
    key_id, secret = new_secret()
    salt, digest = hash_secret(secret)
    row = ApiKey(
        key_id=key_id,
        name=name,
        salt=salt,
        hash=digest,
        scopes=list(scopes),
        deployments=None if deployments is None else list(deployments),
        quotas=quotas,
        residency=None if residency is None else list(residency),
        team=team,
    )
    return row, secret


def webhook_master(request: Request) -> bytes | None:
    """The fleet's webhook master secret (FLEET_WEBHOOK_MASTER); None when not configured."""
    path = request.app.state.ctx.settings.webhook_master_file
    if path is None:
        return None
    try:
        return read_master(path)
    except (OSError, ValueError) as err:
        raise ApiError(503, f"the webhook master secret is unreadable ({type(err).__name__})") from None


@router.post("", status_code=201, response_model=KeyCreated)
def create_key(body: KeyCreate, request: Request, session: SessionDep, who: PrincipalDep):
    row, secret = make_key(
        body.name, body.scopes, body.deployments, body.quotas.model_dump(), body.residency, body.team
    )
    row.shares = initial_shares(session, row.quotas)  # multi-region budgets (docs/quotas.md)
    session.add(row)
    session.flush()
    out = key_out(row)
    audit(session, who, "key.create", "key", row.key_id, None, out)
    session.commit()
    kick(request)
    master = webhook_master(request)
    signing = key_secret(master, row.key_id, row.webhook_secret_version or 0) if master else None
    return KeyCreated(**out.model_dump(), key=secret, webhook_secret=signing)


@router.post("/{key_id}/webhook-secret", response_model=WebhookSecretOut)
def rotate_webhook_secret(key_id: str, request: Request, session: SessionDep, who: PrincipalDep):
    """A new webhook signing secret for the key, shown once; gateways sign with it from the
    next publish of `fleet_keys` (the old one stops verifying then)."""
    master = webhook_master(request)
    if master is None:
        raise conflict("this control plane has no webhook master secret (FLEET_WEBHOOK_MASTER)")
    row = session.get(ApiKey, key_id)
    if row is None:
        raise not_found("key", key_id)
    if row.revoked_at is not None:
        raise conflict(f"key {key_id!r} is revoked")
    before = {"webhook_secret_version": row.webhook_secret_version or 0}
    row.webhook_secret_version = before["webhook_secret_version"] + 1
    session.flush()
    after = {"webhook_secret_version": row.webhook_secret_version}
    audit(session, who, "key.webhook_secret", "key", key_id, before, after)
    session.commit()
    kick(request)
    return WebhookSecretOut(
        key_id=key_id,
        webhook_secret=key_secret(master, key_id, row.webhook_secret_version),
        webhook_secret_version=row.webhook_secret_version,
    )


@router.get("", response_model=Page[KeyOut])
def list_keys(
    session: SessionDep,
    who: PrincipalDep,
    page: PagingDep,
    include_revoked: bool = Query(True),
):
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    rows, total = page.apply(session, query)
    return Page(items=[key_out(r) for r in rows], total=total, limit=page.limit, offset=page.offset)


@router.get("/{key_id}", response_model=KeyOut)
def get_key(key_id: str, session: SessionDep, who: PrincipalDep):
    row = session.get(ApiKey, key_id)
    if row is None:
        raise not_found("key", key_id)
    return key_out(row)


@router.patch("/{key_id}", response_model=KeyOut)
def update_key(key_id: str, body: KeyUpdate, request: Request, session: SessionDep, who: PrincipalDep):
    """Change a key's name, deployments, quotas, residency or team; gateways apply it at the
    next publish."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise not_found("key", key_id)
    before = key_out(row)
    if body.name is not None:
        row.name = body.name
    if "deployments" in body.model_fields_set:
        row.deployments = None if body.deployments is None else list(body.deployments)
    if "residency" in body.model_fields_set:
        row.residency = None if body.residency is None else list(body.residency)
    if "team" in body.model_fields_set:
        row.team = body.team
    if body.quotas is not None:
        merged = {**(row.quotas or {}), **body.quotas}
        try:
            quotas = QuotasIn.model_validate(merged)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise invalid(f"quotas.{where}" if where else "quotas", first["msg"]) from None
        row.quotas = quotas.model_dump()
        if not row.shares:
            row.shares = initial_shares(session, row.quotas)
    session.flush()
    after = key_out(row)
    audit(session, who, "key.update", "key", key_id, before, after)
    session.commit()
    kick(request)
    return after


@router.delete("/{key_id}", response_model=KeyOut)
def revoke_key(key_id: str, request: Request, session: SessionDep, who: PrincipalDep):
    row = session.get(ApiKey, key_id)
    if row is None:
        raise not_found("key", key_id)
    if row.revoked_at is not None:
        return key_out(row)
    before = key_out(row)
    row.revoked_at = utcnow()
    session.flush()
    after = key_out(row)
    audit(session, who, "key.revoke", "key", key_id, before, after)
    session.commit()
    request.app.state.token_cache.invalidate(key_id)
    kick(request)
    return after
