"""The OpenAI-compatible HTTP gateway (FastAPI) and its request and response models."""
