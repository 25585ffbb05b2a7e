"""The FastAPI application of one replica; the engine is injected through `ServerState`."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from engine.outputs import EngineStats
from engine.server.chat import create_chat_completion
from engine.server.completions import create_completion
from engine.server.embeddings import create_embedding
from engine.server.errors import APIError, install_error_handlers
from engine.server.inputs import chat_prompt_ids, check_model, check_token_ids, parse_body
from engine.server.kv_events import register as register_kv_events
from engine.server.lora import adapter_cards
from engine.server.lora import register as register_lora
from engine.server.metrics import ServerMetrics
from engine.server.middleware import GuardMiddleware
from engine.server.responses import create_response
from engine.server.state import EngineClient, ServerSettings, ServerState
from engine.timing import HistogramSnapshot
from fleet_base.openai_contract.openapi import openapi_document
from fleet_base.openai_contract.requests import DetokenizeRequest, TokenizeRequest


def new_state(settings: ServerSettings, engine: EngineClient | None = None) -> ServerState:
    """A state whose metrics read the engine's stats once it is there."""
    state = ServerState(settings=settings, metrics=ServerMetrics(settings.served_model_name), engine=engine)
    state.created = time.time()

    def stats() -> EngineStats | None:
        return state.engine.stats() if state.engine is not None else None

    def grammar_timings() -> dict[str, HistogramSnapshot]:
        timings = getattr(state.engine, "grammar_timings", None)
        return timings() if timings is not None else {}

    state.metrics.stats = stats
    state.metrics.grammar_timings = grammar_timings
    return state


OPENAI_ROUTES = (
    ("/v1/chat/completions", create_chat_completion),
    ("/v1/completions", create_completion),
    ("/v1/embeddings", create_embedding),
    ("/v1/responses", create_response),
)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Fleet engine", version="1", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.fleet = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)
    _register_probes(app, state)
    if state.settings.test_hooks:
        _register_debug(app, state)
    _register_openai(app, state)
    _register_tokens(app, state)
    register_kv_events(app, state)
    register_lora(app, state)
    return app


def _engine(state: ServerState) -> EngineClient:
    if state.engine is None:  # the guard refuses earlier; this is for type checkers
        raise APIError(503, "The model is still loading; retry shortly")
    return state.engine


def _health(state: ServerState) -> Response:
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.engine is None:
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)
    if not getattr(state.engine, "is_running", True):
        return JSONResponse({"status": "dead", "error": "the engine loop has stopped"}, status_code=503)
    stalled = getattr(state.engine, "stalled_for", lambda: 0.0)()
    if stalled > state.settings.stall_timeout_s:
        error = f"the engine loop has had work and made no step for {stalled:.0f} s"
        return JSONResponse({"status": "stalled", "error": error}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.settings.served_model_name})


def _register_probes(app: FastAPI, state: ServerState) -> None:
    """Health, metrics and the OpenAPI document: what orchestrators and scrapers read."""

    @app.get("/health")
    async def health() -> Response:
        return _health(state)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return JSONResponse(openapi_document("Fleet engine", bearer=state.settings.api_key is not None))

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _register_debug(app: FastAPI, state: ServerState) -> None:
    """Test hooks (only with `test_hooks`): freeze and thaw the engine loop; corrupt and
    uncorrupt its answers (a silent fault the correctness probe must catch)."""

    @app.post("/debug/freeze")
    async def freeze() -> Response:
        _engine(state).freeze(True)  # type: ignore[attr-defined]
        return JSONResponse({"frozen": True})

    @app.post("/debug/thaw")
    async def thaw() -> Response:
        _engine(state).freeze(False)  # type: ignore[attr-defined]
        return JSONResponse({"frozen": False})

    @app.post("/debug/corrupt")
    async def corrupt() -> Response:
        _engine(state).corrupt(True)  # type: ignore[attr-defined]
        return JSONResponse({"corrupt": True})

    @app.post("/debug/uncorrupt")
    async def uncorrupt() -> Response:
        _engine(state).corrupt(False)  # type: ignore[attr-defined]
        return JSONResponse({"corrupt": False})


def _register_openai(app: FastAPI, state: ServerState) -> None:
    """The model list and the OpenAI generation and embedding endpoints."""

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": state.settings.served_model_name,
            "object": "model",
            "created": int(state.created),
            "owned_by": "fleet",
            "max_model_len": _engine(state).max_model_len,
        }
        cards = adapter_cards(state, card["created"], card["max_model_len"])
        if cards:
            card |= {"root": state.settings.served_model_name, "parent": None}
        return JSONResponse({"object": "list", "data": [card, *cards]})

    for path, create in OPENAI_ROUTES:
        app.add_api_route(path, _bound(create, state), methods=["POST"], name=create.__name__)


def _bound(
    create: Callable[[Request, ServerState], Awaitable[Response]], state: ServerState
) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await create(request, state)

    return route


def _register_tokens(app: FastAPI, state: ServerState) -> None:
    """Tokenize and detokenize with the served model's tokenizer (and chat template)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest)
        check_model(state, body.model)
        eng = _engine(state)
        if body.messages is not None:
            ids = chat_prompt_ids(eng, body.messages, None, body.add_generation_prompt)
        else:
            ids = eng.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        out: dict[str, object] = {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = eng.tokenizer.token_texts(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest)
        check_model(state, body.model)
        eng = _engine(state)
        check_token_ids(eng, body.tokens, "tokens")
        return JSONResponse({"prompt": eng.tokenizer.decode(body.tokens, skip_special_tokens=False)})
