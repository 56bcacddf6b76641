"""The SQL of released versions, to test upgrades from them.

``fixtures/sql-0.1-014.tar.gz`` is ``git archive`` of ``sql/000_bootstrap.sql`` ..
``sql/014_event_integrity.sql`` at commit 7ed30b0 (release 0.1): the last layout in which the
versioned migrations defined every function, view and trigger. Shipped as a file because CI may
check out without history.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

RELEASE_0_1 = Path(__file__).resolve().parents[1] / "fixtures" / "sql-0.1-014.tar.gz"


def released_files() -> dict[str, bytes]:
    """The released migrations by file name (``001_core.sql``), as they were released."""
    with tarfile.open(RELEASE_0_1) as archive:
        return {Path(m.name).name: archive.extractfile(m).read()  # type: ignore[union-attr]
                for m in archive.getmembers() if m.isfile()}


def released_sql(directory: Path, *, upto: int = 14) -> Path:
    """Writes the released migrations 000 .. ``upto`` into ``directory`` (created) and returns it,
    for ``migrate(url, directory=...)``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in released_files().items():
        if int(name[:3]) <= upto:
            (directory / name).write_bytes(content)
    return directory
