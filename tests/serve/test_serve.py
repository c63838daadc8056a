"""`scaletrain serve` and the generation API under it: continuous batching gives the same greedy tokens alone and
in a full batch; the `openai` client works against a real server on 127.0.0.1 unchanged; bad requests (broken
JSON, wrong types, huge bodies, non-UTF-8, out-of-range fields, a client killed mid-stream, 200 connections
at once) are each one status and one message, and the server goes on serving; the chat page streams a reply in
headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.serve_requests import BAD_REQUESTS, CHAT, MESSAGES, SERVER_FLAGS
from helpers.tiny import tiny_overrides
from helpers.waits import CEILING_S
from scaletrain.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve") / "run"
    overrides = tiny_overrides(run, **{"train.steps": 30, "model.max_seq_len": 64, "data.seq_len": 64})
    assert main(["train"] + [f"--{k}={v}" for k, v in overrides.items()]) == 0
    return run


@pytest.fixture(scope="module")
def session(run):
    from scaletrain.infer.session import Session

    return Session.from_run(run)


def _collect(batcher, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, str, int]]:
    """(text, finish_reason, completion_tokens) of each prompt, all submitted at once to ``batcher``."""
    from scaletrain.infer.batch import Job
    from scaletrain.model.generate import Sampling

    results: dict[int, tuple[str, str, int]] = {}
    done = threading.Event()

    def emitter(i: int):
        pieces: list[str] = []

        def emit(event) -> None:
            pieces.append(event.text)
            if event.finish_reason:
                results[i] = ("".join(pieces), event.finish_reason, event.completion_tokens)
                if len(results) == len(prompts):
                    done.set()
        return emit

    for i, prompt in enumerate(prompts):
        batcher.submit(Job(prompt, max_tokens, Sampling(temperature=0.0), emitter(i)))
    assert done.wait(CEILING_S)
    return [results[i] for i in range(len(prompts))]


def test_greedy_tokens_are_the_same_alone_and_inside_a_full_batch(session):
    """Each request's greedy text through the batcher alone, with seven others in a full batch, and with more
    requests than slots (joining as others leave) equals `generate`'s (Session.generate) for that prompt."""
    from scaletrain.infer.batch import Batcher

    texts = ["ROMEO:", "A", "JULIET: what light", "KING", "To be, or not", "Q", "First Citizen:", "HAMLET"]
    prompts = [session.tokenizer.encode(t) for t in texts]
    expected = [session.tokenizer.decode(new) for new in session.generate(prompts, 24, slide=False)]
    batcher = Batcher(session, slots=8).start()
    try:
        alone = [_collect(batcher, [p], 24)[0] for p in prompts]
        full = _collect(batcher, prompts, 24)
        assert batcher.busy == 0
    finally:
        batcher.close()
    few = Batcher(session, slots=3).start()
    try:
        joined = _collect(few, prompts, 24)
    finally:
        few.close()
    assert [r[0] for r in alone] == [r[0] for r in full] == [r[0] for r in joined] == expected
    assert all(r[1:] == ("length", 24) for r in full)
    assert len(set(expected)) > 3  # the prompts lead to different texts: the rows are not all alike


