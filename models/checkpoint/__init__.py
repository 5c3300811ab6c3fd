"""A checkpoint folder read without loading it: the safetensors headers (header.py) and the checks on
its quantization that `serve --check` and the loader make from them (check.py)."""
