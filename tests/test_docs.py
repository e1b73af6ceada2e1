"""The documentation matches the code it describes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("generate_commands",
                                                  ROOT / "docs" / "generate_commands.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_reference_is_what_the_help_says() -> None:
    """docs/reference/commands.md is regenerated from --help (docs/generate_commands.py)."""
    written = (ROOT / "docs" / "reference" / "commands.md").read_text()
    assert _generator().page() == written, "run: python docs/generate_commands.py"


def test_the_docs_never_talk_about_how_the_tool_was_built() -> None:
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for page in pages:
        text = page.read_text()
        assert not re.search(r"\bissue #?\d+|\bseed lab\b|SPEC\.md|DESIGN\.md", text, re.I), page