@pytest.mark.slow  # ~35 s: one compile of the 4-row step on 2 cores
def test_compiled_batcher_gives_the_eager_tokens_with_one_graph_whoever_joins_or_leaves(session):
    """`serve --compile`: the batch's step compiled over every slot. After the warm-up's compile, requests alone,
    more requests than slots (joining as others leave) and a request cancelled mid-generation run on the same
    graph (no recompile), and each greedy text is `generate`'s eager one."""
    from dataclasses import replace

    from torch._dynamo.utils import counters

    from scaletrain.infer.batch import Batcher, Job
    from scaletrain.model.decode import StaticDecoder
    from scaletrain.model.generate import Sampling

    texts = ["ROMEO:", "A", "JULIET: what light", "KING", "To be, or not", "Q", "First Citizen:", "HAMLET"]
    prompts = [session.tokenizer.encode(t) for t in texts]
    expected = [session.tokenizer.decode(new) for new in session.generate(prompts, 24, slide=False)]
    batcher = Batcher(replace(session, decoder=StaticDecoder(session.model)), slots=4)
    before = counters["stats"]["unique_graphs"]
    batcher.warm_up()
    assert counters["stats"]["unique_graphs"] == before + 1  # the warm-up compiled the step: one graph
    batcher.start()
    try:
        alone = [_collect(batcher, [p], 24)[0] for p in prompts[:3]]
        gone = Job(prompts[0], 40, Sampling(temperature=0.0), lambda event: gone.cancel())  # leaves at its first text
        batcher.submit(gone)
        joined = _collect(batcher, prompts, 24)
        assert batcher.busy == 0 and batcher.steps > 24
    finally:
        batcher.close()
    assert counters["stats"]["unique_graphs"] == before + 1  # joining, leaving, cancelled: no recompile
    assert [r[0] for r in alone] == expected[:3] and [r[0] for r in joined] == expected
    assert all(r[1:] == ("length", 24) for r in joined)


def test_session_streams_what_it_generates_and_stops_at_a_string(session):
    prompt = session.tokenizer.encode("ROMEO:")
    whole = session.tokenizer.decode(session.generate([prompt], 30)[0])
    assert "".join(session.text_stream(prompt, 30)) == whole
    stop = whole[8:10]
    assert "".join(session.text_stream(prompt, 30, stops=[stop])) == whole[:whole.index(stop)]


def test_sampling_defaults_have_one_place():
    from scaletrain.cli import build_parser
    from scaletrain.infer.session import SAMPLING_DEFAULTS

    parser = build_parser()
    for command in ("generate", "chat"):
        args = parser.parse_args([command, "--run", "x"])
        want = SAMPLING_DEFAULTS[command]
        assert (args.temperature, args.top_k, args.top_p) == (want.temperature, want.top_k, want.top_p)


# -- a real server --

def _server(run: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "scaletrain", "serve", "--run", str(run), "--port", "0",
                                *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()  # "serving RUN as 'NAME' at http://127.0.0.1:PORT ..." once it listens
    if "http://" not in line:
        process.kill()
        raise AssertionError(f"the server did not start: {line}{process.stderr.read()}")
    return process, line.split("at ")[1].split()[0]


@pytest.fixture(scope="module")
def server(run):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    process, url = _server(run, *SERVER_FLAGS)
    yield process, url
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=CEILING_S)


