"""The OpenAI wire format: reading requests (with errors that name the field and the fix) and writing answers.

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
A request may carry ``kv_compression``: ``{"method": "adakv", "ratio": 0.25}`` (or ``"budget"``
and method options); without it the server's default method applies.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine import RequestOutput, SamplingParams, TokenLogprob
from ..engine.sampling import MAX_LOGPROBS, SEED_RANGE
from ..methods import Policy, get_method


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
    """What the server accepts: tokens per prompt and per answer (``max_tokens`` above it is refused), answers
    per request."""

    max_prompt_tokens: int
    max_tokens: int
    default_max_tokens: int = 256
    max_n: int = 16  # answers per request at most (each is a request in the engine)


# Fields each endpoint reads; any other field is refused (400 naming it), so none is silently ignored.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user", "kv_compression",
           "ignore_eos"}
FIELDS = {False: _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"},
          True: _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                           "parallel_tool_calls", "response_format", "functions", "function_call"}}
# Fields refused unless at the value that asks for nothing (what each would need is not built).
_NOT_BUILT = {
    "echo": ((False,), "echo (the prompt repeated in the answer) is not supported; leave it out"),
    "suffix": (("",), "suffix (text after the insertion point) is not supported; leave it out"),
    "logit_bias": (({},), "logit_bias is not supported; leave it out"),
    "tools": (([],), "tools (function calling) are not supported by this server; leave 'tools' out"),
    "functions": (([],), "functions (function calling) are not supported by this server; leave them out"),
    "tool_choice": (("none", "auto"), "tool_choice needs tools, which this server does not support; leave it out"),
    "function_call": (("none",), "function_call needs functions, which this server does not support; leave it out"),
    "parallel_tool_calls": ((), "parallel_tool_calls needs tools, which this server does not support; leave it out"),
    "response_format": (({"type": "text"},), "response_format other than {\"type\": \"text\"} (JSON mode, schemas) is "
                                             "not supported; leave it out"),
}


# The numeric sampling fields, (kind, default, low, high, low bound open), as vLLM defines them (OpenAI's ranges;
# top_k and repetition_penalty are vLLM's extras): read by ``_sampling`` and stated in the schema.
_NUMBERS = {
    "temperature": (float, 1.0, 0.0, 2.0, False),
    "top_p": (float, 1.0, 0.0, 1.0, True),
    "top_k": (int, 0, -1, None, False),
    "presence_penalty": (float, 0.0, -2.0, 2.0, False),
    "frequency_penalty": (float, 0.0, -2.0, 2.0, False),
    "repetition_penalty": (float, 1.0, 0.0, None, True),
    "seed": (int, None, SEED_RANGE[0], SEED_RANGE[1], False),
}


def _number_schema(kind: type, low, high, low_open: bool) -> dict:
    schema: dict[str, Any] = {"type": "integer" if kind is int else "number"}
    if low is not None:
        schema["exclusiveMinimum" if low_open else "minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return schema


def openapi_body(chat: bool, model_name: str, limits: Limits) -> dict:
    """The request body's JSON schema for the OpenAPI document (what a client or a fuzzer reads): every field
    this endpoint reads, with OpenAI's types and this server's ranges; no other field."""
    text = {"type": "string", "minLength": 1}
    fields: dict[str, Any] = {name: _number_schema(kind, low, high, low_open) for name, (kind, _, low, high, low_open) in _NUMBERS.items()}
    fields |= {
        "model": {"type": "string", "enum": [model_name]},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n},
        "user": {"type": "string"}, "ignore_eos": {"type": "boolean"}, "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}, "additionalProperties": False},
        "stop": {"anyOf": [text, {"type": "array", "items": text, "maxItems": 4}]},
        "kv_compression": {"type": "object", "required": ["method"], "properties": {
            "method": {"type": "string"}, "budget": {"type": "integer", "minimum": 1},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}},
    }
    if chat:
        part = {"type": "object", "required": ["type", "text"], "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
        content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
        message = {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": content}}
        fields |= {"messages": {"type": "array", "items": message, "minItems": 1},
                   "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": limits.max_tokens},
                   "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}}
        required = ["model", "messages"]
    else:
        fields |= {"prompt": {"anyOf": [text, {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]},
                   "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}, "echo": {"enum": [False]},
                   "best_of": {"type": "integer", "minimum": 1, "maximum": limits.max_n}}
        required = ["model", "prompt"]
    schema = {"type": "object", "required": required, "properties": fields, "additionalProperties": False}
    if chat:  # top_logprobs asks for alternatives of the logprobs that logprobs: true turns on
        schema["dependentSchemas"] = {"top_logprobs": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@dataclass
class Parsed:
    """A checked request: sampling, method, streaming, and the raw prompt (text or token ids) or messages."""

    params: SamplingParams
    method: Policy
    stream: bool
    include_usage: bool
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None


def _number(body: dict, name: str, default, kind, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # 2.0 is an integer in JSON Schema
    if isinstance(value, bool) or not isinstance(value, kind) or (isinstance(value, float) and not math.isfinite(value)):
        kinds = "an integer" if kind is int else "a finite number"
        raise APIError(400, f"'{name}' must be {kinds}, got {value!r}", name)
    if low is not None and (value <= low if low_open else value < low):
        raise APIError(400, f"'{name}' must be {'>' if low_open else '≥'} {low}, got {value!r}", name)
    if high is not None and value > high:
        raise APIError(400, f"'{name}' must be ≤ {high}, got {value!r}", name)
    return value


def parse(body: Any, *, chat: bool, model_name: str, default_method: Policy, limits: Limits) -> Parsed:
    """Check a completions or chat-completions body; raise ``APIError`` naming the field at fault."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _known_fields(body, chat)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: the served model's name (GET /v1/models)", "model")
    if model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model", code="model_not_found")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = limits.default_max_tokens if chat else 16
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise APIError(400, "'stream_options' must be {\"include_usage\": true|false}", "stream_options")
    n = _number(body, "n", 1, int, 1, limits.max_n)
    best_of = _number(body, "best_of", None, int, 1)
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of={best_of} (drawing more answers than are returned) is not supported; give n alone", "best_of")
    params = _sampling(body, n=n, max_tokens=_number(body, max_name, min(default, limits.max_tokens), int, 1, limits.max_tokens),
                       logprobs=_logprobs(body, chat))
    parsed = Parsed(params, _method(body.get("kv_compression"), default_method), stream,
                    bool(options and options.get("include_usage")))
    if chat:
        parsed.messages = _messages(body.get("messages"))
    else:
        parsed.prompt = _prompt(body.get("prompt"))
    return parsed


