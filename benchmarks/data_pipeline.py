"""Data pipeline benchmark: prepare throughput, tokenizer overhead, peak memory at 1x/3x/10x, loader cost.

    .venv/bin/python benchmarks/data_pipeline.py                  # ~20 minutes on 2 busy cores
    .venv/bin/python benchmarks/data_pipeline.py --quick          # 1x only
    .venv/bin/python benchmarks/data_pipeline.py --prepare-only --scales "" --default-scales 30   # add a row

Inputs: all of ../shared/data/gutenberg-shakespeare/ (*.txt) plus ../shared/data/gutenberg-raw-sample/.
1. ``prepare`` end to end with dedup off at each scale (1x, 3x, 10x: the corpus listed k times through
   symlinks, so every copy is read and processed again): every byte flows through every stage, so the
   peak RSS shows whether memory stays flat as the input grows. Then the default config (clean, filters,
   exact + near dedup, BPE 8192) at 1x and 10x: at 10x the nine extra copies are exact duplicates, so
   the same documents are kept and the dedup state (which grows with *kept* documents, by design) stays
   the same size - its growth is measured separately (4). Each run is a fresh process; MB/s of raw
   input; peak RSS of the whole process tree (workers included), sampled every 20 ms, overall and per
   pass (pass 1 clean/filter/dedup, pass 2 tokenizer training, pass 3 encode + shard writing).
   Rows ``prepare_<k>x_nodedup`` and ``prepare_<k>x_default`` in the JSON.
2. Tokenization in one process, same texts, same tokenizer, back to back: plain
   ``Tokenizer.encode_batch(all texts)``, the same plus reading ``.ids`` (what any consumer must do),
   ``encode_batch_fast`` (no offsets) plus ``.ids``,
   and the pipeline's encode stage (``encode.encode_stream``: batches, ids -> numpy, EOS) in-process and
   with 2 worker processes. One warm-up call first; best of 3 each; ratios are time / plain time.
3. Loader: ms per batch at 12 x 64 (the foundation's baby-GPT recipe) with and without prefetch, and
   training steps of that recipe's model (forward, backward, AdamW) fed by the live loader vs by batches
   read beforehand, with the time spent inside ``next(loader)`` as the loader's share of a step.
4. Dedup state: Python heap (tracemalloc) per kept document of ``dedup.Deduplicator`` (exact + near,
   default settings) after 20,000 distinct random signatures: what grows with the corpus by design.

Prints a table and writes benchmarks/out/data_pipeline.json (``--out benchmarks/results/data_pipeline.json``
replaces the tracked result; ``--prepare-only`` / ``--loader-only`` merge into --out, or into a copy of the
tracked result when --out does not exist yet).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from launch import (  # benchmarks/launch.py (the script's folder is on sys.path)
    OUT_HELP,
    RESULTS,
    default_out,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
SOURCES = [SHARED / "gutenberg-shakespeare", SHARED / "gutenberg-raw-sample"]


# -- 1: prepare in a child process, peak RSS of its process tree -------------------------------------

def _tree_rss_kb(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants (kB), from /proc."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


CHILD = """
import json, sys, threading, time
from pathlib import Path
from scaletrain.data import prepare as stages
from scaletrain.data.prepare_config import PrepareConfig
from scaletrain.data.report import Report
sys.path.insert(0, sys.argv[5])
from data_pipeline import _tree_rss_kb

PASSES = {"clean_corpus": "pass1_clean_filter_dedup", "make_tokenizer": "pass2_tokenizer",
          "write_shards": "pass3_encode_write"}
current, peaks = ["setup"], {}

def sample(stop):
    while not stop.is_set():
        peaks[current[0]] = max(peaks.get(current[0], 0), _tree_rss_kb(PID))
        time.sleep(0.02)

def tagged(name):
    fn = getattr(stages, name)
    def run(*args, **kwargs):
        current[0] = PASSES[name]
        try:
            return fn(*args, **kwargs)
        finally:
            current[0] = "finish"
    return run

if __name__ == "__main__":
    import os
    PID = os.getpid()
    paths, out, dedup_on, sample_mb = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", float(sys.argv[4])
    for name in PASSES:  # prepare() calls the passes through the module, so this tags them
        setattr(stages, name, tagged(name))
    cfg = PrepareConfig()
    cfg.source.paths, cfg.source.include = paths, ["*.txt"]
    cfg.dedup.exact = cfg.dedup.near = dedup_on
    if sample_mb > 0:
        cfg.tokenizer.train_sample_mb = sample_mb
    cfg.output.dir, cfg.output.force = out, True
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop,), daemon=True)
    sampler.start()
    report = Report()
    t0 = time.perf_counter()
    stages.prepare(cfg, report)
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    print(report.table(), file=sys.stderr)
    print(json.dumps({"seconds": seconds, "pass_peak_rss_kb": peaks,
                      "report": {k: v for k, v in report.to_dict().items() if k != "messages"}}))
