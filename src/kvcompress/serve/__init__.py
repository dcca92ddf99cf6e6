"""``kvcompress serve``: an OpenAI-compatible HTTP server over the engine (needs ``pip install kvcompress[serve]``).

    kvcompress serve --method snapkv --ratio 0.1 --kv-memory 1GiB --host 127.0.0.1 --port 8000

``run`` starts uvicorn on ``build_app``; SIGTERM (or Ctrl-C) stops accepting at once, lets
running requests finish for half of ``grace_s`` seconds, stops the rest (each answered with a 503
error in OpenAI's shape, or an error event on a stream) and exits within ``grace_s``.
"""

from __future__ import annotations

import time


def run(llm, *, model_name: str, method, host: str = "127.0.0.1", port: int = 8000, limits=None, max_queued: int = 256,
        grace_s: float = 8.0, log_level: str = "info") -> None:
    """Serve ``llm`` until SIGTERM or Ctrl-C."""
    import uvicorn

    from .app import build_app

    app = build_app(llm, model_name=model_name, method=method, limits=limits, max_queued=max_queued, grace_s=grace_s / 2)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # stop taking requests the moment the signal comes
            loop = app.state.engine.get("loop")
            if loop is not None:  # the engine's grace starts now, so stopped requests are answered before uvicorn's ends
                loop.begin_shutdown(grace_s / 2)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s)
    Server(config).run()


def wait_healthy(url: str, process=None, timeout_s: float = 120.0) -> None:
    """Wait until the server at ``url`` answers ``/health`` with 200 (benchmarks and tests that start one); a
    RuntimeError if it does not within ``timeout_s`` or its ``process`` (a ``subprocess.Popen``) ends first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or (process is not None and process.poll() is not None):
            raise RuntimeError(f"the server at {url} did not start")
        time.sleep(0.2)


__all__ = ["run", "wait_healthy"]
