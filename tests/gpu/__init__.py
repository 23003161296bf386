"""The prepared GPU checks (`pytest -m gpu tests/gpu`; each also runs alone as `python tests/gpu/NAME.py`)."""
