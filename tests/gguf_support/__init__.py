"""Fixtures for the GGUF and Meta `.pth` output tests: tiny random HF models with a real tokenizer, and
llama.cpp's own converter (run from the llama-cpp-python source distribution, cached) as the reference."""
