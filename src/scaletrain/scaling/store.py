"""``scaling_fit.json`` beside the prepared data: the fit, its intervals, the runs used, the data fingerprint.

A fit belongs to the data it was made on. The fingerprint is a digest of what the manifest lists by content
(the tokenizer file's sha256, each shard's sha256, the vocabulary size), not of paths or dates: a copied folder
keeps its fit, a folder prepared again from other text or with another tokenizer does not, and a fit that does
not match is refused (``load_fit``) instead of predicting for data it never saw.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from scaletrain.core.files import write_file
from scaletrain.data.shards import read_manifest
from scaletrain.scaling.family import DENSE, family_name, shape_of
from scaletrain.scaling.fit import PARAMS, ScalingFit, ScalingFitError

FIT_FILE = "scaling_fit.json"
FORMAT = "scaletrain.scaling_fit"


def data_fingerprint(data_dir: str | Path) -> str:
    """Content digest of a prepared data folder (tokenizer + shards, from its manifest's checksums)."""
    manifest = read_manifest(data_dir, verify=False)
    parts = [str(manifest.get("vocab_size")), str((manifest.get("tokenizer") or {}).get("sha256"))]
    for split in sorted(manifest.get("splits", {})):
        parts += [f"{split}:{s['sha256']}" for s in manifest["splits"][split]["shards"]]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def fit_path(data_dir: str | Path, family: str = DENSE) -> Path:
    """``scaling_fit.json`` for the dense family, ``scaling_fit.moe8x2.json`` for a mixture of experts'
    (scaling/family.py: a law is one family's)."""
    return Path(data_dir) / (FIT_FILE if family == DENSE else f"scaling_fit.{family}.json")


def fitted_families(data_dir: str | Path) -> list[str]:
    """The families with a fit file in ``data_dir`` (dense first), by file name; their content is ``load_fit``'s."""
    keys = [DENSE] if fit_path(data_dir).is_file() else []
    moe = Path(data_dir).glob("scaling_fit.moe*.json")
    return keys + sorted(p.name[len("scaling_fit."):-len(".json")] for p in moe)


def write_fit(data_dir: str | Path, fit: ScalingFit, runs: list[dict], recipe: dict, family: str = DENSE) -> Path:
    """Write the family's fit into the data folder (atomically: a temporary file renamed into place)."""
    path = fit_path(data_dir, family)
    doc = {"format": FORMAT, "family": family, "data_fingerprint": data_fingerprint(data_dir), "created": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "N": "non-embedding parameters", "D": "training tokens",
        "loss": "val_bpb (bits per byte, held-out split)", **fit.as_dict(fitted_flops(runs)), "runs": runs,
        "recipe": recipe}
    return write_file(path, json.dumps(doc, indent=1), f"the scaling fit {path}")


def load_fit(data_dir: str | Path, family: str = DENSE) -> tuple[ScalingFit, dict]:
    """(fit, the whole document) of a data folder's ``family``; ScalingFitError when there is none, it is
    unreadable, it holds a value no fit has (``check_fit_doc``), or it was fitted on other data (its fingerprint
    differs from the folder's)."""
    path = fit_path(data_dir, family)
    if not path.is_file():
        shape = shape_of(family)
        moe = f" --moe {shape.spec}" if shape else ""
        what = "" if shape is None else f" of {family_name(family)} ({shape.describe()}: a law is one family's)"
        raise ScalingFitError(f"{path}: no scaling fit{what} for this data; run `scaletrain scale {data_dir} --out "
                              f"DIR --budget 30min{moe}` first")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ScalingFitError(f"{path}: not a readable scaling fit ({exc}); run `scaletrain scale` again") from None
    check_fit_doc(doc, path, data_dir)
    if isinstance(doc.get("family", DENSE), str) and doc.get("family", DENSE) != family:  # a renamed or copied file
        raise ScalingFitError(f"{path} holds the fit of {family_name(doc['family'])}, not of {family_name(family)}; "
                              f"put it back under its own name ({fit_path(data_dir, doc['family']).name})")
    fit = ScalingFit.from_dict(doc)
    have = data_fingerprint(data_dir)
    if doc.get("data_fingerprint") != have:
        raise ScalingFitError(f"{path} was fitted on other data (fingerprint {doc.get('data_fingerprint')}, this "
                              f"folder's is {have}): a fit does not transfer across data or tokenizers; run "
                              f"`scaletrain scale {data_dir}` again")
    return fit, doc


def fitted_flops(runs: list[dict]) -> float | None:
    """The compute (6 N D) of a fit's largest run, where its compute-optimal split is judged; None when the runs
    do not record it."""
    flops = [r["flops"] for r in runs if isinstance(r, dict) and isinstance(r.get("flops"), (int, float))]
    return max(flops) if flops else None


def check_fit_doc(doc: object, path: Path, data_dir: str | Path) -> None:
    """ScalingFitError naming the file and the field when ``scaling_fit.json`` holds what no fit can (an edited or
    damaged file): E, A, B >= 0 (A, B > 0) and finite exponents, in the fit and in every bootstrap replicate; a
    non-negative scatter; runs with positive sizes; a recipe of positive integers. A fit is only ever
    predicted from after this (a negative E with no replicates printed a zero-width, certain-looking interval)."""
    again = f"run `scaletrain scale {data_dir} --out GRID --fit-only` to write it again"

    def number(value: object, where: str, rule: str) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
            rule == "finite" or (value >= 0 if rule == ">= 0" else value > 0))
        if not ok:
            raise ScalingFitError(f"{path}: {where} must be a finite number{'' if rule == 'finite' else ' ' + rule}"
                                  f" (got {value!r}); {again}")

    def law(params: object, where: str) -> None:
        if not isinstance(params, dict) or set(params) != set(PARAMS):
            raise ScalingFitError(f"{path}: {where} must hold exactly {', '.join(PARAMS)} (got {params!r}); {again}")
        for key, rule in (("E", ">= 0"), ("A", "> 0"), ("alpha", "finite"), ("B", "> 0"), ("beta", "finite")):
            number(params[key], f"{where}.{key}", rule)

    if not isinstance(doc, dict):
        raise ScalingFitError(f"{path}: not a scaling fit (a JSON object expected); {again}")
    law(doc.get("params"), "params")
    bootstrap = doc.get("bootstrap", [])
    if not isinstance(bootstrap, list):
        raise ScalingFitError(f"{path}: bootstrap must be a list of fits (got {bootstrap!r}); {again}")
    for i, replica in enumerate(bootstrap):
        law(replica, f"bootstrap[{i}]")
    for key in ("residual_std_log", "huber"):
        if key in doc:
            number(doc[key], key, ">= 0")
    runs = doc.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise ScalingFitError(f"{path}: runs must be a list of run records; {again}")
    for i, run in enumerate(runs):
        number(run.get("params"), f"runs[{i}].params", "> 0")
        if "flops" in run:
            number(run["flops"], f"runs[{i}].flops", "> 0")
    recipe = doc.get("recipe", {})
    if not isinstance(recipe, dict):
        raise ScalingFitError(f"{path}: recipe must be a table (got {recipe!r}); {again}")
    for key in ("seq_len", "batch"):
        if key in recipe and (not isinstance(recipe[key], int) or isinstance(recipe[key], bool) or recipe[key] < 1):
            raise ScalingFitError(f"{path}: recipe.{key} must be a positive integer (got {recipe[key]!r}); {again}")
