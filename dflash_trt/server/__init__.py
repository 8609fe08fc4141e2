"""`dflash-trt serve`: an OpenAI-compatible HTTP front (FastAPI + uvicorn) over the executors."""
