"""`dspark serve` against a real server process on 127.0.0.1: lossless under concurrency, streaming,
OpenAI shapes, 4xx errors, disconnects freeing KV pages, and KV exhaustion queueing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dspark.corpus import held_out_prompts
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .runtime_helpers import REPO, compile_variant

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, package: Path, log: Path, command: list[str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = command or ["-m", "dspark.cli.main", "serve", str(package)]
        self.proc = subprocess.Popen(
            [sys.executable, *command, "--port", str(self.port), "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start: {log.read_text()}")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r'^(dspark_\w+)(\{[^}]*\})? ([0-9.e+-]+)$', line)
            if m:
                labels = m.group(2) or ""
                reason = re.search(r'reason="(\w+)"', labels)
                key = m.group(1) + (f"[{reason.group(1)}]" if reason else "")
                out[key] = out.get(key, 0.0) + float(m.group(3))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def compact_server(tmp_path_factory) -> Iterator[tuple[ServerProcess, Path]]:
    package = REPO / "generated" / "tiny_cpu_compact"
    server = ServerProcess(package, tmp_path_factory.mktemp("server") / "server.log")
    yield server, package
    server.stop()


def _complete(url: str, prompt: str, **kw: object) -> dict:
    body = {"model": "tiny_cpu_compact", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, prompt: str, **kw: object) -> tuple[list[dict], list[str]]:
    body = {"model": "tiny_cpu_compact", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **kw}
    chunks, raw = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                raw.append(line[6:])
                if line[6:] != "[DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks, raw


def test_32_concurrent_clients_get_the_target_only_greedy_output(compact_server) -> None:
    server, package = compact_server
    prompts = held_out_prompts(96, 120, phase=40)
    pkg = load_package(package)
    reference, _ = Runtime(pkg).generate([pkg.tokenizer.encode(p) for p in prompts], MAX_TOKENS,
                                         target_only=True)
    expected = [pkg.tokenizer.decode(ids) for ids in reference]

    async def client(c: int, http: httpx.AsyncClient) -> list[tuple[int, dict]]:
        out = []
        for i in range(c, len(prompts), 32):  # each of 32 clients sends 3 requests in turn
            body = {"model": "tiny_cpu_compact", "prompt": prompts[i], "max_tokens": MAX_TOKENS,
                    "temperature": 0}
            r = await http.post(f"{server.url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            out.append((i, r.json()))
        return out

    async def run() -> list[tuple[int, dict]]:
        async with httpx.AsyncClient() as http:
            results = await asyncio.gather(*(client(c, http) for c in range(32)))
        return [x for per in results for x in per]

    before = server.metrics()
    responses = asyncio.run(run())
    assert len(responses) == 96
    for i, body in responses:
        choice = body["choices"][0]
        assert choice["text"] == expected[i], f"prompt {i}"
        assert choice["finish_reason"] == ("length" if len(reference[i]) == MAX_TOKENS else "stop")
        assert body["object"] == "text_completion" and body["model"] == "tiny_cpu_compact"
        usage = body["usage"]
        assert usage["completion_tokens"] == len(reference[i])
        assert usage["prompt_tokens"] == len(pkg.tokenizer.encode(prompts[i]))
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 1 <= usage["dspark"]["decode_steps"] <= usage["completion_tokens"]
    after = server.metrics()
    def finished(m: dict[str, float]) -> float:
        return sum(m.get(f"dspark_requests_finished_total[{r}]", 0) for r in ("length", "stop"))

    assert finished(after) - finished(before) == 96
    # several requests shared steps: more request-steps than steps
    steps = after["dspark_decode_steps_total"] - before.get("dspark_decode_steps_total", 0)
    request_steps = after["dspark_request_steps_total"] - before.get("dspark_request_steps_total", 0)
    assert request_steps > 2 * steps
    assert after["dspark_running_requests"] == 0 and after["dspark_kv_free_pages"] == after["dspark_kv_pages"]


def test_streaming_chunks_concatenate_to_the_non_streaming_text(compact_server) -> None:
    server, _ = compact_server
    for prompt in ("def parse(self, text):\n", "import os\nimport sys\n\n", "class Queue:\n    "):
        whole = _complete(server.url, prompt)
        chunks, raw = _stream(server.url, prompt)
        assert raw[-1] == "[DONE]"
        content = [c for c in chunks if c["choices"]]
        assert "".join(c["choices"][0]["text"] for c in content) == whole["choices"][0]["text"]
        assert content[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
            whole["usage"]["completion_tokens"]
        assert len({c["id"] for c in chunks}) == 1


def test_stop_strings_cut_the_text_in_both_modes(compact_server) -> None:
    server, _ = compact_server
    prompt = "def parse(self, text):\n"
    full = _complete(server.url, prompt, max_tokens=64)["choices"][0]["text"]
    stop = full[10:13]
    assert stop and stop in full
    cut = full[:full.index(stop)]
    whole = _complete(server.url, prompt, max_tokens=64, stop=[stop, "never-there"])
    assert whole["choices"][0]["text"] == cut and whole["choices"][0]["finish_reason"] == "stop"
    chunks, _ = _stream(server.url, prompt, max_tokens=64, stop=stop)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == cut


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": "tiny_cpu_compact", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "tiny_cpu_compact", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "tiny_cpu_compact", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny_cpu_compact", "prompt": "x" * 1100}, 400, "prompt"),
    ({"model": "tiny_cpu_compact", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny_cpu_compact", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "tiny_cpu_compact", "prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ({"prompt": "x"}, 400, "model"),
])
def test_bad_requests_get_a_4xx_naming_the_field(compact_server, body, status, param) -> None:
    server, _ = compact_server
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_malformed_json_is_a_400(compact_server) -> None:
    server, _ = compact_server
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "tiny_cpu_compact", "prompt": ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_models_and_health(compact_server) -> None:
    server, _ = compact_server
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny_cpu_compact"
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["free_slots"] >= 1


def test_a_client_disconnect_mid_stream_frees_its_slot_and_pages(compact_server) -> None:
    server, _ = compact_server
    before = server.metrics()
    body = {"model": "tiny_cpu_compact", "prompt": "def main():\n", "max_tokens": 800, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held, so the connection stays open until the `with` ends
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        busy = server.metrics()
        assert busy["dspark_running_requests"] == 1, busy
        assert busy["dspark_kv_free_pages"] < busy["dspark_kv_pages"], busy
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = server.metrics()
        if now["dspark_running_requests"] == 0 and now["dspark_kv_free_pages"] == now["dspark_kv_pages"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the disconnected request still holds its pages: {now}")
    assert now.get("dspark_requests_finished_total[abort]", 0) == \
        before.get("dspark_requests_finished_total[abort]", 0) + 1
    # it stopped early: far fewer than 800 tokens were generated
    assert now["dspark_generation_tokens_total"] - before["dspark_generation_tokens_total"] < 700


def test_kv_exhaustion_queues_requests_instead_of_failing(tmp_path) -> None:
    # A pool that holds one request at a time (each reserves ~90 tokens of a 128-token pool).
    package = compile_variant(tmp_path, "tiny_cpu_static.yaml",
                              {"verify": {"mode": "compact", "allow_no_cost_model": True},
                               "serving": {"max_running_requests": 8, "max_total_tokens": 128,
                                           "max_context_len": 128}}, "tiny_pool")
    server = ServerProcess(package, tmp_path / "server.log")
    try:
        prompts = held_out_prompts(6, 40, phase=10)
        pkg = load_package(package)
        reference, _ = Runtime(pkg).generate([pkg.tokenizer.encode(p) for p in prompts], 40, target_only=True)
        depths: list[float] = []

        async def run() -> list[dict]:
            async with httpx.AsyncClient() as http:
                async def one(p: str) -> dict:
                    r = await http.post(f"{server.url}/v1/completions", timeout=300, json={
                        "model": "tiny_pool", "prompt": p, "max_tokens": 40, "temperature": 0})
                    assert r.status_code == 200, r.text
                    return r.json()

                async def watch() -> None:
                    while True:
                        text = (await http.get(f"{server.url}/metrics")).text
                        m = re.search(r"^dspark_queue_depth\{[^}]*\} ([0-9.]+)$", text, re.M)
                        depths.append(float(m.group(1)))
                        await asyncio.sleep(0.02)

                watcher = asyncio.create_task(watch())
                out = await asyncio.gather(*(one(p) for p in prompts))
                watcher.cancel()
                return out

        responses = asyncio.run(run())
        texts = [r["choices"][0]["text"] for r in responses]
        assert texts == [pkg.tokenizer.decode(ids) for ids in reference]
        assert max(depths) >= 1  # requests waited for pages rather than failing
        # a request that could never fit is refused up front, with the largest max_tokens that would
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       json={"model": "tiny_pool", "prompt": "x" * 100, "max_tokens": 100})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "max_tokens"
        assert error["code"] == "context_length_exceeded" and "at most 19" in error["message"]  # 128-101-8
    finally:
        server.stop()


def test_sampled_requests_are_served_next_to_greedy_ones(compact_server) -> None:
    server, _ = compact_server
    sampled = _complete(server.url, "def main():\n", temperature=0.8, top_p=0.95, max_tokens=32)
    greedy = _complete(server.url, "def main():\n", max_tokens=32)
    assert 1 <= sampled["usage"]["completion_tokens"] <= 32
    assert _complete(server.url, "def main():\n", max_tokens=32)["choices"] == greedy["choices"]


def test_a_seed_makes_a_sampled_request_repeatable(compact_server) -> None:
    server, _ = compact_server
    kw = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 32}
    first = _complete(server.url, "def main():\n", seed=1234, **kw)["choices"][0]["text"]
    assert _complete(server.url, "def main():\n", seed=1234, **kw)["choices"][0]["text"] == first
    others = {_complete(server.url, "def main():\n", seed=s, **kw)["choices"][0]["text"] for s in (1, 2, 3)}
    assert len(others | {first}) > 1
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"model": "tiny_cpu_compact", "prompt": "x", "seed": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_a_generated_package_serves_as_a_module(tmp_path) -> None:
    server = ServerProcess(REPO / "generated" / "tiny_cpu_static", tmp_path / "server.log",
                           ["-m", "generated.tiny_cpu_static", "serve"])
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tiny_cpu_static"
        body = {"model": "tiny_cpu_static", "prompt": "import os", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _hf_checkpoint(directory: Path) -> Path:
    """The embedded target as a Hugging Face checkpoint whose tokenizer.json (tokenizers library,
    byte-level BPE without merges, `<s>`/`</s>` at 256/257) encodes exactly as the byte tokenizer."""
    import shutil

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from dspark.checkpoints import embedded_root

    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(embedded_root() / "tiny" / "target" / name, directory / name)
    alphabet = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return directory


def test_a_hugging_face_tokenizer_checkpoint_serves_end_to_end(tmp_path) -> None:
    from dspark.runtime.tokenizer import HFTokenizer

    checkpoint = _hf_checkpoint(tmp_path / "hf_target")
    package = compile_variant(tmp_path, "tiny_cpu_static.yaml", {"model": {"checkpoint": str(checkpoint)}},
                              "hf_tok")
    pkg = load_package(package)
    assert isinstance(pkg.tokenizer, HFTokenizer)
    prompts = ["def résumé(self):\n", "# 🙂 emoji\nimport os\n", "class Queue:\n    "]
    byte_pkg = load_package(REPO / "generated" / "tiny_cpu_static")
    assert [pkg.tokenizer.encode(p) for p in prompts] == [byte_pkg.tokenizer.encode(p) for p in prompts]
    reference, _ = Runtime(byte_pkg).generate([byte_pkg.tokenizer.encode(p) for p in prompts], 32,
                                              target_only=True)
    server = ServerProcess(package, tmp_path / "server.log")
    try:
        for prompt, ids in zip(prompts, reference, strict=True):
            body = {"model": "hf_tok", "prompt": prompt, "max_tokens": 32, "temperature": 0}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == byte_pkg.tokenizer.decode(ids)
            chunks, _ = _stream(server.url, prompt, model="hf_tok", max_tokens=32)
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
                byte_pkg.tokenizer.decode(ids)
    finally:
        server.stop()
