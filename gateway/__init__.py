"""Memory Gateway: a conversation-memory reverse proxy for LLM APIs."""

__version__ = "0.1.0"
