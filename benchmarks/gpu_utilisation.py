"""Fit the planner's GPU utilisation to published training runs, and check it on runs it was not fitted to.

The planner's GPU step time is model FLOPs / (datasheet peak x utilisation). The utilisation used to be one
constant per device kind taken from one published run; runs of other sizes came out 10-26% slower than
reality. Here it is ``Hardware.utilisation_at(dim, attention_share)``: a ceiling per device kind that the
GEMMs reach as the width grows (``ceiling * dim / (dim + half_width)``: small models underuse the tensor
cores -- short GEMM tiles, and each kernel's fixed cost weighs more), and attention's QK^T / AV at their own
fraction of it (FlashAttention kernels run at a different rate than GEMMs, and attention's share of the FLOPs
grows with the sequence). Three numbers per device kind, fitted by least squares on log tokens/s.

Every row is a published measurement, cited (source, table, row). The prediction is the planner's own
(``scaletrain.plan.timing.step_time``: its FLOP counting, FSDP communication over the catalog's links,
optimizer and recomputation), not the published MFU: MosaicML's MFU counts a learned position table of
max_seq_len x d_model as 6N FLOPs a token (its NumParams grows with the sequence), which ours does not, so
the comparison is in tokens/s per GPU and the "MFU (ours)" column recomputes MFU with our FLOP counting.

Fit rows: llm-foundry's H100 80GB BF16 and A100 80GB tables, runs on one node (8 GPUs: FSDP over NVLink,
which the planner hides behind compute, so these rows test the compute rate alone) without activation
checkpointing. Held-out rows: the same tables' multi-node runs and runs with activation checkpointing,
llm-foundry's A100 40GB table (other runs, 8-128 GPUs), and torchtitan's Llama 3 runs (another code base:
A100 80GB and H100). Held-out rows also test the planner's communication and recomputation models.

    python benchmarks/gpu_utilisation.py     # writes benchmarks/out/gpu_utilisation.json (needs scipy)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)
from scaletrain.config import ModelConfig, build
from scaletrain.hardware.catalog import CATALOG, Cluster, Hardware
from scaletrain.model.presets import PRESETS, flops_per_token
from scaletrain.plan.timing import gpu_utilisation, step_time
from scaletrain.plan.workload import Plan, Workload

FOUNDRY = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md (MPT Training Benchmarks, read at "
           "commit 061f2c7ce64e655100286584a7629e2a09f827ba)")
FOUNDRY_TABLES = {"h100-sxm": "table 'H100 80GB BF16'", "a100-80gb": "table 'A100 80GB with 1600 Gbps node-node "
                  "interconnect (RoCE)'", "a100-40gb": "table 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)'"}
# MPT shapes: vocab_size 50368 and expansion_ratio 4 (GELU MLP, 8 d^2 weights a block) from
# scripts/train/yamls/pretrain/mpt-125m.yaml; d_model from how the tables' NumParams grows with the sequence
# (a max_seq_len x d_model position table) and n_layers from NumParams = 12 L d^2 + (V + T) d + norms.
# Two (seq, NumParams) points per size, read from the tables (MPT_NUMPARAMS), derive them in mpt_shape().
MPT_VOCAB = 50368
MPT_NUMPARAMS = {"125m": ((512, 124131840), (65536, 174070272)), "350m": ((512, 354412544), (65536, 420997120)),
                 "760m": ((512, 758111232), (65536, 857988096)), "1b": ((512, 1312804864), (65536, 1445974016)),
                 "3b": ((512, 2647905280), (65536, 2814366720)), "7b": ((512, 6652567552), (65536, 6918905856)),
                 "13b": ((512, 12846090240), (32768, 13011240960)), "30b": ((512, 29964204032), (8192, 30019254272)),
                 "70b": ((2048, 64862437376), None)}

# Each line: model, SeqLen, # GPUs, MFU (%), Throughput (T/s/GPU), MicroBatchSize, GlobalBatchSize,
# Activation Checkpointing (T/F) -- the tables' columns, in the tables' row order.
FOUNDRY_ROWS = {"h100-sxm": """
70b 2048 64 42.57 1039 8 2048 T | 70b 2048 32 36.15 882 2 1024 T | 30b 8192 8 29.92 1384 1 168 T
30b 4096 8 35.86 1802 1 168 T | 30b 2048 32 43.92 2308 14 1344 T | 30b 2048 16 43.07 2263 10 480 T
30b 2048 8 38.11 2002 3 504 T | 30b 1024 8 38.76 2084 6 1008 T | 13b 32768 8 31.68 1976 1 24 T
13b 16384 8 35.55 2985 3 72 T | 13b 4096 8 41.6 4717 10 240 T | 13b 2048 64 39.86 4800 2 128 F
13b 2048 32 39.95 4811 2 64 F | 13b 2048 16 39.58 4767 2 32 F | 13b 2048 8 39.79 4792 2 16 F
13b 1024 8 44.27 5502 40 960 T | 7b 65536 8 28.59 1956 1 16 T | 7b 32768 8 30.94 3318 2 32 T
7b 8192 8 37.14 6935 8 128 T | 7b 4096 8 40.42 8611 16 256 T | 7b 2048 8 46.44 10643 6 48 F
7b 1024 8 42.83 10203 64 1024 T | 3b 65536 8 26.81 3262 1 16 T | 3b 32768 8 28.84 5873 3 144 T
3b 16384 8 36.34 11152 1 48 F | 3b 8192 8 40.31 16578 3 144 F | 3b 4096 8 42.31 20964 5 240 F
3b 2048 64 40.8 22525 6 1152 F | 3b 2048 32 41.7 23021 6 576 F | 3b 2048 16 43.73 24142 10 480 F
3b 1024 8 46.2 27046 20 960 F | 3b 512 8 46.32 27965 40 1920 F | 1b 65536 8 26.34 5506 1 16 T
1b 32768 8 33.54 12025 1 32 F | 1b 16384 8 35.22 19649 2 64 F | 1b 8192 8 37.73 29157 3 96 F
1b 4096 8 40.26 38535 7 224 F | 1b 2048 64 40.85 44402 20 1280 F | 1b 2048 32 41.52 45130 20 640 F
1b 2048 16 42.36 46037 20 320 F | 1b 2048 8 41.82 45455 14 112 F | 1b 1024 8 41.95 48910 18 576 F
1b 512 8 43.21 52275 56 1792 F | 760m 32768 8 31.84 16291 1 16 F | 760m 16384 8 33.57 27815 3 48 F
760m 8192 8 34.84 41825 6 96 F | 760m 4096 8 35.83 55459 12 192 F | 760m 2048 32 37.57 67971 24 768 F
760m 2048 16 37.89 68551 24 384 F | 760m 2048 8 34.9 63147 24 384 F | 760m 1024 8 39.76 78581 48 768 F
760m 512 8 40.42 83749 96 1536 F
""", "a100-80gb": """
70b 2048 64 53.33 410 8 2048 T | 70b 2048 32 48.56 373 2 1024 T | 30b 8192 8 39.38 574 1 168 T
30b 4096 8 51.37 814 1 168 T | 30b 2048 8 55.3 916 3 504 T | 30b 1024 8 55.82 946 6 1008 T
30b 512 8 56.4 967 12 2016 T | 13b 32768 8 51.69 1016 1 24 T | 13b 16384 8 54.07 1431 3 72 T
13b 8192 8 56.07 1795 5 120 T | 13b 4096 8 57.62 2060 10 240 T | 13b 2048 8 59.57 2262 2 48 F
13b 1024 8 59.48 2330 40 960 T | 7b 65536 8 46.97 1013 1 16 T | 7b 32768 8 49.46 1672 2 32 T
7b 16384 8 51.96 2453 4 64 T | 7b 8192 8 54.47 3206 8 128 T | 7b 4096 8 54.84 3684 16 256 T
7b 2048 8 64.23 4641 6 96 F | 7b 1024 8 58.01 4357 64 1024 T | 3b 65536 8 46.05 1767 1 16 T
3b 32768 8 47.18 3029 3 144 T | 3b 16384 8 57.13 5529 1 48 F | 3b 8192 8 59.34 7695 3 144 F
3b 4096 8 60.53 9457 5 240 F | 3b 2048 8 62.11 10811 10 160 F | 3b 1024 8 62.73 11580 20 960 F
3b 512 8 63.71 12127 40 1920 F | 1b 65536 8 46.18 3044 1 16 T | 1b 32768 8 55.52 6275 1 32 F
1b 16384 8 56.6 9956 2 64 F | 1b 8192 8 56.69 13814 3 96 F | 1b 4096 8 59.0 17807 7 224 F
1b 2048 8 59.86 20513 14 448 F | 1b 1024 8 60.15 22112 18 576 F | 1b 512 8 60.68 23148 56 1792 F
760m 65536 8 45.34 4143 1 16 T | 760m 32768 8 54.57 8802 1 16 F | 760m 16384 8 54.64 14274 3 48 F
760m 8192 8 55.31 20933 6 96 F | 760m 4096 8 56.05 27351 12 192 F | 760m 2048 8 56.85 32434 24 384 F
760m 1024 8 47.76 29765 48 768 F | 760m 512 8 45.07 29446 96 1536 F | 350m 65536 8 52.7 7524 1 16 F
350m 32768 8 52.46 13652 2 32 F | 350m 16384 8 53.28 23559 4 64 F | 350m 8192 8 53.8 36569 8 128 F
350m 4096 8 53.31 49555 16 256 F | 350m 2048 8 51.62 58782 32 512 F | 350m 1024 8 50.51 64813 64 1024 F
350m 512 8 50.61 69330 128 2048 F | 125m 65536 8 54.13 20368 1 16 F | 125m 32768 8 52.71 36407 2 32 F
125m 16384 8 50.61 60040 4 64 F | 125m 8192 8 48.85 90392 8 128 F | 125m 4096 8 46.08 118396 16 256 F
125m 2048 8 44.79 142830 40 640 F | 125m 2048 8 44.45 141737 32 512 F | 125m 1024 8 43.15 156468 64 1024 F
125m 512 8 42.56 165681 128 2048 F
""", "a100-40gb": """
70b 2048 128 48.91 376 4 512 T | 70b 2048 64 35.87 276 2 128 T | 30b 2048 128 52.25 865 6 768 T
30b 2048 32 51.74 857 4 128 T | 13b 8192 8 43.95 1407 1 128 T | 13b 4096 8 44.85 1603 2 256 T
13b 2048 128 51.93 1972 16 2048 T | 13b 2048 64 52.04 1976 16 1024 T | 13b 2048 32 52.62 1998 14 448 T
13b 2048 16 52.5 1993 10 160 T | 13b 2048 8 43.94 1668 4 512 T | 13b 1024 8 44.07 1727 8 1024 T
13b 512 8 44.28 1763 16 2048 T | 7b 16384 8 47.65 2249 1 32 T | 7b 8192 8 49.04 2887 3 96 T
7b 4096 8 50.11 3366 6 192 T | 7b 2048 128 50.14 3623 18 2304 T | 7b 2048 64 50.73 3665 18 1152 T
7b 2048 32 51.55 3725 18 576 T | 7b 2048 16 50.44 3645 16 256 T | 7b 2048 8 50.92 3679 12 384 T
7b 1024 8 51.31 3854 24 768 T | 7b 512 8 50.85 3895 48 1536 T | 3b 32768 8 46.03 2955 1 32 T
3b 16384 8 46.14 4465 2 128 T | 3b 8192 8 55.13 7149 1 64 F | 3b 4096 8 56.18 8777 2 128 F
3b 2048 128 54.8 9538 6 768 F | 3b 2048 64 55.94 9736 6 384 F | 3b 2048 32 56.96 9914 6 192 F
3b 2048 16 56.02 9750 5 80 F | 3b 2048 8 57.82 10065 5 320 F | 3b 1024 8 58.14 10731 10 640 F
3b 512 8 59.49 11324 20 1280 F | 1b 32768 8 45.07 5095 1 32 T | 1b 16384 8 55.23 9715 1 64 F
1b 8192 8 55.29 13474 2 128 F | 1b 4096 8 55.85 16856 4 256 F | 1b 2048 128 54.41 18647 10 1280 F
1b 2048 64 55.44 19001 10 640 F | 1b 2048 32 45.39 15555 10 320 F | 1b 2048 16 55.69 19085 8 128 F
1b 2048 8 56.23 19271 8 512 F | 1b 1024 8 57.02 20959 16 1024 F | 1b 512 8 57.1 21782 32 2048 F
760m 32768 8 44.53 7183 1 32 T | 760m 16384 8 53.26 13914 1 32 F | 760m 8192 8 53.12 20106 3 96 F
760m 4096 8 53.0 25863 6 192 F | 760m 2048 128 50.73 28940 12 1536 F | 760m 2048 64 51.44 29344 12 768 F
760m 2048 32 51.97 29648 12 384 F | 760m 2048 16 51.9 29607 12 192 F | 760m 2048 8 52.89 30173 12 384 F
760m 1024 8 53.63 33422 24 768 F | 760m 512 8 53.47 34938 48 1536 F | 350m 32768 8 51.55 13416 1 32 F
350m 16384 8 51.78 22896 2 64 F | 350m 8192 8 51.39 34933 4 128 F | 350m 4096 8 50.38 46833 8 256 F
350m 2048 128 45.61 51934 18 2304 F | 350m 2048 64 46.27 52689 18 1152 F | 350m 2048 32 47.26 53811 18 576 F
350m 2048 16 48.66 55413 18 288 F | 350m 2048 8 49.17 55995 16 512 F | 350m 1024 8 48.73 62523 32 1024 F
350m 512 8 48.39 66284 64 2048 F | 125m 32768 8 47.27 32651 1 32 F | 125m 16384 8 46.77 55484 2 48 F
125m 8192 8 46.94 86858 5 120 F | 125m 4096 8 44.82 115162 13 312 F | 125m 2048 128 38.86 123936 26 3328 F
125m 2048 64 39.27 125234 26 1664 F | 125m 2048 32 39.86 127122 26 832 F | 125m 2048 16 40.93 130535 26 416 F
125m 2048 8 42.75 136334 26 624 F | 125m 1024 8 40.89 148289 52 1248 F | 125m 512 8 40.26 156735 104 2496 F
"""}

TITAN_A100 = ("pytorch/torchtitan docs/performance.md (read at commit 041336434916bdc0f88c1f89fda176fd3c2092e4), "
              "'Llama 3 performance numbers': FSDP2 on 64 A100 80GB, local batch 1; sequence 8192 (the same page: "
              "Llama 2's default 4096 'is halved compared with Llama 3')")
TITAN_H100 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (read at commit "
              "31a17bfdb70bab6f62a13d21816a5339b911d6e3): Llama 3.1 8B, bf16 (no Float8), selective AC, local batch "
              "2; H100 96GB HBM2e at a 500 W power limit ('peak TFLOPs between SXM and NVL'); sequence 8192 as the "
              "A100 page")
# (label, source, citation row, preset, hardware, GPUs, micro-batch, AC, published MFU % or None, tokens/s/GPU)
TITAN_ROWS = [
    ("torchtitan llama3-8b a100 selective-layer", TITAN_A100, "Llama 3 table, row '8B | 1 | selective layer'",
     "llama-8b", "a100-80gb", 64, 1, "selective", 56.8, 2904),
    ("torchtitan llama3-8b a100 selective-op", TITAN_A100, "Llama 3 table, row '8B | 1 | selective op'",
     "llama-8b", "a100-80gb", 64, 1, "selective", 58.2, 2973),
    ("torchtitan llama3-70b a100 full-ac", TITAN_A100, "Llama 3 table, row '70B | 1 | full'",
     "llama-70b", "a100-80gb", 64, 1, "full", 51.7, 331),
    ("torchtitan llama3.1-8b h100x8 fsdp", TITAN_H100, "Table 1, row 'FSDP'", "llama-8b", "h100-sxm", 8, 2,
     "selective", None, 5762),
    ("torchtitan llama3.1-8b h100x8 fsdp+compile", TITAN_H100, "Table 1, row 'FSDP + torch.compile'", "llama-8b",
     "h100-sxm", 8, 2, "selective", None, 6667),
    ("torchtitan llama3.1-8b h100x128 fsdp", TITAN_H100, "Table 3, row 'FSDP'", "llama-8b", "h100-sxm", 128, 2,
     "selective", None, 5605),
    ("torchtitan llama3.1-8b h100x128 fsdp+compile", TITAN_H100, "Table 3, row 'FSDP + torch.compile'", "llama-8b",
     "h100-sxm", 128, 2, "selective", None, 6514),
]
TITAN_SEQ = 8192

# Device kinds that share a fit: H100 SXM / PCIe and H200 have the same tensor cores, A100 40 / 80 GB too.
FAMILIES = {"hopper": ("h100-sxm", ["h100-sxm"]), "ampere": ("a100-80gb", ["a100-80gb"])}


def mpt_shape(size: str) -> tuple[int, int]:
    """(d_model, n_layers) of an MPT size from two of the tables' (seq, NumParams) points."""
    (t0, n0), other = MPT_NUMPARAMS[size]
    if other is None:  # 70b: one sequence only; d_model 8192 (mpt-70b.yaml), checked through n_layers below
        d = 8192
    else:
        d = (other[1] - n0) // (other[0] - t0)
    layers = (n0 - (MPT_VOCAB + t0) * d) / (12 * d * d)
    assert abs(layers - round(layers)) < 0.05, (size, layers)  # norms and biases: the rest
    return d, round(layers)


