"""`python -m engine.server`: parse flags, listen at once, load the engine in the background,
and on SIGTERM stop admitting, drain in-flight requests (bounded), then exit 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any

import uvicorn

from engine.server.app import build_app, new_state
from engine.server.spec_flags import add_speculative_flags, speculative_config
from engine.server.state import ServerSettings, ServerState
from fleet_base import heap_trim, tracing
from fleet_base.listener import ListenerLimits, uvicorn_options

log = logging.getLogger("engine.server")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}


def byte_size(text: str) -> int:
    """'1048576', '512MiB', '2G' -> bytes."""
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    if unit not in _UNITS or not num:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 512MiB, 2GiB)")
    return int(float(num) * _UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.server", description=__doc__)
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="model alias, path (GGUF file or HF directory) or URI (s3://, hf://, oci://, https://...#sha256=)",
    )
    p.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        # stripped: a token from a Kubernetes Secret keeps its file's trailing newline
        default=os.environ.get("FLEET_ENGINE_API_KEY", "").strip() or None,
        help="require 'Authorization: Bearer KEY' on the API (default: $FLEET_ENGINE_API_KEY)",
    )
    p.add_argument(
        "--ssl-certfile",
        default=os.environ.get("FLEET_ENGINE_SSL_CERTFILE"),
        help="serve HTTPS with this certificate (default: $FLEET_ENGINE_SSL_CERTFILE)",
    )
    p.add_argument("--ssl-keyfile", default=os.environ.get("FLEET_ENGINE_SSL_KEYFILE"))
    p.add_argument(
        "--max-request-bytes", type=byte_size, default=1 << 20, help="largest request body (413 above)"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to drain in-flight requests on SIGTERM"
    )
    p.add_argument(
        "--drain-handover",
        type=float,
        default=5.0,
        help="seconds into a drain after which streams a gateway can continue elsewhere are handed over",
    )
    p.add_argument(
        "--embedding-pooling",
        choices=["mean", "last"],
        default="mean",
        help="/v1/embeddings: mean of the prompt's last hidden states, or the last token's",
    )
    p.add_argument(
        "--no-embedding-normalize",
        dest="embedding_normalize",
        action="store_false",
        help="/v1/embeddings: return raw pooled vectors instead of L2-normalized ones",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="seconds the engine loop may have work and make no step before /health says stalled",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument(
        "--threads", type=int, default=None, help="pin torch intra-op threads (default: tuned per step)"
    )
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=None)
    e.add_argument("--device", default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-queue-len", type=int, default=None, help="waiting requests beyond this get 429")
    e.add_argument(
        "--max-unread-bytes",
        type=byte_size,
        default=os.environ.get("FLEET_ENGINE_MAX_UNREAD_BYTES"),
        help="output a streaming client may leave unread before its request is aborted and its KV "
        "freed, e.g. 4MiB (default: $FLEET_ENGINE_MAX_UNREAD_BYTES, else 4MiB)",
    )
    e.add_argument(
        "--kv-cache-memory", type=byte_size, default=None, help="bytes for the KV cache, e.g. 2GiB"
    )
    e.add_argument("--num-gpu-blocks-override", type=int, default=None)
    e.add_argument(
        "--kv-offloading-size",
        dest="kv_offloading_size_gib",
        type=float,
        default=None,
        metavar="GIB",
        help="host memory (GiB) for a KV tier below the device cache: evicted prefix blocks are kept "
        "there and loaded back on a hit instead of recomputed (vLLM's flag; 0 = off, the default)",
    )
    e.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        metavar="N",
        help="a prompt with more than N tokens left to prefill takes at most N of a step's tokens while "
        "shorter prompts want them, so they are not queued behind it (vLLM's flag; 0 = off, the default)",
    )
    e.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=None,
        metavar="N",
        help="long prompts (above --long-prefill-token-threshold) prefilled at once (default 1)",
    )
    e.add_argument(
        "--low-priority-step-ms",
        dest="low_priority_step_s",
        type=lambda v: float(v) / 1000.0,
        default=None,
        metavar="MS",
        help="prefill of batch-class requests held to about this much time per step, so an "
        "interactive request arriving mid-step waits at most that long for it (default 20; 0 = no limit)",
    )
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default=None)
    e.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    e.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", default=None)
    e.add_argument("--seed", type=int, default=None)
    e.add_argument(
        "--weights",
        choices=["fp32", "fp16", "bf16", "int8", "int4", "auto"],
        default=None,
        help="linear-layer weight format (auto: fastest measured here; see docs/engine.md)",
    )
    e.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None)
    lo = p.add_argument_group("LoRA adapters (vLLM's flags)")
    lo.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    lo.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help='adapters loaded at start: NAME=PATH (a directory or a model URI) or JSON {"name", "path"}; '
        "implies --enable-lora",
    )
    lo.add_argument("--max-loras", type=int, default=None, help="adapters in one step (device slots)")
    lo.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted")
    lo.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters whose weights stay in CPU memory"
    )
    add_speculative_flags(p)
    return p


def lora_module(text: str) -> tuple[str, str]:
    """'NAME=PATH' or vLLM's JSON form '{"name": ..., "path": ...}' -> (name, path)."""
    import json

    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
            name, path = obj["name"], obj["path"]
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'not a LoRA module {text!r}: want {{"name": ..., "path": ...}}'
            ) from None
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"not a LoRA module {text!r}: want NAME=PATH")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"not a LoRA module {text!r}: the name and path must be non-empty")
    return str(name), str(path)


