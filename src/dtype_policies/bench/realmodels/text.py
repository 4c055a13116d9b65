"""The real English text the quality workloads read at run time.

Nothing of it is copied into the repository: every Debian/Ubuntu machine has
`/usr/share/common-licenses/GPL-3` (package base-files), and its SHA-256 is
checked so that figures from different machines measure the same text.

Rules (fixed; change them and every figure changes):

* **LM windows.** The whole file, tokenized without special tokens, cut into
  `LM_WINDOWS` non-overlapping windows of `LM_WINDOW` tokens from the start;
  each window is scored on its `LM_WINDOW - 1` next-token predictions
  (8 x 511 = 4,088).
* **Encoder sentences.** Paragraphs (split at blank lines, whitespace
  collapsed), each split after `.`, `!`, `?` or `;` followed by whitespace;
  pieces of at least 4 words; the first `ENCODER_SENTENCES` (200).
* **Calibration text** (for variants that calibrate: float8 delayed scaling,
  and modes that take data): `/usr/share/common-licenses/Apache-2.0`, a
  different text, so nothing evaluated was seen in calibration.
* **LM calibration text** (GPTQ and AWQ, 128 windows of 512 tokens: more
  text than any licence holds): the Python documentation topics shipped with
  the interpreter (`pydoc_data.topics.topics`, the language reference's
  prose), values in sorted key order joined by blank lines; checked against
  its SHA-256 for the pinned Python (3.11.7). Not the evaluation text.

>>> sentences = encoder_sentences()
>>> len(sentences), sentences[0]
(200, 'GNU GENERAL PUBLIC LICENSE Version 3, 29 June 2007')
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from pathlib import Path

EVALUATION_TEXT = Path("/usr/share/common-licenses/GPL-3")
EVALUATION_SHA256 = "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"
CALIBRATION_TEXT = Path("/usr/share/common-licenses/Apache-2.0")
CALIBRATION_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

LM_CALIBRATION_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"

LM_WINDOWS = 8
LM_WINDOW = 512
ENCODER_SENTENCES = 200
_MIN_WORDS = 4


class TextUnavailable(RuntimeError):
    """The fixed text is missing or is not the expected version."""


def _read_checked(path: Path, sha256: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TextUnavailable(
            f"{path} is not readable ({e.strerror}); it ships with Debian's base-files package"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise TextUnavailable(
            f"{path} has SHA-256 {digest}, not the {sha256} these figures are defined on"
        )
    return data.decode("utf-8")


@cache
def evaluation_text() -> str:
    """The GPL-3 text (checked)."""
    return _read_checked(EVALUATION_TEXT, EVALUATION_SHA256)


@cache
def calibration_text() -> str:
    """The Apache-2.0 text (checked), disjoint from the evaluation text."""
    return _read_checked(CALIBRATION_TEXT, CALIBRATION_SHA256)


@cache
def lm_calibration_text() -> str:
    """The Python documentation topics (checked), for GPTQ and AWQ."""
    from pydoc_data.topics import topics

    joined = "\n\n".join(topics[key] for key in sorted(topics))
    digest = hashlib.sha256(joined.encode()).hexdigest()
    if digest != LM_CALIBRATION_SHA256:
        raise TextUnavailable(
            f"pydoc_data.topics has SHA-256 {digest}, not the {LM_CALIBRATION_SHA256} of "
            "Python 3.11.7 these figures are defined on"
        )
    return joined


def split_sentences(text: str) -> list[str]:
    """The sentence rule of the module docstring, without the count limit.

    >>> split_sentences("One two three four. Five six; seven eight nine ten!\\n\\nA b c d e")
    ['One two three four.', 'seven eight nine ten!', 'A b c d e']
    """
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    pieces = (s for p in paragraphs for s in re.split(r"(?<=[.!?;])\s+", p))
    return [s for s in pieces if len(s.split()) >= _MIN_WORDS]


@cache
def encoder_sentences() -> tuple[str, ...]:
    """The first 200 sentences of the evaluation text."""
    sentences = split_sentences(evaluation_text())
    if len(sentences) < ENCODER_SENTENCES:
        raise TextUnavailable(f"only {len(sentences)} sentences in {EVALUATION_TEXT}")
    return tuple(sentences[:ENCODER_SENTENCES])


@cache
def calibration_sentences() -> tuple[str, ...]:
    """Every sentence of the calibration text."""
    return tuple(split_sentences(calibration_text()))