def mpt_config(size: str, seq: int) -> ModelConfig:
    d, layers = mpt_shape(size)
    # scaletrain's block with the same matmul weights: SwiGLU's 3 d h = MPT's 8 d^2 (h = 8d/3, rounded)
    return build(ModelConfig, {"dim": d, "n_layers": layers, "n_heads": d // 128, "ffn_hidden_dim": round(8 * d / 3),
                               "vocab_size": MPT_VOCAB, "tie_embeddings": True, "max_seq_len": seq}, presets=PRESETS)


def rows() -> list[dict]:
    out = []
    for hw_name, text in FOUNDRY_ROWS.items():
        for i, cells in enumerate(c.split() for c in text.replace("\n", " | ").split("|") if c.strip()):
            size, seq, gpus, mfu, tps, mb, gbs, ac = cells
            if hw_name == "a100-40gb":
                group = "held-out: A100 40GB runs"
            elif ac == "T":
                group = "held-out: activation checkpointing"
            elif int(gpus) > 8:
                group = "held-out: multi-node"
            else:
                group = "fit"
            out.append({"label": f"mpt-{size} {hw_name} T={seq} x{gpus} mb{mb}{' ac' if ac == 'T' else ''}",
                        "source": FOUNDRY, "citation": f"{FOUNDRY_TABLES[hw_name]}, row {i + 1}",
                        "model": f"mpt-{size}", "cfg": mpt_config(size, int(seq)), "hardware": hw_name,
                        "seq": int(seq), "gpus": int(gpus), "micro_batch": int(mb), "global_batch": int(gbs),
                        "ac": "full" if ac == "T" else "none", "published_mfu": float(mfu) / 100,
                        "published_tokens_per_s_per_gpu": float(tps),
                        "set": group})
    for label, source, citation, preset, hw_name, gpus, mb, ac, mfu, tps in TITAN_ROWS:
        cfg = build(ModelConfig, {"preset": preset}, presets=PRESETS)
        out.append({"label": label, "source": source, "citation": citation, "model": preset, "cfg": cfg,
                    "hardware": hw_name, "seq": TITAN_SEQ, "gpus": gpus, "micro_batch": mb, "global_batch": mb * gpus,
                    "ac": ac, "published_mfu": None if mfu is None else mfu / 100,
                    "published_tokens_per_s_per_gpu": float(tps), "set": "held-out: torchtitan"})
    return out


