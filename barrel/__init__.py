"""Barrel: a long-running LLM inference daemon over llama.cpp."""

__version__ = "0.1.0.dev0"
