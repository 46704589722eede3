"""A `Target` for any OpenAI-compatible server with vLLM-style tokenizer routes.

Text prompts go to `/v1/completions`, chat prompts (multimodal) to `/v1/chat/completions`, both
greedy. Token-exact lengths need `POST /tokenize {"model", "prompt"}` -> `{"tokens", "count",
"max_model_len"}` and `POST /detokenize {"model", "tokens"}` -> `{"prompt"}`, as vLLM serves them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import httpx

from k3ray.evals.target import Prompt


class EndpointError(RuntimeError):
    """The server answered with an error, or lacks a route the eval needs."""


# counters of a server's /metrics that add up to the tokens its model computed (k3ray's, vLLM's)
TOKEN_COUNTERS = frozenset(f"{server}:{name}_total" for server in ("k3ray", "vllm")
                           for name in ("prompt_tokens", "generation_tokens", "prefix_cache_hits"))
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{.*\})?\s+(\S+)")
RETRYABLE = (429, 503)  # busy or not ready: the server says when to come back (Retry-After)
MAX_RETRY_WAIT_S = 60.0


def retry_wait(response: httpx.Response, attempt: int) -> float:
    """Seconds to wait before retrying a busy answer: its Retry-After, else 1, 2, 4, ... s."""
    try:
        wait = float(response.headers.get("Retry-After", ""))
    except ValueError:
        wait = 2.0**attempt
    return min(max(wait, 0.0), MAX_RETRY_WAIT_S)


class OpenAITarget:
    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 3600.0,
        *,
        max_context: int | None = None,
        add_special_tokens: bool = True,
        max_retries: int = 5,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """chat_template_kwargs: sent with chat prompts (and their /tokenize counts), e.g. K3's thinking off."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if not model:
            raise ValueError("model must name the served model")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        root = base_url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_context = max_context
        # counts must match what /v1/completions feeds the model, BOS included
        self.add_special_tokens = add_special_tokens
        self.max_retries = max_retries  # of a 429 / 503 answer, as the openai client retries them
        self.chat_extra = {"chat_template_kwargs": dict(chat_template_kwargs)} if chat_template_kwargs else {}
        self.name = f"{model}@{self.root}"
        self._client: httpx.Client | None = None
        self._no_metrics = False  # /metrics answered 404: stop asking

    def __getstate__(self) -> dict[str, Any]:
        # the HTTP client holds sockets and locks; a copy in another process opens its own
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.Client(base_url=self.root, headers=headers, timeout=self.timeout)
        return self._client

    def _post(self, route: str, payload: dict[str, Any], *, tokenizer_route: bool = False) -> dict[str, Any]:
        for attempt in range(self.max_retries + 1):
            try:
                response = self.client.post(route, json=payload)
            except httpx.HTTPError as e:
                raise EndpointError(f"POST {self.root}{route} failed: {type(e).__name__}: {e}") from e
            if response.status_code not in RETRYABLE or attempt == self.max_retries:
                break
            time.sleep(retry_wait(response, attempt))
        if tokenizer_route and response.status_code in (404, 405):
            raise EndpointError(
                f"{self.root} has no {route} route (HTTP {response.status_code}); token-exact prompt lengths "
                "need vLLM-style POST /tokenize and /detokenize (vLLM serves them by default)"
            )
        if response.status_code != 200:
            raise EndpointError(f"POST {self.root}{route} returned HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    def _tokenize(self, text: str) -> dict[str, Any]:
        body = self._post(
            "/tokenize",
            {"model": self.model, "prompt": text, "add_special_tokens": self.add_special_tokens},
            tokenizer_route=True,
        )
        if "tokens" not in body:
            raise EndpointError(f"{self.root}/tokenize answered without 'tokens': {str(body)[:200]}")
        if self.max_context is None and body.get("max_model_len"):
            self.max_context = int(body["max_model_len"])
        return body

    def tokens_computed(self) -> int | None:
        """The server's prompt, prefix-hit and generated token counters from its /metrics (every
        replica's that answers; None when it has none): the progress of a long prefill."""
        if self._no_metrics:
            return None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            response = httpx.get(f"{self.root}/metrics", headers=headers, timeout=5.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            self._no_metrics = response.status_code in (404, 405)
            return None
        samples = (_SAMPLE.match(line) for line in response.text.splitlines() if not line.startswith("#"))
        values = [float(m.group(2)) for m in samples if m and m.group(1) in TOKEN_COUNTERS]
        return int(sum(values)) if values else None

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenize(text)["tokens"])

    def count_tokens(self, text: str) -> int:
        body = self._tokenize(text)
        return int(body.get("count", len(body["tokens"])))

    def count_chat_tokens(self, messages: list[dict[str, Any]]) -> int | None:
        """The chat prompt's token count from /tokenize (media expanded to their tokens); None when
        the server cannot tokenize chats."""
        try:
            body = self._post("/tokenize", {"model": self.model, "messages": messages, "add_generation_prompt": True,
                                            **self.chat_extra},
                              tokenizer_route=True)
        except EndpointError:
            return None
        return int(body["count"]) if isinstance(body.get("count"), int) else None

    def detokenize(self, ids: Sequence[int]) -> str:
        body = self._post("/detokenize", {"model": self.model, "tokens": list(ids)}, tokenizer_route=True)
        if "prompt" not in body:
            raise EndpointError(f"{self.root}/detokenize answered without 'prompt': {str(body)[:200]}")
        return body["prompt"]

    def complete(self, prompt: Prompt, max_tokens: int) -> str:
        common = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0}
        if isinstance(prompt, str):
            body = self._post("/v1/completions", {**common, "prompt": prompt})
            return body["choices"][0]["text"]
        body = self._post("/v1/chat/completions", {**common, "messages": prompt, **self.chat_extra})
        return body["choices"][0]["message"]["content"] or ""
