"""The dashboard, `primaplug dashboard`: a Textual app over the head's coordinator (head/coordinator.py) and its
event bus. The only package that imports Textual (the `dashboard` extra); `primaplug.cli` loads it only when the
dashboard runs. docs/dashboard.md describes it."""
