"""Exports of a trained model into other runtimes' formats: GGUF for llama.cpp and Ollama.

Runs in its own process (`python -m rp_service.export`), as the job worker does: it loads
torch and the model, which the daemon never does.
"""