def _post(url: str, path: str, body: bytes | str | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    import httpx

    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    response = httpx.post(url + path, content=data, headers={"Content-Type": "application/json", **(headers or {})},
                          timeout=CEILING_S)
    try:
        payload = response.json()
    except ValueError:
        payload = {"raw": response.text}
    return response.status_code, payload, dict(response.headers)


@pytest.mark.slow  # a real server process
def test_the_openai_client_works_unchanged(server, client, session):
    from scaletrain.infer.session import Session

    assert [m.id for m in client.models.list().data] == ["run"]
    assert client.models.retrieve("run").id == "run"
    answer = client.chat.completions.create(model="run", messages=MESSAGES, max_tokens=20, temperature=0)
    assert isinstance(session, Session)
    expected = "".join(session.chat(MESSAGES, 20))  # the library's greedy answer: the server's is the same
    assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
    prompt_tokens = len(session.render(MESSAGES))
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (prompt_tokens, prompt_tokens +
                                                                       answer.usage.completion_tokens)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(model="run", messages=MESSAGES, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    completion = client.completions.create(model="run", prompt="ROMEO:", max_tokens=12, temperature=0)
    prompt = session.tokenizer.encode("ROMEO:")
    assert completion.choices[0].text == session.tokenizer.decode(session.generate([prompt], 12)[0])
    assert completion.usage.prompt_tokens == len(prompt)
    pieces = client.completions.create(model="run", prompt="ROMEO:", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == completion.choices[0].text
    stop = expected[5:7]
    stopped = client.chat.completions.create(model="run", messages=MESSAGES, max_tokens=20, temperature=0,
                                             stop=[stop])
    assert stopped.choices[0].message.content == expected[:expected.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    seeded = [client.chat.completions.create(model="run", messages=MESSAGES, max_tokens=16, temperature=1.0,
                                             seed=7).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    # n choices: rows of one batch; greedy ones all the library's answer, seeded ones each its own and again
    three = client.chat.completions.create(model="run", messages=MESSAGES, max_tokens=20, temperature=0, n=3)
    assert [(c.index, c.message.content) for c in three.choices] == [(i, expected) for i in range(3)]
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (prompt_tokens, 60)
    sampled = [[c.message.content for c in client.chat.completions.create(
        model="run", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7, n=2).choices] for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0][0] == seeded[0] and sampled[0][0] != sampled[0][1]
    chunks = list(client.chat.completions.create(model="run", messages=MESSAGES, max_tokens=16, temperature=1.0,
                                                 seed=7, n=2, stream=True, stream_options={"include_usage": True}))
    by_choice = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(2)]
    assert by_choice == sampled[0] and chunks[-1].usage.completion_tokens == 32
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]
    both = client.completions.create(model="run", prompt="ROMEO:", max_tokens=12, temperature=0, n=2)
    assert [c.text for c in both.choices] == [completion.choices[0].text] * 2
    tokens = _post(server[1], "/tokenize", {"prompt": "ROMEO:"})[1]
    assert tokens["tokens"] == prompt and tokens["max_model_len"] == 64
    assert _post(server[1], "/detokenize", {"tokens": prompt})[1] == {"prompt": "ROMEO:"}


@pytest.mark.slow  # a real server process
def test_bad_requests_are_one_status_and_one_message_each(server):
    import httpx

    process, url = server
    fds = _open_fds(process.pid)
    assert len(BAD_REQUESTS) >= 30
    for path, body, status, message in BAD_REQUESTS:
        code, payload, _ = _post(url, path, body)
        assert code == status, (path, str(body)[:80], payload)
        error = payload["error"]
        assert message in error["message"] and "\n" not in error["message"], (str(body)[:80], error)
        assert set(error) == {"message", "type", "param", "code"}
    assert httpx.get(url + CHAT, timeout=CEILING_S).status_code == 405
    assert httpx.get(url + "/health", timeout=CEILING_S).json()["busy"] == 0
    assert _post(url, CHAT, {"messages": MESSAGES, "max_tokens": 3})[0] == 200  # still serving
    assert _open_fds(process.pid) <= fds + 2  # nothing left open (a keep-alive socket of the last request)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow  # a real server process
def test_a_client_killed_mid_stream_frees_its_slot(server):
    import httpx

    process, url = server
    host, port = url.removeprefix("http://").rsplit(":", 1)
    fds = _open_fds(process.pid)
    for _ in range(3):
        body = json.dumps({"messages": MESSAGES, "max_tokens": 30, "stream": True}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert b"200 OK" in sock.recv(4096)
        sock.close()  # killed mid-stream
    deadline = time.monotonic() + CEILING_S
    while httpx.get(url + "/health", timeout=CEILING_S).json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health", timeout=CEILING_S).json()["busy"] == 0
    assert _post(url, CHAT, {"messages": MESSAGES, "max_tokens": 3})[0] == 200
    assert _open_fds(process.pid) <= fds + 2  # nothing left open (a keep-alive socket of the last request)


@pytest.mark.slow  # a real server process
def test_two_hundred_connections_at_once_get_an_answer_each(server):
    import httpx

    process, url = server
    fds = _open_fds(process.pid)
    results: list[tuple[int, dict, dict]] = []
    lock = threading.Lock()

    def one() -> None:
        result = _post(url, CHAT, {"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
        with lock:
            results.append(result)

    threads = [threading.Thread(target=one) for _ in range(200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CEILING_S)
    assert len(results) == 200
    codes = sorted({code for code, _, _ in results})
    assert set(codes) <= {200, 503} and 200 in codes, codes
    answers = {payload["choices"][0]["message"]["content"] for code, payload, _ in results if code == 200}
    assert len(answers) == 1  # greedy: the same answer whichever batch it ran in
    for code, payload, headers in results:
        if code == 503:
            assert headers["retry-after"] == "1" and "the server is busy" in payload["error"]["message"]
    assert httpx.get(url + "/health", timeout=CEILING_S).json()["busy"] == 0
    assert _open_fds(process.pid) <= fds + 8


@pytest.mark.slow  # a real server process
def test_safe_by_default(run, capsys):
    """Another address needs a key; with one, the API answers only requests that carry it."""
    pytest.importorskip("fastapi")
    assert main(["serve", "--run", str(run), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--host 0.0.0.0 lets other machines reach the server: pass --api-key" in err and len(err.splitlines()) == 1
    process, url = _server(run, "--api-key", "sesame")
    try:
        code, payload, headers = _post(url, CHAT, {"messages": MESSAGES, "max_tokens": 2})
        assert code == 401 and payload["error"]["code"] == "invalid_api_key" and headers["www-authenticate"]
        assert _post(url, CHAT, {"messages": MESSAGES, "max_tokens": 2}, {"Authorization": "Bearer nope"})[0] == 401
        assert _post(url, CHAT, {"messages": MESSAGES, "max_tokens": 2}, {"Authorization": "Bearer sesame"})[0] == 200
        import httpx

        page = httpx.get(url + "/", timeout=CEILING_S)  # the page itself asks for the key, it holds none
        assert page.status_code == 200 and "Authorization" in page.text
        preflight = httpx.options(url + CHAT, headers={"Origin": "http://evil.example",
                                                       "Access-Control-Request-Method": "POST"}, timeout=CEILING_S)
        assert "access-control-allow-origin" not in preflight.headers  # CORS off unless --cors-origin
    finally:
        process.terminate()
        process.wait(30)


def test_a_full_queue_is_503_with_retry_after(session):
    """Every slot taken and the queue at its limit: 503 and Retry-After, in the OpenAI error shape."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from scaletrain.infer.batch import Batcher
    from scaletrain.serve.app import ServeOptions, build_app
    from scaletrain.serve.protocol import Limits

    batcher = Batcher(session, slots=1, queue_size=0)  # not started: nothing leaves the queue
    app = build_app(session, batcher, ServeOptions("run", Limits(max_tokens=64)))
    response = TestClient(app).post(CHAT, json={"messages": MESSAGES})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None or shutil.which("chromedriver") is None,
                    reason="no chromium / chromedriver (apt-get install chromium chromium-driver)")
def test_the_chat_page_streams_a_reply_in_a_real_browser(server, session, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    browser = webdriver.Chrome(options=options, service=service)
    try:
        browser.get(server[1] + "/")
        wait = WebDriverWait(browser, CEILING_S)
        wait.until(lambda b: b.find_element(By.ID, "model").text == "run")
        browser.execute_script("document.getElementById('temperature').value = '0';"
                               "document.getElementById('max_tokens').value = '20';")
        browser.find_element(By.ID, "input").send_keys("Hello there")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".assistant[data-done]"))
        reply = browser.find_element(By.CSS_SELECTOR, ".assistant")
        assert reply.get_attribute("data-done") == "true"
        assert browser.execute_script("return arguments[0].textContent", reply) == "".join(session.chat(MESSAGES, 20))
        assert browser.find_element(By.ID, "stop").get_attribute("disabled")  # enabled only while streaming
    finally:
        browser.quit()


def test_serve_refuses_a_port_in_use_in_one_line(run, capsys):
    pytest.importorskip("fastapi")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--run", str(run), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--port {port} is in use" in err and len(err.splitlines()) == 1

