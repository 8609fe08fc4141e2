"""`model.py` sources for Triton's Python backend; copied into the repository, imported only inside Triton."""
