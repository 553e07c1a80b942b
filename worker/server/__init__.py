"""The worker's OpenAI-compatible HTTP server, the thread that drives its engine, and `python -m worker`."""
