"""llama.cpp GGUF files as a model source: config, tokenizer and weights read from one file."""
