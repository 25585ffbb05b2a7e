"""The OpenAI-compatible HTTP server of one engine replica (`python -m engine.server`).

`build_app(new_state(settings, engine))` gives the FastAPI app for any object shaped like
`engine.AsyncLLM`; the launcher adds background loading, signals and draining.
"""

from engine.server.app import build_app, new_state
from engine.server.state import EngineClient, ServerSettings, ServerState

__all__ = ["EngineClient", "ServerSettings", "ServerState", "build_app", "new_state"]
