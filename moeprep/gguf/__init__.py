"""GGUF models: reading (reader.py), tensor roles (roles.py), anatomy (anatomy.py), writing (writer.py)."""
