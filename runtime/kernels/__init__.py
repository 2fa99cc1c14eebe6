"""Device kernels for the runtime: dequant.py turns GGUF block bytes into float weights with torch ops."""
