"""Serving: an OpenAI-compatible HTTP server over continuous batching (needs specdec[serve])."""
