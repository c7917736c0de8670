"""What the command line prints: text that holds anything a user wrote (names, paths, config values,
errors that quote them) is shown as written, never read as rich markup, where `[/]` in a learner's
name would raise rich's MarkupError and `[bold]` would vanish."""

from __future__ import annotations

from rich.text import Text


def labelled(label: str, text: object, style: str = "red") -> Text:
    """`label` in `style`, a space, then `text` as plain text."""
    return Text.assemble((label, style), " ", str(text))
