"""`python -m moechat`: the same as the `moechat` command."""
from .app.cli import main

raise SystemExit(main())
