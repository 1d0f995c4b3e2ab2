"""The Textual app: screens and widgets in their own modules; the engine runs on `app/bridge.py`'s thread."""
