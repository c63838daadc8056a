"""How many people one CPU process of ``scaletrain serve`` can serve: 1, 8, 32 and 64 concurrent streaming clients
(the ``openai`` client, as a user's code), then a soak; or the eager decode against ``serve --compile``'s.

    python benchmarks/serve.py --soak 600 --out benchmarks/results/serve.json              # the full run (~15 min)
    python benchmarks/serve.py --seconds 15 --soak 60 --label short                         # a short run
    python benchmarks/serve.py --compare-compile --seconds 10 --out benchmarks/results/serve_compile.json

The server: ``scaletrain serve`` in its own process (``--slots 64``: every client decoded together), over a run
trained here first (a Llama layout of ``SHAPE`` on Tiny Shakespeare, ``TRAIN_STEPS`` steps; its text does not
matter, its shape and context do). Each client loops for ``--seconds``: a streaming chat completion of
``MAX_TOKENS`` tokens at temperature 0.8 (so the answers differ), with ``stream_options.include_usage``; it
records the time to the first content chunk (TTFT), the gaps between content chunks (inter-token latency: a
chunk is one token's text unless a stop string or a multi-byte character held it back), the usage's completion
tokens and any error. Per concurrency: TTFT and inter-token p50/p99, total completion tokens/s (all clients'
tokens / the wall), requests, errors (target 0) and the server's resident memory sampled each second.

``--soak SECONDS`` then keeps ``--soak-clients`` clients going that long and samples the server's resident memory
and open file descriptors (psutil) every ``--sample-every`` seconds: the series and their least-squares slopes go
to the JSON, and the memory is flat when its slope over the soak's second half (after the clients' connections,
buffers and the allocator's growth have settled; the slope over all of it is recorded too) is under
``FLAT_MIB_PER_MINUTE``: 10 MiB over 10 minutes, a leak of ~1.5 KB a request at ~700 requests a minute.

``--compare-compile``: instead, two servers of ``COMPARE_SLOTS`` slots, the eager decode and ``--compile``'s (the
step compiled over every slot), under 1 and 8 clients in ``--rounds`` interleaved rounds: tokens/s side by side,
each level's median round (the compiled server's start includes its compile, recorded). Timings on a machine
other processes load are noisy: the result records the load average.
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
FLAT_MIB_PER_MINUTE = 1.0  # the soak's memory counts as flat under this slope (10 MiB over 10 minutes)
COMPARE_SLOTS = 8  # --compare-compile's servers: 8 slots (the compiled step always decodes all of them)


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


def start_server(run: Path, slots: int, device: str, *extra: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen([sys.executable, "-m", "scaletrain", "serve", "--run", str(run), "--port", "0",
                                "--slots", str(slots), "--queue", str(4 * slots), "--device", device, *extra],
                               stdout=subprocess.PIPE, text=True, env=env)
    line = process.stdout.readline()
    if "http://" not in line:
        process.kill()
        raise SystemExit(f"serve did not start: {line}")
    return process, line.split("at ")[1].split()[0]


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


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


def slope_per_minute(series: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, value) samples, per minute (None with fewer than two)."""
    if len(series) < 2 or len({t for t, _ in series}) < 2:
        return None
    return round(60 * statistics.linear_regression([t for t, _ in series], [v for _, v in series]).slope, 3)


def soak(process: subprocess.Popen, url: str, clients: int, seconds: float, every: float) -> dict:
    """``clients`` streaming clients for ``seconds`` while a thread samples the server's RSS (MiB) and open file
    descriptors every ``every`` seconds (the first sample at the start)."""
    import psutil

    server = psutil.Process(process.pid)
    rss, fds, stop = [], [], threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while True:
            t = round(time.monotonic() - start, 1)
            rss.append((t, round(server.memory_info().rss / 2 ** 20, 1)))
            fds.append((t, server.num_fds()))
            if stop.wait(every):
                break

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    record = asyncio.run(load(url, clients, seconds))
    stop.set()
    sampler.join()
    later = lambda series: [(t, v) for t, v in series if t >= seconds / 2]  # noqa: E731
    rss_slope = slope_per_minute(later(rss))
    return {"seconds": seconds, "clients": clients, "sample_every_s": every, "requests": record["requests"],
            "errors": len(record["errors"]), "error_examples": record["errors"][:3],
            "tokens_per_second": round(record["tokens"] / record["wall"], 1),
            "rss_mib": rss, "open_fds": fds, "rss_mib_per_minute_all": slope_per_minute(rss),
            "rss_mib_per_minute": rss_slope, "open_fds_per_minute": slope_per_minute(later(fds)),
            "flat_bound_mib_per_minute": FLAT_MIB_PER_MINUTE,
            "rss_flat": rss_slope is not None and abs(rss_slope) < FLAT_MIB_PER_MINUTE,
            "open_fds_first_last": [fds[0][1], fds[-1][1]]}


def ratio(rows: list[dict], clients: int = 8) -> float | None:
    """Tokens/s at ``clients`` clients over one client's."""
    one = next((r for r in rows if r["clients"] == 1), None)
    many = next((r for r in rows if r["clients"] == clients), None)
    return round(many["tokens_per_second"] / one["tokens_per_second"], 2) if one and many and \
        one["tokens_per_second"] else None


def decode_steps(url: str) -> int:
    import httpx

    return httpx.get(url + "/health", timeout=60).json()["steps"]


