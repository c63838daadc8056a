"""``scaling_fit.json`` beside the prepared data: the fit, its intervals, the runs used, the data fingerprint.

A fit belongs to the data it was made on. The fingerprint is a digest of what the manifest lists by content
(the tokenizer file's sha256, each shard's sha256, the vocabulary size), not of paths or dates: a copied folder
keeps its fit, a folder prepared again from other text or with another tokenizer does not, and a fit that does
not match is refused (``load_fit``) instead of predicting for data it never saw.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from scaletrain.data.shards import read_manifest
from scaletrain.files import write_file
from scaletrain.scaling.fit import ScalingFit, ScalingFitError

FIT_FILE = "scaling_fit.json"
FORMAT = "scaletrain.scaling_fit"


def data_fingerprint(data_dir: str | Path) -> str:
    """Content digest of a prepared data folder (tokenizer + shards, from its manifest's checksums)."""
    manifest = read_manifest(data_dir, verify=False)
    parts = [str(manifest.get("vocab_size")), str((manifest.get("tokenizer") or {}).get("sha256"))]
    for split in sorted(manifest.get("splits", {})):
        parts += [f"{split}:{s['sha256']}" for s in manifest["splits"][split]["shards"]]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def fit_path(data_dir: str | Path) -> Path:
    return Path(data_dir) / FIT_FILE


def write_fit(data_dir: str | Path, fit: ScalingFit, runs: list[dict], recipe: dict) -> Path:
    """Write ``scaling_fit.json`` into the data folder (atomically: a temporary file renamed into place)."""
    path = fit_path(data_dir)
    doc = {"format": FORMAT, "data_fingerprint": data_fingerprint(data_dir), "created": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "N": "non-embedding parameters", "D": "training tokens",
        "loss": "val_bpb (bits per byte, held-out split)", **fit.as_dict(), "runs": runs, "recipe": recipe}
    return write_file(path, json.dumps(doc, indent=1), f"the scaling fit {path}")


def load_fit(data_dir: str | Path) -> tuple[ScalingFit, dict]:
    """(fit, the whole document) of a data folder; ScalingFitError when there is none, it is unreadable, or it
    was fitted on other data (its fingerprint differs from the folder's)."""
    path = fit_path(data_dir)
    if not path.is_file():
        raise ScalingFitError(f"{path}: no scaling fit for this data; run `scaletrain scale {data_dir} --out DIR "
                              f"--budget 30min` first")
    try:
        doc = json.loads(path.read_text())
        fit = ScalingFit.from_dict(doc)
    except (ValueError, KeyError, TypeError) as exc:
        raise ScalingFitError(f"{path}: not a readable scaling fit ({exc}); run `scaletrain scale` again") from None
    have = data_fingerprint(data_dir)
    if doc.get("data_fingerprint") != have:
        raise ScalingFitError(f"{path} was fitted on other data (fingerprint {doc.get('data_fingerprint')}, this "
                              f"folder's is {have}): a fit does not transfer across data or tokenizers; run "
                              f"`scaletrain scale {data_dir}` again")
    return fit, doc
