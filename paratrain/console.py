"""The one console every part of paratrain prints through (rich; no markup guessing, long
lines wrap instead of being cut)."""

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
