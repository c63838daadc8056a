"""``scaletrain report``: run folders read back (runs.py) and drawn into one self-contained HTML page (html.py)."""
