"""Cleaning (stage 2): normalise the text and remove Project Gutenberg boilerplate.

Normalisation: BOM removed, CRLF/CR -> LF, Unicode NFC, control characters other than newline/tab
removed. Gutenberg: the header up to the ``*** START OF ... ***`` marker (or the old ``*END*THE SMALL
PRINT`` line), transcriber credit paragraphs right after it, and everything from the first footer marker
on (``*** END OF ...``, ``End of (the) Project Gutenberg ...``, ``END OF THE PROJECT GUTENBERG``, a
SMALL PRINT block, ``This file should be named``). Header and footer are found independently, so a file
with only one of them is still cleaned, and a file with no marker is left as it is.

All functions are pure (text in, text + counters out) so they run in worker processes.
"""

from __future__ import annotations

import re
import unicodedata

from scaletrain.data.prepare_config import CleanConfig

# A header ends at the last of these in the first half of the file.
_HEADER_END = re.compile(
    r"^[ \t]*\*{3,}[ \t]*START[ \t]+OF[ \t]+(?:THE|THIS)[ \t]+PROJECT[ \t]+GUTENBERG[^\n]*$"
    r"|^[ \t]*\*{3,}[ \t]*START[ \t]+OF[ \t]+THE[ \t]+COPYRIGHTED[ \t]+PROJECT[ \t]+GUTENBERG[^\n]*$"
    r"|^[ \t]*\*?END\*?[ \t]*THE[ \t]+SMALL[ \t]+PRINT[^\n]*$",
    re.IGNORECASE | re.MULTILINE)
# The footer starts at the first of these after the header.
_FOOTER_START = re.compile(
    r"^[ \t]*\*{3,}[ \t]*END[ \t]+OF[ \t]+(?:THE[ \t]+|THIS[ \t]+)?PROJECT[ \t]+GUTENBERG[^\n]*$"
    r"|^[ \t]*End[ \t]+of[ \t]+(?:the[ \t]+|this[ \t]+)?Project[ \t]+Gutenberg[^\n]*$"
    r"|^[ \t]*\**[ \t]*START\**[ \t]*THE[ \t]+SMALL[ \t]+PRINT[^\n]*$"
    r"|^[ \t]*\*+[ \t]*This[ \t]+file[ \t]+should[ \t]+be[ \t]+named[^\n]*$",
    re.IGNORECASE | re.MULTILINE)
# Paragraphs right after the header that are credits, not the work: "Produced by ...", the etext's
# own title block, transcriber notes (they mention the etext, a URL or an e-mail address).
_CREDIT = re.compile(
    r"^(?:produced[ \t]+by|this[ \t]+e-?text[ \t]+was[ \t]+(?:produced|prepared|created)|e-?text[ \t]+"
    r"(?:prepared|scanned)[ \t]+by|transcribed[ \t]+(?:from|by)|prepared[ \t]+by|scanned[ \t]+by"
    r"|updated[ \t]+editions|character[ \t]+set[ \t]+encoding|\*+[ \t]*$)"
    r"|project[ \t]+gutenberg|\be-?texts?\b|\be-?books?\b|www\.|www:|https?://|@[\w-]+\.\w", re.IGNORECASE)