def levels_run(url: str, pid: int, levels: list[int], seconds: float) -> list[dict]:
    """Each level's ``summary``, with where the time went: the server's and this load generator's CPU seconds a
    second of wall (psutil; 2 would be two cores busy), the server's decode steps a second and tokens a step
    (``/health``'s step count)."""
    import psutil

    server = psutil.Process(pid)
    cpu = lambda process: sum(process.cpu_times()[:2])  # noqa: E731  (user + system, every thread)
    asyncio.run(load(url, 1, 3))  # warm-up: the first forward's allocations, the tokenizer
    rows = []
    for clients in levels:
        steps, server_s, client_s = decode_steps(url), cpu(server), cpu(psutil.Process())
        with MemorySampler(pid) as memory:
            record = asyncio.run(load(url, clients, seconds))
        steps = decode_steps(url) - steps
        row = summary(clients, record, memory.samples)
        row.update({"server_cpu_per_s": round((cpu(server) - server_s) / record["wall"], 2),
                    "client_cpu_per_s": round((cpu(psutil.Process()) - client_s) / record["wall"], 2),
                    "decode_steps_per_second": round(steps / record["wall"], 1),
                    "tokens_per_step": round(record["tokens"] / steps, 2) if steps else None})
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def compare_compile(run: Path, args: argparse.Namespace) -> dict:
    """The eager and the compiled decode (``serve --compile``), each its own server of ``COMPARE_SLOTS`` slots,
    both up at once (the one not measured idles: its batcher waits), measured in ``--rounds`` interleaved rounds
    of 1 and 8 clients: per mode and level, every round's tokens/s and the median round's row."""
    servers = {}
    try:
        for mode, extra in (("eager", ()), ("compiled", ("--compile",))):
            start = time.perf_counter()
            servers[mode] = (*start_server(run, COMPARE_SLOTS, args.device, *extra),
                             round(time.perf_counter() - start, 1))
        rounds = {mode: [] for mode in servers}
        for _ in range(args.rounds):
            for mode, (process, url, _) in servers.items():
                rounds[mode].append(levels_run(url, process.pid, [1, 8], args.seconds))
    finally:
        for process, _, _ in servers.values():
            stop_server(process)
    modes = {}
    for mode, runs in rounds.items():
        rows = [sorted((r[i] for r in runs), key=lambda row: row["tokens_per_second"])[len(runs) // 2]
                for i in range(2)]  # each level's median round
        modes[mode] = {"seconds_to_serving": servers[mode][2], "rows": rows, "throughput_8_over_1": ratio(rows),
                       "tokens_per_second_rounds": {r["clients"]: [run[i]["tokens_per_second"] for run in runs]
                                                    for i, r in enumerate(rows)}}
    tps = {mode: [r["tokens_per_second"] for r in m["rows"]] for mode, m in modes.items()}
    return {"slots": COMPARE_SLOTS, "rounds": args.rounds, "modes": modes,
            "compiled_over_eager": [round(c / e, 2) if e else None for c, e in zip(tps["compiled"], tps["eager"])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60, help="each concurrency level's duration")
    parser.add_argument("--soak", type=float, default=0, metavar="SECONDS",
                        help="then keep --soak-clients clients going this long, sampling the server's memory and "
                             "open files (the full run: 600); 0 = none")
    parser.add_argument("--soak-clients", type=int, default=8)
    parser.add_argument("--sample-every", type=float, default=10, help="the soak's sampling period (seconds)")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="the levels, comma-separated ('' for none: only the soak)")
    parser.add_argument("--compare-compile", action="store_true",
                        help="the eager decode against serve --compile's, at 1 and 8 clients (nothing else)")
    parser.add_argument("--compile", action="store_true", help="the table and soak against serve --compile")
    parser.add_argument("--rounds", type=int, default=3, help="--compare-compile's interleaved rounds")
    parser.add_argument("--label", default="full", help="recorded with the result (e.g. short)")
    parser.add_argument("--device", default="cpu", help="serve's --device (scripts/gpu_check.py: cuda)")
    parser.add_argument("--work", default=str(WORK), help="where the run is trained (once)")
    parser.add_argument("--out", default=default_out("serve.json"), help=OUT_HELP.format(name="serve.json"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    run = Path(args.work) / "serve-bench"
    train(run)
    result = {"label": args.label, "device": args.device, "seconds_per_level": args.seconds, "max_tokens": MAX_TOKENS,
              "shape": SHAPE,
              "decode": "eager and compiled" if args.compare_compile else "compiled" if args.compile else "eager"}
    if args.compare_compile:
        result.update(compare_compile(run, args))
    else:
        process, url = start_server(run, max(levels + [args.soak_clients]), args.device,
                                    *(("--compile",) if args.compile else ()))
        rows, soaked = [], {}
        try:
            rows = levels_run(url, process.pid, levels, args.seconds)
            if args.soak > 0:
                soaked = soak(process, url, args.soak_clients, args.soak, args.sample_every)
                print({k: v for k, v in soaked.items() if k not in ("rss_mib", "open_fds")}, flush=True)
        finally:
            stop_server(process)
        result.update({"rows": rows, "soak": soaked, "throughput_8_over_1": ratio(rows),
                       "median_ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in rows if r["ttft_ms_p50"])
                       if rows else None})
    result["load_average_at_end"] = os.getloadavg()
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