# Set to 1 (tests only) to expose POST /debug/freeze, /debug/thaw, /debug/corrupt, /debug/uncorrupt.
TEST_HOOKS_ENV = "FLEET_ENGINE_TEST_HOOKS"

_ENGINE_FLAGS = (
    "dtype",
    "device",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_queue_len",
    "max_unread_bytes",
    "kv_cache_memory",
    "num_gpu_blocks_override",
    "kv_offloading_size_gib",
    "low_priority_step_s",
    "long_prefill_token_threshold",
    "max_long_partial_prefills",
    "weights",
    "cuda_graphs",
    "block_size",
    "attention_backend",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "seed",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
)


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    kwargs = {k: getattr(ns, k) for k in _ENGINE_FLAGS if getattr(ns, k) is not None}
    if getattr(ns, "lora_modules", None):
        kwargs["enable_lora"] = True
    if ns.threads is not None:  # pinned; otherwise the engine tunes threads per step
        kwargs["num_threads"] = max(1, ns.threads)
    kwargs["speculative_config"] = speculative_config(ns)  # None: off
    kwargs["show_progress"] = False
    return kwargs


class _Server(uvicorn.Server):
    """uvicorn with our signal handling: drain first, never re-raise the signal (exit 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGTERM, signal.SIGINT)
        for sig in sigs:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain is not None:  # a second signal: stop now
            log.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            self.force_exit = self.should_exit = True
            return
        log.info(
            "%s: refusing new requests, draining %d in flight", signal.Signals(sig).name, self.state.in_flight
        )
        self.state.draining = True
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        state = self.state
        handover = min(state.settings.drain_handover_s, state.settings.drain_timeout)
        if not await state.wait_idle(handover):  # short requests are done by now
            n = state.hand_over_streams()
            log.info("drain: handed %d stream(s) over to the gateway for migration", n)
        if not await state.wait_idle(max(0.0, state.settings.drain_timeout - handover)):
            log.warning("drain timeout: aborting %d requests", len(state.active_requests))
            if state.engine is not None:
                for rid in list(state.active_requests):
                    await state.engine.abort(rid)
            await state.wait_idle(5.0)
        self.should_exit = True


def _load_engine(
    model: str,
    served: str,
    kwargs: dict[str, Any],
    state: ServerState,
    loop: asyncio.AbstractEventLoop,
    server: _Server,
    lora_modules: Sequence[tuple[str, str]] = (),
) -> None:
    """Runs on a thread so /health can answer 503 while the weights load (and, for a URI
    not in the node's cache yet, while it is pulled). Each part is timed into
    `fleet_engine_startup_seconds`; one warm-up token runs before the replica says ready."""
    phases = state.metrics.startup
    try:
        from engine.async_llm import AsyncLLM
        from engine.model_files.aliases import resolve_model_path
        from fleet_base.models import ModelCache, is_remote

        path = model
        if is_remote(model):
            cached = ModelCache().lookup(model) is not None
            t0 = time.perf_counter()
            path = str(resolve_model_path(model))
            if not cached:  # the agent pre-pulls; a standalone server fetches it here
                phases["pull"] = round(time.perf_counter() - t0, 4)
        t1 = time.perf_counter()
        engine = AsyncLLM(model=path, served_model_name=served, **kwargs)
        phases["load"] = round(time.perf_counter() - t1, 4)
        adapters = []
        if lora_modules:
            from engine.server.lora import adapter_dir

            assert engine.lora is not None
            for name, source in lora_modules:
                adapters.append((engine.lora.add(name, str(adapter_dir(source)), (served,)), source))
        t2 = time.perf_counter()
        asyncio.run_coroutine_threadsafe(_warm_up(engine), loop).result(timeout=600)
        phases["warmup"] = round(time.perf_counter() - t2, 4)
    except BaseException as err:
        log.exception("the engine failed to load")
        message = f"The engine failed to load: {err}"

        def fail() -> None:
            state.load_error = message
            server.should_exit = True

        loop.call_soon_threadsafe(fail)
        return

    def ready() -> None:
        if state.draining:
            engine.shutdown()
            return
        state.engine = engine
        for adapter, source in adapters:
            state.lora_sources[adapter.name] = source
            state.metrics.lora_loaded(adapter.load_seconds, len(adapters))
        log.info("ready: serving %r (max_model_len=%d)", served, engine.max_model_len)

    loop.call_soon_threadsafe(ready)


async def _warm_up(engine: Any) -> None:
    """One greedy token through the whole stack (kernels compiled, caches touched), so the
    first real request does not pay for it."""
    from fleet_base.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    async for _ in engine.generate("Hello", params, request_id="fleet-warmup"):
        pass


async def _serve(ns: argparse.Namespace, settings: ServerSettings) -> int:
    served = settings.served_model_name
    tracing.setup("fleet-engine", attributes={tracing.MODEL: served})
    state = new_state(settings)
    config = uvicorn.Config(
        build_app(state),
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        access_log=ns.access_log,
        timeout_graceful_shutdown=5,
        lifespan="off",
        ssl_certfile=ns.ssl_certfile,
        ssl_keyfile=ns.ssl_keyfile,
        **uvicorn_options(behind_pool=True),  # the gateway's pool closes idle connections first
    )
    server = _Server(config, state)
    loader = threading.Thread(
        target=_load_engine,
        args=(
            ns.model,
            served,
            engine_kwargs(ns),
            state,
            asyncio.get_running_loop(),
            server,
            ns.lora_modules or (),
        ),
        name="engine-load",
        daemon=True,
    )
    loader.start()
    await server.serve()
    if state.engine is not None:
        state.engine.shutdown()
    tracing.flush()
    return 1 if state.load_error else 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # fail fast on bad flags, before listening
        from engine.config import EngineArgs

        EngineArgs(model=ns.model, **engine_kwargs(ns))
        settings = ServerSettings(
            served_model_name=ns.served_model_name or ns.model,
            api_key=ns.api_key or None,
            max_request_bytes=ns.max_request_bytes,
            drain_timeout=ns.drain_timeout,
            drain_handover_s=ns.drain_handover,
            embedding_pooling=ns.embedding_pooling,
            embedding_normalize=ns.embedding_normalize,
            stall_timeout_s=ns.stall_timeout,
            test_hooks=os.environ.get(TEST_HOOKS_ENV) == "1",
        )
        ListenerLimits.from_env(behind_pool=True)
        heap_trim.interval_from_env()
    except Exception as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if ns.threads is not None:
        import torch

        torch.set_num_threads(max(1, ns.threads))
    heap_trim.start(tune_allocator=False)
    return asyncio.run(_serve(ns, settings))
