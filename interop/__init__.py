"""Our GPT <-> Hugging Face folders: GPT-2 (hf.py), Llama and Qwen3 (hf_llama.py).

May import: safeio, model.

Each file says what its architecture's names and shapes are, both ways; the folder's files are
read by safeio/hf.py. Whether a folder's values are in range and its model fits in memory is
policy: guard/run_dir.py checks them (folder_shape, built) before any weight is read.
"""