def check_transcription(data: list[dict]) -> float:
    """Each llm-foundry row's MFU recomputed from its tokens/s with the README's own formula (6 x NumParams +
    attention 12 L d T per token, over 989 / 312 TFLOP/s): agrees with the published MFU column within 1% on
    every row, which checks the transcription of both columns and the derived shapes. Returns the worst gap."""
    worst = 0.0
    for r in data:
        if not r["model"].startswith("mpt-"):
            continue
        size = r["model"][4:]
        d, layers = mpt_shape(size)
        (t0, n0), _ = MPT_NUMPARAMS[size]
        numparams = n0 + (r["seq"] - t0) * d  # the position table grows with the sequence
        peak = 989e12 if r["hardware"].startswith("h100") else 312e12
        mfu = (6 * numparams + 12 * layers * d * r["seq"]) * r["published_tokens_per_s_per_gpu"] / peak
        gap = mfu / r["published_mfu"] - 1
        assert abs(gap) <= 0.01, (r["label"], r["citation"], gap)
        worst = max(worst, abs(gap))
    return worst


def predict(row: dict, hw: Hardware) -> float:
    """The planner's tokens/s per GPU for the published run: FSDP (ZeRO-3) over all GPUs, bf16."""
    gpus = row["gpus"]
    cluster = Cluster(hw, min(gpus, hw.devices_per_node), max(1, gpus // hw.devices_per_node))
    workload = Workload(row["cfg"], row["seq"], row["global_batch"], 1e9, "bf16")
    plan = Plan(dp_shard=gpus, zero_stage=3, micro_batch=row["micro_batch"], activation_checkpointing=row["ac"])
    return step_time(workload, plan, cluster).tokens_per_second / gpus


def family_hw(name: str, params) -> Hardware:
    ceiling, half_width, attention = params
    return replace(CATALOG[name], utilisation=ceiling, utilisation_half_width=half_width,
                   attention_utilisation=attention)


def fit(data: list[dict], family: str) -> tuple[float, float, float]:
    from scipy.optimize import least_squares

    kind, members = FAMILIES[family]
    fit_rows = [r for r in data if r["set"] == "fit" and r["hardware"] in members]

    def residuals(p):
        hw = family_hw(kind, p)
        return [math.log(predict(r, hw) / r["published_tokens_per_s_per_gpu"]) for r in fit_rows]

    result = least_squares(residuals, [0.5, 500.0, 1.0], bounds=([0.1, 0.0, 0.2], [1.0, 8192.0, 3.0]))
    return tuple(float(x) for x in result.x)


def family_of(hw_name: str) -> str:
    return "hopper" if hw_name.startswith(("h100", "h200")) else "ampere"


def summary(records: list[dict], key: str) -> dict:
    errors = [r[key] for r in records]
    return {"rows": len(errors), "median_abs_error": statistics.median(abs(e) for e in errors),
            "mean_error": statistics.fmean(errors), "worst_error": max(errors, key=abs),
            "within_10_percent": sum(abs(e) <= 0.10 for e in errors) / len(errors)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_out("gpu_utilisation.json"),
                        help=OUT_HELP.format(name="gpu_utilisation.json"))
    args = parser.parse_args()
    data = rows()
    transcription_gap = check_transcription(data)
    fitted = {family: fit(data, family) for family in FAMILIES}
    records = []
    for r in data:
        hw_before = CONSTANT_BEFORE[r["hardware"]]
        hw_after = CATALOG[r["hardware"]]  # the planner as shipped: the catalog's (rounded) copy of the fit
        before, after = predict(r, hw_before), predict(r, hw_after)
        published = r["published_tokens_per_s_per_gpu"]
        peak = CATALOG[r["hardware"]].flops("bf16")
        records.append({
            "label": r["label"], "set": r["set"], "source": r["source"], "citation": r["citation"],
            "model": r["model"], "dim": r["cfg"].dim, "n_layers": r["cfg"].n_layers, "hardware": r["hardware"],
            "gpus": r["gpus"], "seq": r["seq"], "micro_batch": r["micro_batch"], "global_batch": r["global_batch"],
            "activation_checkpointing": r["ac"], "published_mfu": r["published_mfu"],
            "published_tokens_per_s_per_gpu": published,
            "mfu_ours": published * flops_per_token(r["cfg"], r["seq"]) / peak,
            "utilisation_after": gpu_utilisation(hw_after, r["cfg"], r["seq"]),  # the catalog's
            "predicted_tokens_per_s_per_gpu_before": before, "predicted_tokens_per_s_per_gpu_after": after,
            # step-time error: predicted step / real step - 1 = published tokens/s / predicted - 1
            "time_error_before": published / before - 1, "time_error_after": published / after - 1})
    sets = sorted({r["set"] for r in records})
    report = {"model": "utilisation = ceiling * dim / (dim + half_width) for GEMMs, ceiling * attention for "
                       "QK^T / AV, mixed harmonically by their FLOP shares (Hardware.utilisation_at)",
              "before": {k: {"utilisation": v.utilisation, "source": v.utilisation_source}
                         for k, v in CONSTANT_BEFORE.items()},
              "fitted": {family: {"fitted_on": FAMILIES[family][1], "ceiling": p[0], "half_width": p[1],
                                  "attention": p[2]} for family, p in fitted.items()},
              "after": "the catalog's copy of the fit (scaletrain/plan/hardware.py), i.e. what `scaletrain plan` uses",
              "errors": {s: {"before": summary([r for r in records if r["set"] == s], "time_error_before"),
                             "after": summary([r for r in records if r["set"] == s], "time_error_after")}
                         for s in sets},
              "transcription_check": {"worst_gap": transcription_gap, "what": " ".join(
                  check_transcription.__doc__.split("Returns")[0].split())},
              "rows": records}
    for s in sets:
        b, a = report["errors"][s]["before"], report["errors"][s]["after"]
        print(f"{s:38s} {b['rows']:3d} rows  median |err| {b['median_abs_error']:6.1%} -> {a['median_abs_error']:6.1%}"
              f"  mean {b['mean_error']:+6.1%} -> {a['mean_error']:+6.1%}  worst {b['worst_error']:+6.1%} -> "
              f"{a['worst_error']:+6.1%}")
    for family, p in fitted.items():
        hw = CATALOG[FAMILIES[family][0]]
        shipped = (hw.utilisation, hw.utilisation_half_width, hw.attention_utilisation)
        print(f"{family}: ceiling {p[0]:.3f}, half_width {p[1]:.0f}, attention {p[2]:.3f}; catalog {shipped}")
        if any(abs(a / b - 1) > 0.01 for a, b in zip(shipped, p)):
            print(f"  the catalog's {FAMILIES[family][0]} differs from this fit by more than 1%: copy the fit into "
                  "scaletrain/plan/hardware.py (_HOPPER_FIT / _AMPERE_FIT)")
    write_result(args.out, report, indent=2)
    print(f"wrote {args.out}")
    return 0


# The catalog's constants before this fit (0.40 Hopper, 0.50 Ampere), for the "before" column.
CONSTANT_BEFORE = {name: replace(CATALOG[name], utilisation=0.40 if name.startswith("h1") else 0.50,
                                 utilisation_half_width=0.0, attention_utilisation=1.0,
                                 utilisation_source="the constant before the fit")
                   for name in ("h100-sxm", "a100-80gb", "a100-40gb")}

if __name__ == "__main__":
    sys.exit(main())
