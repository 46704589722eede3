"""One streamed completion, timed on the client: TTFT, the gaps between chunks (ITL) and the
end-to-end latency, with the output token count from the final `usage` chunk (or, for a stream
its caller stops early through `on_chunk`, the chunks read). aiohttp, as in
`vllm bench serve`: the load generator shares the machine, and httpx's pure-Python HTTP stack
costs far more CPU per SSE line.

TTFT is the time to the first SSE chunk carrying a choice; each later choice chunk adds one ITL
entry (a chunk may hold several tokens when their text is held back, e.g. an unfinished UTF-8
character); E2EL runs from sending the request to the end of the stream (`data: [DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from k3ray.actors.bench.serve.datasets import BenchRequest


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    queue_time: float = 0.0
    generated_text: str = ""
    error: str = ""
    stopped: bool = False  # the caller's on_chunk ended the stream before the server did


def completion_payload(model: str, request: BenchRequest, extra_body: dict | None = None) -> dict:
    return {"model": model, "prompt": list(request.prompt_ids), "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra_body or {})}


def open_session(concurrency: int | None, timeout: float, api_key: str | None = None) -> aiohttp.ClientSession:
    """Keep-alive connections, at most `concurrency` (None: no cap) open at once."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency or 0),
                                 timeout=aiohttp.ClientTimeout(total=timeout),
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else None)


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str, request: BenchRequest,
                            extra_body: dict | None = None,
                            on_chunk: Callable[[RequestResult], bool] | None = None) -> RequestResult:
    """POST {url}/v1/completions with stream=true; never raises for a failed request (see `error`).
    on_chunk(result so far) runs after each choice chunk; True closes the stream there (`stopped`)."""
    result = RequestResult(prompt_len=request.prompt_len)
    payload = completion_payload(model, request, extra_body)
    pieces: list[str] = []
    result.start_time = start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as response:
            if response.status != 200:
                body = await response.text(errors="replace")
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            async for raw in response.content:  # one line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return result
                if chunk.get("choices"):
                    if not pieces:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    pieces.append(chunk["choices"][0].get("text") or "")
                    if on_chunk is not None and on_chunk(result):
                        result.stopped, result.output_tokens = True, len(pieces)
                        break
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
        result.latency = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.generated_text = "".join(pieces)
    if not pieces:
        result.error = "the stream carried no completion chunk"
    elif result.output_tokens == 0:
        result.error = "the stream carried no usage (send stream_options.include_usage)"
    else:
        result.success = True
    return result
