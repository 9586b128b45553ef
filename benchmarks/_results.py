"""Where a benchmark's results go: ``<name>.json`` and ``<name>.md`` under the output folder."""

from __future__ import annotations

import json
from pathlib import Path


def write(out: str | Path, name: str, data, markdown: str) -> None:
    """Write ``data`` as JSON and ``markdown`` beside it, and print the markdown."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