"""


def run_prepare(paths: list[Path], out: Path, dedup_on: bool, sample_mb: float = 0) -> dict:
    """``prepare`` in a fresh process; its tree's peak RSS sampled from here (overall) and inside
    (per pass). ``sample_mb`` > 0 overrides ``tokenizer.train_sample_mb``."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps([str(p) for p in paths]), str(out),
                             "1" if dedup_on else "0", str(sample_mb), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss_kb(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"prepare failed:\n{stderr}")
    result = json.loads(stdout.strip().splitlines()[-1])
    rep = result["report"]
    kept = sum(s.get("documents", 0) for s in rep["splits"].values())
    return {"mb_in": round(rep["bytes_in"] / 1e6, 2), "documents_in": rep["documents_in"], "documents_kept": kept,
            "seconds": round(result["seconds"], 2),
            "mb_per_second": round(rep["bytes_in"] / 1e6 / result["seconds"], 3),
            "peak_rss_mb": round(peak / 1024, 1),
            "peak_rss_mb_per_pass": {k: round(v / 1024, 1) for k, v in result["pass_peak_rss_kb"].items()},
            "tokens_out": rep["tokens_out"], "bytes_per_token": rep["bytes_per_token"], "removed": rep["removed"],
            "timings": rep["timings"], "train_sample_mb": sample_mb or "default (64)", "table": stderr.strip()}


def copies(tmp: Path, k: int) -> list[Path]:
    """The corpus k times, as symlinks (no disk copies; every copy is read and processed again)."""
    if k == 1:
        return list(SOURCES)
    roots = [tmp / f"x{k}" / f"copy{i}" for i in range(k)]
    if not (tmp / f"x{k}").exists():
        for root in roots:
            for src in SOURCES:
                (root / src.name).mkdir(parents=True)
                for f in src.glob("*.txt"):
                    (root / src.name / f.name).symlink_to(f)
    return roots


# -- 2: tokenization, same process, same texts ----------------------------------------------------------

def bench_tokenization(prepared: Path) -> dict:
    import numpy as np
    from tokenizers import Tokenizer

    from scaletrain.data.encode import encode_stream
    from scaletrain.data.prepare import read_cleaned
    from scaletrain.data.tokenizer import load_tokenizer

    texts = [t for _, t in read_cleaned(prepared / ".work" / "cleaned.zst")]
    n_bytes = sum(len(t.encode()) for t in texts)
    plain = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    ours = load_tokenizer(prepared / "tokenizer.json")

    def batches(size=4_000_000):
        batch, n = [], 0
        for t in texts:
            batch.append([t])
            n += len(t)
            if n >= size:
                yield batch
                batch, n = [], 0
        if batch:
            yield batch

    variants = {
        "plain encode_batch": lambda: plain.encode_batch(texts),
        "plain encode_batch + .ids": lambda: [e.ids for e in plain.encode_batch(texts)],
        "plain encode_batch_fast + .ids": lambda: [e.ids for e in plain.encode_batch_fast(texts)],
        "pipeline encode stage (in-process)": lambda: sum(
            len(a) for arrs in encode_stream(batches(), ours, prepared / "tokenizer.json", np.dtype("<u2"), 0)
            for a in arrs),
        "pipeline encode stage (2 processes)": lambda: sum(
            len(a) for arrs in encode_stream(batches(1_000_000), ours, prepared / "tokenizer.json",
                                             np.dtype("<u2"), 2) for a in arrs),
    }
    plain.encode_batch(texts)  # warm-up: the first pass fills the BPE word cache and is ~2x slower
    ours.encode_batch(texts[:5])
    rows = {name: float("inf") for name in variants}
    for _ in range(3):  # rounds interleave the variants, so load changes on the shared machine hit all alike
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            rows[name] = min(rows[name], time.perf_counter() - t0)
    base = rows["plain encode_batch"]
    fast = rows["plain encode_batch_fast + .ids"]
    return {"mb": round(n_bytes / 1e6, 2), "documents": len(texts),
            "rows": {k: {"seconds": round(v, 3), "mb_per_second": round(n_bytes / 1e6 / v, 2),
                         "ratio_to_plain": round(v / base, 3), "ratio_to_plain_fast": round(v / fast, 3)}
                     for k, v in rows.items()}}


# -- 3: loader against a training step of the baby-GPT recipe ------------------------------------------

