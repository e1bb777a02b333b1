"""Evaluation text that every Debian system already has, so no one else's text is committed here.

Debian's `base-files` package (Essential: yes, so present on every Debian and Ubuntu install,
the bare `python:3.11` and `python:3.11-slim` images included) ships the common licence texts
under `/usr/share/common-licenses/`. They are long English prose and never change:

- scored text (`default_corpus_path`): `GPL-3`, the GNU General Public License v3,
  35,149 bytes, 674 lines, 7,562 Gemma 3 tokens (1,545 distinct), without <bos>.
- keepset text (`keepset_corpus_path`): `MPL-2.0`, the Mozilla Public License 2.0,
  16,726 bytes, 373 lines, 3,602 Gemma 3 tokens (766 distinct). A different author and body:
  under 1% of its 8-word runs occur in GPL-3 (GFDL-1.3 shares 7%, GPL-2 28%), so LM-head
  keepsets built from it never see the scored text.
- calibration texts (`calibration_corpus_paths`, GPTQ's default): `MPL-2.0`, `Apache-2.0`, `MPL-1.1`,
  `Artistic`, `CC0-1.0`, 14,422 Gemma 3 tokens together (3,602 + 2,322 + 5,660 + 1,309 + 1,529), each
  sharing under 1% of its 8-word runs with GPL-3.

Trap: these licences are all over the web, so a trained model has likely seen them in
pretraining; compare techniques against each other on them, not against published perplexities.
"""

from pathlib import Path

COMMON_LICENSES = Path("/usr/share/common-licenses")
DEFAULT_CORPUS = "GPL-3"
KEEPSET_CORPUS = "MPL-2.0"


def _license_path(name: str, role: str) -> Path:
    path = COMMON_LICENSES / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{role} corpus {path} not found: it ships with Debian's base-files package "
            f"(every Debian/Ubuntu system has it); on another OS pass a text file path instead"
        )
    return path


def default_corpus_path() -> Path:
    """The scored text: /usr/share/common-licenses/GPL-3 (35,149 bytes)."""
    return _license_path(DEFAULT_CORPUS, "scored")


def keepset_corpus_path() -> Path:
    """The text LM-head keepsets are built from: /usr/share/common-licenses/MPL-2.0 (16,726 bytes)."""
    return _license_path(KEEPSET_CORPUS, "keepset")


def read_corpus(path: str | Path) -> str:
    """The file as UTF-8 text; clear errors for a missing, empty or binary file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"corpus path {path} is not a regular file")
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"corpus file {path} is empty")
    # NUL bytes never occur in text; UTF-8 decoding alone lets many binaries through
    if b"\x00" in data:
        raise ValueError(f"corpus file {path} is binary (contains NUL bytes), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus file {path} is not UTF-8 text: {err}") from None


CALIBRATION_CORPORA = ("MPL-2.0", "Apache-2.0", "MPL-1.1", "Artistic", "CC0-1.0")


def calibration_corpus_paths() -> list[Path]:
    """The texts GPTQ calibrates on by default (`quant.method=gptq`), in this order: licences other than
    the scored GPL-3 (MPL-2.0 is also the keepset text), 14,422 Gemma 3 tokens together."""
    return [_license_path(name, "calibration") for name in CALIBRATION_CORPORA]
