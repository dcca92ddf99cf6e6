"""The OpenAI wire format: reading requests (with errors that name the field and the fix) and writing answers.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
A request may carry ``kv_compression``: ``{"method": "adakv", "ratio": 0.25}`` (or ``"budget"``
and method options); without it the server's default method applies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..engine import RequestOutput, SamplingParams
from ..methods import Method, get_method


class APIError(Exception):
    """An error answered as OpenAI does: status, message, type, param, code."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """What the server accepts: tokens per prompt and per answer (``max_tokens`` above it is refused)."""

    max_prompt_tokens: int
    max_tokens: int
    default_max_tokens: int = 256


@dataclass
class Parsed:
    """A checked request: sampling, method, streaming, and the raw prompt (text or token ids) or messages."""

    params: SamplingParams
    method: Method
    stream: bool
    include_usage: bool
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None


def _number(body: dict, name: str, default, kind, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        kinds = "an integer" if kind is int else "a number"
        raise APIError(400, f"'{name}' must be {kinds}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise APIError(400, f"'{name}' must be {'>' if low_open else '≥'} {low}, got {value!r}", name)
    if high is not None and value > high:
        raise APIError(400, f"'{name}' must be ≤ {high}, got {value!r}", name)
    return value


def parse(body: Any, *, chat: bool, model_name: str, default_method: Method, limits: Limits) -> Parsed:
    """Check a completions or chat-completions body; raise ``APIError`` naming the field at fault."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: the served model's name (GET /v1/models)", "model")
    if model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model", code="model_not_found")
    n = _number(body, "n", 1, int, 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported (one answer per request)", "n")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = limits.default_max_tokens if chat else 16
    max_tokens = _number(body, max_name, min(default, limits.max_tokens), int, 1, limits.max_tokens)
    temperature = _number(body, "temperature", 1.0, (int, float), 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, (int, float), 0.0, 1.0, low_open=True)
    seed = _number(body, "seed", None, int)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), seed=seed, stop=stop)
    parsed = Parsed(params, _method(body.get("kv_compression"), default_method), stream, include_usage)
    if chat:
        parsed.messages = _messages(body.get("messages"))
    else:
        parsed.prompt = _prompt(body.get("prompt"))
    return parsed


def _method(spec: Any, default: Method) -> Method:
    """The request's ``kv_compression`` as a method (the server's default without it)."""
    if spec is None:
        return default
    if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
        raise APIError(400, "'kv_compression' must be an object with a 'method' (and 'budget' or 'ratio', and method options), "
                            "e.g. {\"method\": \"adakv\", \"ratio\": 0.25}", "kv_compression")
    options = {k: v for k, v in spec.items() if k != "method"}
    try:
        return get_method(spec["method"], **options)
    except (ValueError, TypeError) as error:
        raise APIError(400, f"kv_compression: {error}", "kv_compression") from None


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise APIError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "developer"):
            raise APIError(400, f"messages[{i}] needs a role: system, user, assistant or developer", f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string (or text parts)", f"messages[{i}].content")
        out.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    return out


# ----- answers ----------------------------------------------------------------------------------
def usage(output: RequestOutput) -> dict:
    completion = len(output.token_ids)
    prompt = len(output.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "kv_bytes": output.stats.get("kv_bytes"), "kv_bytes_full": output.stats.get("kv_bytes_full")}


def finish_reason(output: RequestOutput) -> str:
    return "length" if output.finish_reason == "length" else "stop"


def completion(request_id: str, model: str, output: RequestOutput, chat: bool) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(output), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": output.text}
    else:
        choice["text"] = output.text
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(output)}


def chunk(request_id: str, model: str, chat: bool, text: str | None = None, finish: str | None = None, role: bool = False,
          output: RequestOutput | None = None) -> dict:
    """One streamed piece: new text, or the finish reason, or (``output`` given, no choices) the usage."""
    base = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model}
    if output is not None:
        return {**base, "choices": [], "usage": usage(output)}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {**base, "choices": [choice]}


__all__ = ["APIError", "Limits", "Parsed", "chunk", "completion", "parse", "usage"]
