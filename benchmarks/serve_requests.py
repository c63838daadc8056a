"""Bad requests against a real ``scaletrain serve``, each recorded with the status and the one message it got:
the table ``tests/serve/test_serve.py`` asserts (``tests/helpers/serve_requests.py``: broken JSON, wrong types, huge
bodies, non-UTF-8, negative or huge ``max_tokens``, unknown roles, ...), then a wrong method, clients killed
mid-stream and 200 connections at once; the server's open file descriptors and resident memory before and
after, and whether it still answers.

    python benchmarks/serve_requests.py --out benchmarks/results/serve_requests.json

The server is the tests' (a tiny run trained here first, context 64, served with the table's ``SERVER_FLAGS``),
so every expected status and message of the table holds for it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.serve_requests import BAD_REQUESTS, CHAT, MESSAGES, SERVER_FLAGS  # noqa: E402
from helpers.tiny import tiny_overrides  # noqa: E402

WORK = ROOT / "benchmarks" / "out" / "serve_requests"
TIMEOUT_S = 120


def train(run: Path) -> None:
    done = run.with_name(run.name + ".trained")
    if done.is_file():  # trained to the end before
        return
    overrides = tiny_overrides(run, **{"train.steps": 30, "model.max_seq_len": 64, "data.seq_len": 64})
    subprocess.run([sys.executable, "-m", "scaletrain", "train", *(f"--{k}={v}" for k, v in overrides.items()),
                    "--overwrite"], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    done.write_text("")


def post(url: str, path: str, body: bytes | str | dict) -> tuple[int, dict, dict]:
    import httpx

    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    response = httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    try:
        payload = response.json()
    except ValueError:
        payload = {"raw": response.text[:200]}
    return response.status_code, payload, dict(response.headers)


def shown(body: bytes | str | dict) -> str:
    """A body as the record shows it: at most 100 characters (bytes as Python writes them)."""
    text = json.dumps(body, ensure_ascii=True) if isinstance(body, dict) else repr(body) if isinstance(body, bytes) \
        else body
    return text if len(text) <= 100 else f"{text[:80]}... ({len(text)} characters)"


def killed_mid_stream(url: str, times: int = 3) -> dict:
    import httpx

    host, port = url.removeprefix("http://").rsplit(":", 1)
    for _ in range(times):
        body = json.dumps({"messages": MESSAGES, "max_tokens": 30, "stream": True}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        first = sock.recv(4096)
        sock.close()
    deadline = time.monotonic() + TIMEOUT_S
    while httpx.get(url + "/health", timeout=TIMEOUT_S).json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    busy = httpx.get(url + "/health", timeout=TIMEOUT_S).json()["busy"]
    return {"case": f"{times} streaming clients killed after the first bytes", "first_status_line":
            first.split(b"\r\n")[0].decode(), "busy_after": busy}


def connections_at_once(url: str, n: int = 200) -> dict:
    results: list[tuple[int, dict, dict]] = []
    lock = threading.Lock()

    def one() -> None:
        result = post(url, CHAT, {"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
        with lock:
            results.append(result)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    busy = [p["error"]["message"] for code, p, _ in results if code == 503]
    return {"case": f"{n} connections at once (max_tokens 4, greedy)", "answered": len(results),
            "statuses": dict(Counter(code for code, _, _ in results)),
            "retry_after": sorted({h.get("retry-after") for code, _, h in results if code == 503}),
            "message_503": busy[0] if busy else None,
            "distinct_answers_200": len({p["choices"][0]["message"]["content"] for c, p, _ in results if c == 200})}


def main() -> None:
    import httpx
    import psutil

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(WORK), help="where the tiny run is trained (once)")
    parser.add_argument("--out", default=default_out("serve_requests.json"),
                        help=OUT_HELP.format(name="serve_requests.json"))
    args = parser.parse_args()
    run = Path(args.work) / "run"
    train(run)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "scaletrain", "serve", "--run", str(run), "--port", "0",
                                *SERVER_FLAGS], stdout=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()
    if "http://" not in line:
        process.kill()
        raise SystemExit(f"serve did not start: {line}")
    url = line.split("at ")[1].split()[0]
    server = psutil.Process(process.pid)
    try:
        assert post(url, CHAT, {"messages": MESSAGES, "max_tokens": 3})[0] == 200  # warm: the first forward
        before = {"open_fds": server.num_fds(), "rss_mib": round(server.memory_info().rss / 2 ** 20, 1)}
        cases = []
        for path, body, status, message in BAD_REQUESTS:
            code, payload, _ = post(url, path, body)
            error = payload.get("error", {})
            cases.append({"path": path, "body": shown(body), "status": code, "message": error.get("message"),
                          "as_expected": code == status and message in (error.get("message") or "")
                          and "\n" not in error.get("message", "")})
        wrong = httpx.get(url + CHAT, timeout=TIMEOUT_S)
        cases.append({"path": CHAT, "body": "(GET)", "status": wrong.status_code,
                      "message": wrong.json()["error"]["message"], "as_expected": wrong.status_code == 405})
        events = [killed_mid_stream(url), connections_at_once(url)]
        still = post(url, CHAT, {"messages": MESSAGES, "max_tokens": 3})[0]
        after = {"open_fds": server.num_fds(), "rss_mib": round(server.memory_info().rss / 2 ** 20, 1)}
    finally:
        process.terminate()
        process.wait(30)
    result = {"server_flags": list(SERVER_FLAGS), "requests_tried": len(cases) + 3 + 200,
              "table_cases": len(cases), "table_as_expected": sum(c["as_expected"] for c in cases),
              "statuses": dict(Counter(c["status"] for c in cases)), "cases": cases, "events": events,
              "still_serving_status": still, "before": before, "after": after}
    print({k: v for k, v in result.items() if k != "cases"})
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
