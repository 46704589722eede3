"""OpenAITarget against a loopback OpenAI-style server whose 'model' is the perfect reader."""

import argparse
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k3ray.evals import cli as eval_cli
from k3ray.evals.openai_target import EndpointError, OpenAITarget
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.runner import RunConfig, run_eval
from k3ray.evals.tasks import Cell, get_task

BOS = 256
MAX_MODEL_LEN = 65_536


class _Server:
    """Byte tokenizer with a BOS id, vLLM-shaped /tokenize and /detokenize, oracle completions."""

    def __init__(self, tokenizer_routes=True):
        self.busy_answers = 0  # this many completions are answered 429 first, Retry-After 0
        self.seen_prompt_tokens = []
        self.auth = set()
        self.reader = OracleTarget()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.auth.add(self.headers.get("Authorization"))
                route = self.path
                if route in ("/tokenize", "/detokenize") and not tokenizer_routes:
                    return self._send(404, {"detail": "Not Found"})
                if body.get("model") != "k3":
                    return self._send(404, {"error": f"model {body.get('model')!r} not found"})
                if route == "/tokenize" and "messages" in body:  # 100 tokens per image, one per text byte
                    parts = [p for m in body["messages"] for p in m["content"]]
                    count = sum(100 if p["type"] != "text" else len(p["text"].encode()) for p in parts)
                    return self._send(200, {"tokens": [0] * count, "count": count, "max_model_len": MAX_MODEL_LEN})
                if route == "/tokenize":
                    tokens = [BOS] * body.get("add_special_tokens", True) + list(body["prompt"].encode())
                    return self._send(200, {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN})
                if route == "/detokenize":
                    return self._send(200, {"prompt": bytes(t for t in body["tokens"] if t != BOS).decode()})
                if route == "/v1/completions" and server.busy_answers > 0:
                    server.busy_answers -= 1
                    return self._send(429, {"error": {"code": "queue_full"}}, {"Retry-After": "0"})
                if route == "/v1/completions":
                    server.seen_prompt_tokens.append(1 + len(body["prompt"].encode()))
                    answer = server.reader.read(body["prompt"])
                    return self._send(200, {"choices": [{"index": 0, "text": " " + answer}]})
                if route == "/v1/chat/completions":
                    answer = server.reader.read(body["messages"])
                    return self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                                  "content": answer}}]})
                return self._send(404, {"detail": "Not Found"})

            def _send(self, status, payload, headers=()):
                data = json.dumps(payload).encode()
                self.send_response(status)
                for name, value in dict(headers).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


@pytest.fixture
def bare_server():
    s = _Server(tokenizer_routes=False)
    yield s
    s.close()


def test_tokenize_counts_specials_and_learns_the_context(server):
    target = OpenAITarget(server.url + "/v1/", "k3", timeout=30)
    assert target.root == server.url and target.max_context is None
    assert target.tokenize("hi") == [BOS, 104, 105] and target.count_tokens("hi") == 3
    assert target.max_context == MAX_MODEL_LEN
    assert target.detokenize([BOS, 104, 105]) == "hi"


def test_eval_over_http_is_token_exact_and_scores_100(server, tmp_path):
    target = OpenAITarget(server.url, "k3", api_key="secret", timeout=30)
    config = RunConfig(tasks=("niah", "vt"), lengths=(1024, 3000), depths=(0.0, 100.0), concurrency=4,
                       executor="threads")
    summary = run_eval(config, target, tmp_path, progress=False)
    assert summary["accuracy"] == 1.0 and summary["n"] == 8
    assert sorted(server.seen_prompt_tokens) == [1024] * 4 + [3000] * 4
    assert server.auth == {"Bearer secret"}


def test_multimodal_prompts_use_the_chat_route(server, tmp_path):
    target = OpenAITarget(server.url, "k3", timeout=30)
    config = RunConfig(tasks=("image_niah", "video_niah_gif"), lengths=(3,), depths=(50.0,), executor="threads")
    assert run_eval(config, target, tmp_path, progress=False)["accuracy"] == 1.0
    assert server.seen_prompt_tokens == []
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    images = {r["task"]: r["prompt_tokens"] for r in records}
    assert images["image_niah"] > 300 and 100 < images["video_niah_gif"] < 300  # 3 images at 100 each; one GIF


def test_missing_tokenizer_routes_fail_clearly(bare_server, tmp_path):
    target = OpenAITarget(bare_server.url, "k3", timeout=30)
    with pytest.raises(EndpointError, match=r"no /tokenize route \(HTTP 404\)"):
        target.tokenize("hi")
    with pytest.raises(EndpointError, match="no /detokenize route"):
        target.detokenize([1])
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args(["niah", "--endpoint", bare_server.url, "--served-model-name", "k3", "--lengths", "1k",
                              "--out", str(tmp_path / "cli"), "--no-progress", "--executor", "threads"])
    assert eval_cli.main(args) == 2


def test_server_errors_become_failed_cells(server, tmp_path):
    config = RunConfig(tasks=("image_niah",), lengths=(2,), depths=(0.0, 100.0), executor="threads")
    wrong_model = OpenAITarget(server.url, "k2", timeout=30)
    summary = run_eval(config, wrong_model, tmp_path, progress=False)
    assert summary["errors"] == 2 and summary["accuracy"] is None
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    assert record["error"].startswith("EndpointError: POST") and "HTTP 404" in record["error"]
    with pytest.raises(ValueError, match="target"):
        run_eval(config, OpenAITarget(server.url, "k3", timeout=30), tmp_path, progress=False, resume=True)


def test_target_pickles_without_its_connection(server):
    target = OpenAITarget(server.url, "k3", timeout=30)
    target.tokenize("warm")
    copy = pickle.loads(pickle.dumps(target))
    assert copy.tokenize("hi") == [BOS, 104, 105] and copy.name == target.name


def test_bad_target_arguments_are_refused():
    with pytest.raises(ValueError, match="base_url"):
        OpenAITarget("127.0.0.1:8000", "k3")
    with pytest.raises(ValueError, match="model"):
        OpenAITarget("http://127.0.0.1:8000", "")
    with pytest.raises(ValueError, match="timeout"):
        OpenAITarget("http://127.0.0.1:8000", "k3", timeout=0)


def test_busy_answers_are_retried_after_the_server_s_wait(server):
    target = OpenAITarget(server.url, "k3", timeout=30, max_retries=3)
    server.busy_answers = 3
    prompt = get_task("niah").build(Cell("niah", 512, 50.0), OracleTarget(), 0).prompt
    assert target.complete(prompt, 16) == " " + server.reader.read(prompt)
    assert server.busy_answers == 0
    server.busy_answers = 4  # one more than the retries: the 429 is the answer
    with pytest.raises(EndpointError, match="HTTP 429.*queue_full"):
        target.complete(prompt, 16)
    with pytest.raises(ValueError, match="max_retries"):
        OpenAITarget(server.url, "k3", max_retries=-1)
