"""docs/configuration.md, generated from the settings models: `python -m service.settings_doc > docs/configuration.md`
(tests/test_settings.py fails when the file and the models differ)."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from service.settings import ENV_PREFIX, GROUPS

HEADER = """# Configuration

Switchyard reads its settings from `SWITCHYARD_*` environment variables (names in any case); `switchyard serve
--help` shows the command-line options that override some of them. A bad value stops start-up with a message naming
the variable. Inside the program the settings are grouped by concern (`settings.database.pool_max` is
`SWITCHYARD_DB_POOL_MAX`); tests and embedders may pass either form to `Settings(...)`.

This page is generated from `service/settings.py` (`python -m service.settings_doc > docs/configuration.md`).
"""

FOOTER = """
## Variables of the tools, not the service

| variable | used by | meaning |
|---|---|---|
| `SWITCHYARD_URL` | `switchyard load-vectors` | The service to load into (default `http://127.0.0.1:8000`). |
| `SWITCHYARD_RESULTS_DIR` | benchmark scripts under `loadtests/` | Where results are written (default: \
`loadtests/results/` in a checkout, else `./results/`). |
"""


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "by machine (see meaning)"
    value: Any = info.default
    if info.is_required() or value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, Path):
        value = f"./{value}"
    return f"`{value}`"


def markdown() -> str:
    lines = [HEADER]
    for group, model in GROUPS.items():
        lines += [f"## {group.capitalize()}", "", (model.__doc__ or "").strip(), "",
                  "| variable | default | meaning |", "|---|---|---|"]
        for name, info in model.model_fields.items():
            variable = ENV_PREFIX + (info.serialization_alias or name).upper()
            meaning = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{variable}` | {_default(info)} | {meaning} |")
        lines.append("")
    return "\n".join(lines) + FOOTER


if __name__ == "__main__":
    sys.stdout.write(markdown())