def _known_fields(body: dict, chat: bool) -> None:
    """Refuse a field this endpoint does not read, and a field it does not build unless it asks for nothing."""
    unknown = sorted(set(body) - FIELDS[chat])
    if unknown:
        raise APIError(400, f"unknown field '{unknown[0]}' for /v1/{'chat/' if chat else ''}completions; this server reads: "
                            f"{', '.join(sorted(FIELDS[chat]))}", unknown[0])
    for name, (harmless, why) in _NOT_BUILT.items():
        if name in body and body[name] is not None and body[name] not in harmless:
            raise APIError(400, why, name)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(400, f"'user' must be a string (an end-user id), got {user!r}", "user")


def _sampling(body: dict, *, n: int, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The sampling fields as vLLM defines them (the numbers' ranges: ``_NUMBERS``)."""
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, f"'ignore_eos' must be true or false, got {ignore_eos!r}", "ignore_eos")
    numbers = {}
    for name, (kind, default, low, high, low_open) in _NUMBERS.items():
        value = _number(body, name, default, int if kind is int else (int, float), low, high, low_open)
        numbers[name] = float(value) if kind is float else value
    return SamplingParams(max_tokens=max_tokens, n=n, stop=stop, logprobs=logprobs, ignore_eos=ignore_eos, **numbers)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token to report (None: no logprobs). Completions: ``logprobs`` is their count; chat:
    ``logprobs`` true, and ``top_logprobs`` their count."""
    if not chat:
        return _number(body, "logprobs", None, int, 0, MAX_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, f"'logprobs' must be true or false, got {wanted!r}", "logprobs")
    top = _number(body, "top_logprobs", None, int, 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _method(spec: Any, default: Policy) -> Policy:
    """The request's ``kv_compression`` as a method (the server's default without it): ``method`` is a spec
    (a name, ``snapkv:window=16`` or ``kvzip+adaptive``), the other keys its size and options (the first element's)."""
    if spec is None:
        return default
    if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
        raise APIError(400, "'kv_compression' must be an object with a 'method' (and 'budget' or 'ratio', and method options), "
                            "e.g. {\"method\": \"adakv\", \"ratio\": 0.25}", "kv_compression")
    options = {k: v for k, v in spec.items() if k != "method"}
    if any(isinstance(v, float) and not math.isfinite(v) for v in options.values()):
        raise APIError(400, "kv_compression: options must be finite numbers (no NaN or Infinity)", "kv_compression")
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
        if isinstance(content, list):  # content parts: text ones only
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
                raise APIError(400, f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": \"...\"}} "
                                    "(images and other parts are not supported)", f"messages[{i}].content")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string (or text parts)", f"messages[{i}].content")
        out.append({"role": "system" if message["role"] == "developer" else message["role"], "content": content})
    return out


# ----- answers ----------------------------------------------------------------------------------
def request_id(chat: bool) -> str:
    """A request id unique across processes and machines (a random UUID), as OpenAI's and vLLM's."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    """Tokens of the prompt (once) and of every answer; the KV bytes held for the prompt (answer 0's)."""
    completion = sum(len(o.token_ids) for o in outputs)
    prompt = len(outputs[0].prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "kv_bytes": outputs[0].stats.get("kv_bytes"), "kv_bytes_full": outputs[0].stats.get("kv_bytes_full")}


def finish_reason(output: RequestOutput) -> str:
    return "length" if output.finish_reason == "length" else "stop"


def logprobs(tokenizer, entries: list[TokenLogprob] | None, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's ``logprobs`` of a choice: chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    completions ``{tokens, token_logprobs, top_logprobs, text_offset}`` (``offset``: characters before them)."""
    if entries is None:
        return None
    text = lambda token_id: tokenizer.decode([token_id])  # noqa: E731
    if chat:
        item = lambda token_id, value: {"token": text(token_id), "logprob": value,  # noqa: E731
                                        "bytes": list(text(token_id).encode("utf-8", "replace"))}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]} for e in entries]}
    tokens = [text(e.token_id) for e in entries]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(i): v for i, v in e.top} for e in entries], "text_offset": offsets}


def completion(request_id: str, model: str, outputs: list[RequestOutput], chat: bool, tokenizer) -> dict:
    """The whole answer: a choice per output (its ``index``)."""
    choices = []
    for output in outputs:
        choice: dict[str, Any] = {"index": output.index, "finish_reason": finish_reason(output),
                                  "logprobs": logprobs(tokenizer, output.logprobs, chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": output.text}
        else:
            choice["text"] = output.text
        choices.append(choice)
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(outputs)}


def chunk(request_id: str, model: str, chat: bool, index: int = 0, text: str | None = None, finish: str | None = None,
          role: bool = False, logprobs: dict | None = None, outputs: list[RequestOutput] | None = None) -> dict:
    """One streamed piece of choice ``index``: new text (and its tokens' ``logprobs``), or the finish reason,
    or (``outputs`` given, no choices) the usage."""
    base = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model}
    if outputs is not None:
        return {**base, "choices": [], "usage": usage(outputs)}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    return {**base, "choices": [choice]}


__all__ = ["APIError", "FIELDS", "Limits", "Parsed", "chunk", "completion", "logprobs", "openapi_body", "parse", "request_id", "usage"]
