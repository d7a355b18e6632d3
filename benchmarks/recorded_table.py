"""How a benchmark records its results: the JSON document, its Markdown table beside it,
and the same table between a document's markers (``<!-- NAME:begin -->``, ``<!-- NAME:end -->``)
when the run writes the recorded results (not a trial run writing elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def record(out: Path, document: Any, lines: list[str], doc: Path, marker: str, recorded: bool, heading=()) -> None:
    """``document`` to ``out`` (.json), ``lines`` to its .md (after ``heading``), into ``doc``
    between ``marker``'s lines when ``recorded``; the table printed."""
    out.with_suffix(".json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text("\n".join([*heading, *lines]) + "\n")
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = doc.read_text()
    if recorded and begin in text and end in text:
        head, rest = text.split(begin)
        doc.write_text(head + begin + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1])
    print("\n".join(lines))
