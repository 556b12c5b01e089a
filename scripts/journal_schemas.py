"""Write schemas/events.schema.json and schemas/usage.schema.json from their msgspec
Structs (``gpuctl.render.events_view``): ``python scripts/journal_schemas.py``."""

from __future__ import annotations

import json
from pathlib import Path

from gpuctl.render.events_view import json_schemas

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    for name, schema in json_schemas().items():
        (ROOT / "schemas" / name).write_text(json.dumps(schema, indent=2) + "\n")


if __name__ == "__main__":
    main()
