"""Length routing: count a request's prompt tokens with the model's tokenizer and decide short/long once.

The count follows what vLLM's OpenAI server does with the same body, so the proxy's decision and the
engine's ``usage.prompt_tokens`` agree (the proxy checks and counts mismatches):
  * ``/v1/completions``: a string prompt is tokenized with ``add_special_tokens`` (default true); a
    token-id prompt is counted as is. One prompt per request (a batch of prompts cannot share one
    P/D decision).
  * ``/v1/chat/completions``: the tokenizer's chat template renders the messages (with the request's
    ``add_generation_prompt`` [true], ``continue_final_message``, ``tools``, ``documents`` and
    ``chat_template_kwargs``); the text is tokenized with ``add_special_tokens`` (default false).
    Text content parts are joined with newlines, as vLLM does for string-content templates.
Malformed bodies raise ``BadRequest`` with the reason (the proxy answers 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Decision:
    """One routing decision, carried to P and D as ``kv_transfer_params["nelssa"]``."""
    long: bool
    prompt_tokens: int
    T_input: int

    @property
    def route(self) -> str:
        return "long" if self.long else "short"

    def params(self) -> dict[str, Any]:
        return {"long": self.long, "prompt_tokens": self.prompt_tokens, "T_input": self.T_input}


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompt(body: dict) -> str | list[int]:
    """The one prompt of a /v1/completions body (str or token ids)."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _is_int_list(p[0])):
        p = p[0]
    if isinstance(p, str):
        return p
    if _is_int_list(p) and p:
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str) or _is_int_list(x) for x in p):
        raise BadRequest("batched prompts are not supported by the P/D proxy: send one prompt per request",
                         "prompt")
    raise BadRequest("'prompt' must be a non-empty string or a list of token ids", "prompt")


def chat_messages(body: dict) -> list[dict]:
    """The messages of a /v1/chat/completions body, text content parts joined (vLLM's string form)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for part in c:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise BadRequest(f"messages[{i}]: content part {kind!r} is not supported (text only)",
                                     "messages")
            m = {**m, "content": "\n".join(texts)}
        elif c is not None and not isinstance(c, str):
            raise BadRequest(f"messages[{i}].content must be a string, a list of text parts or null", "messages")
        out.append(m)
    return out


class Router:
    """Counts prompt tokens and decides short/long (prompt tokens >= T_input is long)."""

    def __init__(self, tokenizer, T_input: int):
        self.tokenizer = tokenizer
        self.T_input = T_input

    @classmethod
    def from_pretrained(cls, path: str, T_input: int) -> "Router":
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(path), T_input)

    def count(self, endpoint: str, body: dict) -> int:
        tok = self.tokenizer
        if endpoint == "completions":
            p = completion_prompt(body)
            if isinstance(p, list):
                return len(p)
            return len(tok.encode(p, add_special_tokens=bool(body.get("add_special_tokens", True))))
        msgs = chat_messages(body)
        kw = dict(body.get("chat_template_kwargs") or {})
        if not isinstance(body.get("chat_template_kwargs") or {}, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        for k in ("tools", "documents"):
            if body.get(k) is not None:
                kw[k] = body[k]
        try:
            text = tok.apply_chat_template(
                msgs, tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)), **kw)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault (bad roles, ...)
            raise BadRequest(f"chat template failed on these messages: {type(e).__name__}: {e}", "messages") from None
        return len(tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False))))

    def decide(self, endpoint: str, body: dict) -> Decision:
        n = self.count(endpoint, body)
        return Decision(n >= self.T_input, n, self.T_input)
