"""moechat.app: the user's side (CLI now, the Textual TUI later)."""
