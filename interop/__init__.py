"""Hugging Face interop: our GPT <-> GPT-2, Llama and Qwen3 folders."""