def bench_loader(tmp: Path) -> dict:
    import dataclasses

    import torch
    import torch.nn.functional as F

    from scaletrain.config import load_config
    from scaletrain.data.loader import TokenLoader
    from scaletrain.data.prepare import prepare_text
    from scaletrain.model import build_model

    torch.set_num_threads(2)
    data = tmp / "tinyshakespeare"
    manifest = prepare_text("builtin:tinyshakespeare", data, tokenizer="char")
    job = load_config(ROOT / "configs" / "shakespeare_char_baby_adamw.toml")
    B, T = job.train.batch_size, job.data.seq_len
    model = build_model(dataclasses.replace(job.model, vocab_size=manifest["vocab_size"]), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"batch": f"{B} x {T}"}
    for prefetch in (0, 2):
        loader = TokenLoader(str(data), "train", T, B, seed=1337, prefetch=prefetch)
        next(loader)
        t0 = time.perf_counter()
        for _ in range(2000):
            next(loader)
        out[f"loader_ms_per_batch_prefetch{prefetch}"] = round((time.perf_counter() - t0) / 2000 * 1e3, 4)
        loader.close()
    # Training steps fed by batches read beforehand, by the loader without and with prefetch, in rotating
    # blocks so that load changes on the shared machine hit all three alike. (A single fixed batch would
    # overfit into denormal gradients and slow the step down.) The loader's cost as the trainer sees it
    # is the time spent inside next(loader).
    loaders = {0: TokenLoader(str(data), "train", T, B, seed=1337, prefetch=0),
               2: TokenLoader(str(data), "train", T, B, seed=1337, prefetch=2)}
    ready = [b for _, b in zip(range(200), TokenLoader(str(data), "train", T, B, seed=99, prefetch=0))]
    for x, y in ready[:10]:
        step(x, y)
    steps = {"preloaded": [], 0: [], 2: []}
    waits = {0: [], 2: []}
    for block in range(6):
        for mode in steps:
            t0 = time.perf_counter()
            for k in range(10):
                if mode == "preloaded":
                    x, y = ready[(block * 10 + k) % len(ready)]
                else:
                    w0 = time.perf_counter()
                    x, y = next(loaders[mode])
                    waits[mode].append(time.perf_counter() - w0)
                step(x, y)
            steps[mode].append((time.perf_counter() - t0) / 10)
    for loader in loaders.values():
        loader.close()
    median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    step_ms = {m: median(v) * 1e3 for m, v in steps.items()}
    for p in (0, 2):
        wait_ms = sum(waits[p]) / len(waits[p]) * 1e3
        out[f"wait_ms_per_step_prefetch{p}"] = round(wait_ms, 4)
        out[f"loader_share_of_step_pct_prefetch{p}"] = round(100 * wait_ms / step_ms[p], 3)
        out[f"step_ms_loader_prefetch{p}"] = round(step_ms[p], 2)
    out["step_ms_preloaded"] = round(step_ms["preloaded"], 2)
    return out


# -- 4: what the dedup state costs per kept document ---------------------------------------------------

def bench_dedup_state(n: int = 20_000) -> dict:
    import hashlib
    import tracemalloc

    import numpy as np

    from scaletrain.data.dedup import Deduplicator
    from scaletrain.data.prepare_config import DedupConfig

    rng = np.random.default_rng(0)
    cfg = DedupConfig()
    sigs = rng.integers(0, 2**32, (n, cfg.num_perm), dtype=np.uint32)  # distinct documents: all kept
    names = [f"corpus/some-folder/document-{i:07d}.txt" for i in range(n)]
    tracemalloc.start()
    dedupper = Deduplicator(cfg)
    before = tracemalloc.get_traced_memory()[0]
    kept = sum(dedupper.check(i, names[i], hashlib.sha256(names[i].encode()).digest(), sigs[i].copy()) is None
               for i in range(n))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"documents_kept": kept, "bytes_per_kept_document": round(grown / kept),
            "mb_per_million_kept": round(grown / kept * 1e6 / 1e6), "num_perm": cfg.num_perm,
            "threshold": cfg.threshold}


