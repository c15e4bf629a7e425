"""specchat's HTTP API: OpenAI-compatible routes over the engine (server.py), `serve` (cli.py)."""
