"""The OpenAI-compatible HTTP server (`ferrum serve`)."""
