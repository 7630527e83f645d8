"""A small FastAPI ticket service made safe to retry by idempotency-mw."""
