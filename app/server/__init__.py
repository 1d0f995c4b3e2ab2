"""`moechat serve`: the engine behind an OpenAI-compatible HTTP API (worker.py: the engine thread and its queue;
api.py: the API's shapes; routes.py: the FastAPI routes; command.py: the command and an in-process server)."""