_PG = re.compile(r"project[ \t]+gutenberg", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # keeps \t and \n (CR is gone by then)
_C1 = re.compile(r"[\x80-\x9f]")


def _cp1252_char(code: int) -> str:
    try:
        return bytes([code]).decode("cp1252")
    except UnicodeDecodeError:
        return ""  # 0x81, 0x8d, 0x8f, 0x90, 0x9d have no cp1252 meaning: drop them


# U+0080..U+009F in real text are almost always Windows-1252 bytes decoded as Latin-1 somewhere upstream
# (0x91 -> U+0091 instead of a left quote); map them back instead of deleting the punctuation.
_C1_TO_CP1252 = {code: _cp1252_char(code) for code in range(0x80, 0xA0)}
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_NEWLINES = re.compile(r"\n*")
CREDIT_SCAN_LINES = 60   # credits sit in the first lines after the START marker
FOOTER_LOOKBACK_LINES = 4  # "The Project Gutenberg Etext of X / by Y" just above the footer marker


def normalize(text: str, cfg: CleanConfig, counts: dict[str, int]) -> str:
    """BOM, line endings, NFC, control characters; ``counts`` gets what was changed."""
    if "\ufeff" in text:
        counts["bom_removed"] = counts.get("bom_removed", 0) + 1
        text = text.replace("\ufeff", "")  # a BOM mid-text (concatenated files) is junk too
    if "\r" in text:
        counts["crlf_normalized"] = counts.get("crlf_normalized", 0) + 1
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cfg.unicode_nfc and not text.isascii() and not unicodedata.is_normalized("NFC", text):
        counts["nfc_normalized"] = counts.get("nfc_normalized", 0) + 1
        text = unicodedata.normalize("NFC", text)
    if cfg.control_chars:
        if not text.isascii():
            text, n = _C1.subn(lambda m: _C1_TO_CP1252[ord(m.group())], text)
            if n:
                counts["cp1252_c1_chars_mapped"] = counts.get("cp1252_c1_chars_mapped", 0) + n
        text, n = _CONTROL.subn("", text)
        if n:
            counts["control_chars_removed"] = counts.get("control_chars_removed", 0) + n
    if cfg.strip_trailing_spaces:
        text = _TRAILING_SPACE.sub("", text)
    return text


def strip_gutenberg(text: str) -> tuple[str, bool, bool]:
    """Remove Project Gutenberg header/footer boilerplate. Returns (text, header_found, footer_found)."""
    start = 0
    half = len(text) // 2
    header = None
    for m in _HEADER_END.finditer(text, 0, max(half, 1)):
        header = m  # the last marker in the first half: an old SMALL PRINT block precedes a START line
    if header is not None:
        start = header.end()
        start = _skip_credits(text, start)
    footer = _FOOTER_START.search(text, max(start, half if header is None else start))
    if footer is None and header is None:
        return text, False, False
    end = len(text)
    if footer is not None:
        end = _footer_lookback(text, start, footer.start())
    body = text[start:end]
    return body.lstrip("\n").rstrip(), header is not None, footer is not None


def _skip_credits(text: str, pos: int) -> int:
    """Skip blank lines and credit paragraphs ("Produced by ...", "The Project Gutenberg Etext of ...",
    a lone "***") that follow the START marker."""
    lines_seen = 0
    while lines_seen < CREDIT_SCAN_LINES:
        m = _NEWLINES.match(text, pos)
        para_start = m.end()
        para_end = text.find("\n\n", para_start)
        para_end = len(text) if para_end < 0 else para_end
        para = text[para_start:para_end]
        if not para or not _CREDIT.search(para.lstrip()) or para.count("\n") > 8:
            return pos
        lines_seen += para.count("\n") + 2
        pos = para_end
    return pos


def _footer_lookback(text: str, start: int, end: int) -> int:
    """Move the cut up over a "The Project Gutenberg Etext of ..." line just above the footer marker
    (old files put the title line there, then the marker); at most a few non-blank lines."""
    cut, pos, seen = end, end, 0  # pos: start of the line below the one looked at
    while pos > start and seen < FOOTER_LOOKBACK_LINES:
        line_start = max(text.rfind("\n", start, pos - 1) + 1, start)
        line = text[line_start:pos - 1]
        if line.strip():
            seen += 1
            if _PG.search(line):
                cut = line_start
        pos = line_start
    return cut


def _may_have_boilerplate(text: str) -> bool:
    # plain substring tests run at memory speed; a case-insensitive regex over a whole book does not
    return any(s in text for s in ("Gutenberg", "GUTENBERG", "gutenberg", "SMALL PRINT", "Small Print"))


def clean_text(text: str, cfg: CleanConfig) -> tuple[str, dict[str, int]]:
    """The whole cleaning stage for one document: normalise, then strip Gutenberg boilerplate."""
    counts: dict[str, int] = {}
    text = normalize(text, cfg, counts)
    if cfg.gutenberg and _may_have_boilerplate(text):
        text, header, footer = strip_gutenberg(text)
        if header:
            counts["gutenberg_header_removed"] = 1
        if footer:
            counts["gutenberg_footer_removed"] = 1
    return text, counts
