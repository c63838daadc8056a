"""Open a `scaletrain report` page in headless Chromium with the network cut off; check that every plot was
drawn and that the console logged no error; optionally save a screenshot.

    python scripts/report_in_browser.py report.html [more.html ...] [--screenshot docs/report.png] [--json out.json]

The screenshot is of the last page.

Needs a Chromium binary (Debian: ``apt-get install chromium``, or $CHROMIUM). Prints one JSON document;
exit status 1 when a plot is not drawn or the console shows an error, 2 when there is no browser.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PLOT_DIV = re.compile(r'<div id="(plot-[a-z-]+)" class="([^"]*)"')


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _chromium(binary: str, page: Path, extra: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        # No network at all: every host resolves to nothing, so a fetch would fail and be logged.
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr",
               "--v=0", "--virtual-time-budget=15000", *extra, page.resolve().as_uri()]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def check(page: Path, expected: list[str] | None = None, screenshot: Path | None = None,
          width: int = 1400, height: int = 4200) -> dict:
    """{"plots": {id: drawn}, "console_errors": [...], "ok": bool}."""
    binary = find_chromium()
    if binary is None:
        raise FileNotFoundError("no chromium binary (apt-get install chromium, or set $CHROMIUM)")
    dom = _chromium(binary, page, ["--dump-dom"])
    # Plotly.newPlot adds the class js-plotly-plot to a div once it has drawn into it.
    plots = {div: "js-plotly-plot" in cls for div, cls in PLOT_DIV.findall(dom.stdout)}
    for div in expected or []:
        plots.setdefault(div, False)
    logs = dom.stderr
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        shot = _chromium(binary, page, [f"--window-size={width},{height}", f"--screenshot={screenshot.resolve()}"])
        logs += shot.stderr
    # Chromium logs every console message as "INFO:CONSOLE:<line>" whatever its level, so any console output
    # counts (the report writes none; plotly writes only warnings and errors); page errors read "Uncaught".
    errors = [line for line in logs.splitlines()
              if "CONSOLE" in line or "Uncaught" in line or "ERR_NAME_NOT_RESOLVED" in line]
    svgs = dom.stdout.count('class="main-svg"')
    return {"page": str(page), "plots": plots, "drawn": sum(plots.values()), "main_svgs": svgs,
            "console_errors": errors, "ok": bool(plots) and all(plots.values()) and not errors,
            "screenshot": str(screenshot) if screenshot else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="+")
    parser.add_argument("--screenshot", default="")
    parser.add_argument("--json", default="")
    parser.add_argument("--height", type=int, default=4200)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from scaletrain.report.html import PLOT_IDS

    results = []
    try:
        for i, page in enumerate(args.pages):
            shot = Path(args.screenshot) if args.screenshot and i == len(args.pages) - 1 else None
            results.append(check(Path(page), PLOT_IDS, shot, height=args.height))
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = {"browser": subprocess.run([find_chromium(), "--version"], capture_output=True, text=True).stdout.strip(),
              "plots_expected": len(PLOT_IDS), "pages_checked": len(results),
              "console_messages": sum(len(r["console_errors"]) for r in results), "pages": results,
              "ok": all(r["ok"] for r in results)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
