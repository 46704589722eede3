"""The ingress request router of HAProxy's direct ingress: HAProxy posts each request's body to
`/internal/route` here and streams the request straight to the replica named in the answer.

    app = server_app._with_ingress_request_router(IngressRequestRouter.bind(server_app, routing_args))

The prompt is tokenized as the server does it (completions: the text with special-token strings
allowed; chat: the chat template of the messages) and its full blocks hashed with the engine's
chain hash, then the server deployment's RequestRouter (serve/request_routing.py) picks the
replica from those hashes through `choose_replica` (no slot is reserved: HAProxy sends the request).
A body with no prompt we can read (other routes, a malformed request, media after the first
placeholder) routes on the part it has, or on load alone; the replica answers it as usual.
"""

import asyncio  # no `from __future__ import annotations`: Serve's class-based FastAPI views need real ones
import glob
import json
import logging
import os

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from k3ray.actors.openai.protocol import ChatMessage
from k3ray.actors.serve.replica_grpc_bind import bind_replica_grpc_to
from k3ray.actors.serve.request_routing import HASHES_KWARG
from k3ray.engine.core.block_pool import hash_block
from k3ray.tokenizer import load_tokenizer
from k3ray.tokenizer.chat import normalize_chat_role

logger = logging.getLogger(__name__)
router_app = FastAPI()


def prompt_ids(tokenizer, body: dict) -> list[int]:
    """The leading token ids of a completions / chat body as the server tokenizes it ([] if none)."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # several prompts: the first
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, allow_special=True)
    if isinstance(prompt, list):
        return prompt
    if isinstance(messages, list):
        dicts = [normalize_chat_role(ChatMessage.model_validate(m).model_dump(exclude_none=True)) for m in messages]
        return tokenizer.encode_chat(dicts, body.get("add_generation_prompt", True),
                                     body.get("continue_final_message", False))
    return []


def block_chain(token_ids: list[int], block_size: int, stop_token: int | None = None) -> list[bytes]:
    """The engine's chain hashes of the full blocks before `stop_token` (a media placeholder, whose
    block hashes also cover the media)."""
    if stop_token is not None and stop_token in token_ids:
        token_ids = token_ids[: token_ids.index(stop_token)]
    chain: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chain.append(hash_block(chain[-1] if chain else b"", token_ids[start : start + block_size]))
    return chain


def serve_haproxy_config() -> str | None:
    """The HAProxy config of this machine's Serve (a local haproxy ingress), as k3ray-haproxy ran it."""
    folder, name = os.path.split(os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", ""))
    paths = glob.glob(os.path.join(folder, "*", name)) if name else []  # Serve writes one folder per node
    if not paths:
        return None
    with open(paths[0]) as f:
        return f.read()


def haproxy_routes_through_router(replicas: int) -> bool:
    """Whether Serve's HAProxy sends requests through the ingress router to `replicas` replicas;
    until the router and the replicas are up, HAProxy balances by connections alone."""
    config = serve_haproxy_config() or ""
    return "lua.route_via_ingress_request_router" in config and config.count("    use-server ") >= replicas


@serve.deployment(name="IngressRequestRouter", ray_actor_options={"num_cpus": 0})
@serve.ingress(router_app)
class IngressRequestRouter:
    def __init__(self, server: DeploymentHandle, tokenizer_path: str, block_size: int) -> None:
        bind_replica_grpc_to(ray.util.get_node_ip_address())
        self.server = server
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.block_size = block_size
        self.server._init()

    def chain_of(self, raw: bytes) -> list[bytes]:
        try:
            body = json.loads(raw)
            ids = prompt_ids(self.tokenizer, body) if isinstance(body, dict) else []
            return block_chain(ids, self.block_size, self.tokenizer.media_placeholder_token_id)
        except (ValueError, TypeError, KeyError):  # not ours to reject: the replica answers the 400
            return []

    @router_app.post("/internal/route")
    async def route(self, request: Request):
        raw = await request.body()
        chain = await asyncio.to_thread(self.chain_of, raw) if len(raw) > 65536 else self.chain_of(raw)
        try:
            async with self.server.choose_replica(**{HASHES_KWARG: chain, "_reserve": False}) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                replica_id = replica.replica_id.to_full_id_str()
        except Exception as e:  # noqa: BLE001 - HAProxy answers any non-200 with a 503
            logger.warning("no replica for a request: %s: %s", type(e).__name__, e)
            return JSONResponse({"detail": f"{type(e).__name__}: {e}"}, status_code=503)
        if endpoint is None:
            return JSONResponse({"detail": f"replica {replica_id} has no HTTP endpoint"}, status_code=503)
        return {"host": endpoint[0], "port": endpoint[1], "replica_id": replica_id}
