"""What a checkpoint's manifest must hold before any of it is used: names of parts inside
its folder, and fields as paratrain writes them (a crafted or foreign manifest is one line,
exit 2, and nothing of its folder is used or moved)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

MANIFEST = "manifest.json"


def check_fields(folder: Path, manifest: dict[str, Any]) -> None:
    """ConfigError naming the first field of a manifest that is not as paratrain writes it:
    its step and counts whole numbers, each part its bytes and SHA-256."""
    counts = {"step": 0, "workers": 1, "replicas": 1, "processes": 1, "batches_per_step": 1}
    if "step" not in manifest:
        raise ConfigError(f"checkpoint {folder}: its {MANIFEST} has no step; not a complete paratrain checkpoint")
    for key, least in counts.items():
        value = manifest.get(key, least)
        if type(value) is not int or value < least:
            raise ConfigError(f"checkpoint {folder}: its {MANIFEST} has {key} {value!r}; a whole number >= {least}")
    for part, described in manifest["parts"].items():
        if not (
            isinstance(described, dict)
            and type(described.get("bytes")) is int
            and isinstance(described.get("sha256"), str)
            and len(described["sha256"]) == 64
        ):
            raise ConfigError(
                f"checkpoint {folder}: its {MANIFEST} describes part {part!r} as {described!r}; "
                "paratrain writes {'bytes': N, 'sha256': HEX}"
            )


def refuse_outside(folder: Path, manifest: dict[str, Any]) -> None:
    """ConfigError where ``manifest`` names a part outside ``folder``: such a manifest was
    made to read other files, and nothing of that checkpoint folder is used or moved."""
    names = manifest.get("part_names", [])
    for name in [*manifest["parts"], *(names if isinstance(names, list) else [names])]:
        if not _inside(name):
            raise ConfigError(
                f"checkpoint {folder}: its {MANIFEST} names a file outside the checkpoint ({name!r}); refused"
            )


def _inside(name: Any) -> bool:
    """Whether a manifest's part name stays inside its checkpoint folder (a relative path
    without ``..``, as paratrain writes them: ``rank-0``, ``model/__0_0.distcp``)."""
    if not isinstance(name, str) or not name or "\\" in name or name.startswith("/"):
        return False
    return all(piece not in ("", ".", "..") for piece in name.split("/"))
