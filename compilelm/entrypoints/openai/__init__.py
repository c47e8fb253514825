"""OpenAI-compatible HTTP server (`compilelm serve`)."""
