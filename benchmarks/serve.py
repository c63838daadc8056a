"""How many people one CPU process of ``scaletrain serve`` can serve: 1, 8, 32 and 64 concurrent streaming clients
(the ``openai`` client, as a user's code), then a memory soak.

    python benchmarks/serve.py --out benchmarks/results/serve.json                   # the full run (~16 min)
    python benchmarks/serve.py --seconds 20 --soak-minutes 0.5 --label short          # a short run

The server: ``scaletrain serve`` in its own process (``--slots 64``: every client decoded together), over a run
trained here first (a Llama layout of ``SHAPE`` on Tiny Shakespeare, ``TRAIN_STEPS`` steps; its text does not
matter, its shape and context do). Each client loops for ``--seconds``: a streaming chat completion of
``MAX_TOKENS`` tokens at temperature 0.8 (so the answers differ), with ``stream_options.include_usage``; it
records the time to the first content chunk (TTFT), the gaps between content chunks (inter-token latency: a
chunk is one token's text unless a stop string or a multi-byte character held it back), the usage's completion
tokens and any error. Per concurrency: TTFT and inter-token p50/p99, total completion tokens/s (all clients'
tokens / the wall), requests, errors (target 0) and the server's resident memory sampled each second. The soak
then runs 8 clients for ``--soak-minutes`` and reports the memory over time (target: flat) and the open files
before and after. Timings on a machine other processes load are noisy: the result records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "out" / "serve"
SHAPE = {"model.dim": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.ffn_hidden_dim": 384, "model.max_seq_len": 256, "data.seq_len": 256}
TRAIN_STEPS = 20
MAX_TOKENS = 64
CONCURRENCY = (1, 8, 32, 64)
MESSAGES = [{"role": "user", "content": "Tell me of the king."}]


def train(run: Path) -> None:
    done = run.with_name(run.name + ".trained")
    if done.is_file():  # trained to the end before
        return
    flags = {**SHAPE, "train.steps": TRAIN_STEPS, "schedule.warmup_steps": 5, "train.run_dir": run,
             "train.batch_size": 8, "train.eval_interval": 0, "train.sample_tokens": 0, "logging.progress": "off",
             "logging.tensorboard": "false", "train.precision": "fp32", "data.cache_dir": f"{run}-data"}
    subprocess.run([sys.executable, "-m", "scaletrain", "train", *(f"--{k}={v}" for k, v in flags.items()),
                    "--overwrite"], check=True, cwd=ROOT)  # a run cut short before is started again
    done.write_text("")


def start_server(run: Path, slots: int, device: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen([sys.executable, "-m", "scaletrain", "serve", "--run", str(run), "--port", "0",
                                "--slots", str(slots), "--queue", str(4 * slots), "--device", device],
                               stdout=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()
    if "http://" not in line:
        process.kill()
        raise SystemExit(f"serve did not start: {line}")
    return process, line.split("at ")[1].split()[0]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class MemorySampler:
    """The server's resident memory each second, in a thread, while a phase runs."""

    def __init__(self, pid: int):
        self.pid, self.samples, self._stop = pid, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(1.0):
            self.samples.append((round(time.monotonic() - start, 1), round(rss_mib(self.pid), 1)))

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def one_client(client, seconds: float, record: dict) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        last = None
        try:
            stream = await client.chat.completions.create(model="serve-bench", messages=MESSAGES, stream=True,
                                                          max_tokens=MAX_TOKENS, temperature=0.8,
                                                          stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    now = time.perf_counter()
                    if last is None:
                        record["ttft"].append(now - start)
                    else:
                        record["itl"].append(now - last)
                    last = now
                if chunk.usage is not None:
                    record["tokens"] += chunk.usage.completion_tokens
            record["requests"] += 1
        except Exception as exc:  # noqa: BLE001  (counted: the target is none)
            record["errors"].append(f"{type(exc).__name__}: {exc}"[:200])


async def load(url: str, clients: int, seconds: float) -> dict:
    import httpx
    import openai

    record = {"ttft": [], "itl": [], "tokens": 0, "requests": 0, "errors": []}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=600)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one_client(client, seconds, record) for _ in range(clients)))
        record["wall"] = time.perf_counter() - start
    return record


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(clients: int, record: dict, memory: list) -> dict:
    ms = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
    return {"clients": clients, "requests": record["requests"], "errors": len(record["errors"]),
            "error_examples": record["errors"][:3],
            "ttft_ms_p50": ms(percentile(record["ttft"], 50)), "ttft_ms_p99": ms(percentile(record["ttft"], 99)),
            "inter_token_ms_p50": ms(percentile(record["itl"], 50)),
            "inter_token_ms_p99": ms(percentile(record["itl"], 99)),
            "tokens_per_second": round(record["tokens"] / record["wall"], 1),
            "rss_mib_max": max((m for _, m in memory), default=None)}


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60, help="each concurrency level's duration")
    parser.add_argument("--soak-minutes", type=float, default=10, help="the memory soak at 8 clients; 0 = none")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--label", default="full", help="recorded with the result (e.g. short)")
    parser.add_argument("--device", default="cpu", help="serve's --device (scripts/gpu_check.py: cuda)")
    parser.add_argument("--work", default=str(WORK), help="where the run is trained (once)")
    parser.add_argument("--out", default=default_out("serve.json"), help=OUT_HELP.format(name="serve.json"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    run = Path(args.work) / "serve-bench"
    train(run)
    process, url = start_server(run, max(levels), args.device)
    rows, soak = [], {}
    try:
        asyncio.run(load(url, 1, 3))  # warm-up: the first forward's allocations, the tokenizer
        for clients in levels:
            with MemorySampler(process.pid) as memory:
                record = asyncio.run(load(url, clients, args.seconds))
            rows.append(summary(clients, record, memory.samples))
            print(rows[-1], flush=True)
        if args.soak_minutes > 0:
            files = open_files(process.pid)
            with MemorySampler(process.pid) as memory:
                record = asyncio.run(load(url, 8, 60 * args.soak_minutes))
            soak = {"minutes": args.soak_minutes, "clients": 8, "requests": record["requests"],
                    "errors": len(record["errors"]), "rss_mib": memory.samples[::max(1, len(memory.samples) // 60)],
                    "rss_mib_first_minute_max": max((m for t, m in memory.samples if t <= 60), default=None),
                    "rss_mib_last_minute_max": max((m for t, m in memory.samples
                                                    if t >= memory.samples[-1][0] - 60), default=None)
                    if memory.samples else None,
                    "open_files_before": files, "open_files_after": open_files(process.pid)}
            print({k: v for k, v in soak.items() if k != "rss_mib"}, flush=True)
    finally:
        process.terminate()
        process.wait(30)
    one = next((r for r in rows if r["clients"] == 1), None)
    eight = next((r for r in rows if r["clients"] == 8), None)
    result = {"label": args.label, "device": args.device, "seconds_per_level": args.seconds, "max_tokens": MAX_TOKENS,
              "shape": SHAPE,
              "load_average_at_end": os.getloadavg(), "rows": rows, "soak": soak,
              "throughput_8_over_1": round(eight["tokens_per_second"] / one["tokens_per_second"], 2)
              if one and eight and one["tokens_per_second"] else None,
              "median_ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in rows if r["ttft_ms_p50"])
              if rows else None}
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