def render_table(results: dict) -> str:
    """The markdown table of every measurement in ``results`` (also after a partial re-run)."""
    lines = ["| measurement | value |", "|---|---|"]
    for key in sorted((k for k in results if k.startswith("prepare_")),
                      key=lambda k: (k.endswith("default"), int(k.split("_")[1][:-1]))):
        r = results[key]
        passes = " / ".join(f"{v}" for k, v in r["peak_rss_mb_per_pass"].items() if k.startswith("pass"))
        lines.append(f"| {key}: {r['mb_in']} MB in, {r['documents_in']} docs, {r['documents_kept']} kept | "
                     f"{r['mb_per_second']} MB/s, {r['seconds']} s, peak RSS {r['peak_rss_mb']} MB "
                     f"(pass 1 / 2 / 3: {passes} MB), {r['tokens_out']:,} tokens |")
    tok = results["tokenization"]
    for name, r in tok["rows"].items():
        lines.append(f"| tokenization ({tok['mb']} MB): {name} | {r['mb_per_second']} MB/s, time "
                     f"{r['ratio_to_plain']}x plain encode_batch, {r['ratio_to_plain_fast']}x encode_batch_fast |")
    lo = results["loader"]
    lines.append(f"| loader {lo['batch']}: ms/batch (prefetch 0 / 2) | {lo['loader_ms_per_batch_prefetch0']} / "
                 f"{lo['loader_ms_per_batch_prefetch2']} ms |")
    lines.append(f"| baby-GPT step, median of 6 blocks: pre-read batches / loader / loader+prefetch | "
                 f"{lo['step_ms_preloaded']} / {lo['step_ms_loader_prefetch0']} / "
                 f"{lo['step_ms_loader_prefetch2']} ms |")
    for p in (0, 2):
        lines.append(f"| time inside next(loader) per step, prefetch {p} | {lo[f'wait_ms_per_step_prefetch{p}']} ms = "
                     f"{lo[f'loader_share_of_step_pct_prefetch{p}']} % of the step |")
    dd = results["dedup_state"]
    lines.append(f"| dedup state per kept document ({dd['documents_kept']:,} kept, num_perm {dd['num_perm']}) | "
                 f"{dd['bytes_per_kept_document']} bytes (~{dd['mb_per_million_kept']} MB per million) |")
    return "\n".join(lines)


def merge_base(out: Path) -> dict:
    """What a partial re-run merges its rows into: ``out`` when it exists, else the tracked result."""
    return json.loads((out if out.is_file() else RESULTS / "data_pipeline.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1x only (no 3x/10x runs)")
    parser.add_argument("--scales", default="1,3,10", help="corpus copies for the dedup-off runs (default 1,3,10)")
    parser.add_argument("--default-scales", default="1,10", help="corpus copies for the default-config runs")
    parser.add_argument("--sample-mb", type=float, default=0,
                        help="override tokenizer.train_sample_mb in every prepare run (0: the default, 64)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only the prepare runs, merged into the existing --out JSON (e.g. --scales '' "
                             "--default-scales 30 adds a 30x row)")
    parser.add_argument("--loader-only", action="store_true",
                        help="only the loader rows (a quiet-machine re-run), merged into the existing --out JSON")
    parser.add_argument("--out", default=default_out("data_pipeline.json"),
                        help=OUT_HELP.format(name="data_pipeline.json"))
    args = parser.parse_args()
    if args.loader_only:
        results = merge_base(Path(args.out))
        load_start = os.getloadavg()
        with tempfile.TemporaryDirectory() as tmp_name:
            results["loader"] = bench_loader(Path(tmp_name))
        results["loader"]["run"] = {"command": " ".join(["benchmarks/data_pipeline.py"] + sys.argv[1:]),
                                    "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()}
        print(json.dumps(results["loader"], indent=1))
        results["table"] = render_table(results)
        write_result(args.out, results, indent=2)
        print(f"wrote {args.out} (loader rows)")
        return
    if not all(s.is_dir() for s in SOURCES):
        raise SystemExit(f"needs {SOURCES[0]} and {SOURCES[1]}")
    scales = [1] if args.quick else [int(k) for k in args.scales.split(",") if k]
    default_scales = [1] if args.quick else [int(k) for k in args.default_scales.split(",") if k]
    command = " ".join(["benchmarks/data_pipeline.py"] + sys.argv[1:])
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg_at_start": os.getloadavg()}
    if args.prepare_only:
        results = merge_base(Path(args.out))
        results.setdefault("more_runs", []).append({"command": command, "machine": machine})
    else:
        results = {"machine": machine, "command": command}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for dedup_on, ks in ((False, scales), (True, default_scales)):
            for k in ks:
                key = f"prepare_{k}x_{'default' if dedup_on else 'nodedup'}"
                print(f"{key} ...", flush=True)
                results[key] = run_prepare(copies(tmp, k), tmp / key, dedup_on, args.sample_mb)
                results[key]["command"] = command
                print(results[key]["table"], flush=True)
        if not args.prepare_only:
            print("tokenization ...", flush=True)
            results["tokenization"] = bench_tokenization(tmp / "prepare_1x_default")
            print("loader ...", flush=True)
            results["loader"] = bench_loader(tmp)
    if not args.prepare_only:
        print("dedup state ...", flush=True)
        results["dedup_state"] = bench_dedup_state()
        results["machine"]["loadavg_at_end"] = os.getloadavg()
    else:
        results["more_runs"][-1]["machine"]["loadavg_at_end"] = os.getloadavg()
    for key in list(results):
        if key.startswith("prepare_"):
            results[key].pop("table", None)

    table = render_table(results)
    print(table)
    results["table"] = table
    write_result(args.out, results, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
