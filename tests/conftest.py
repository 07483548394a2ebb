import os
import sys

# Tests import their helpers (tiny_models, model_runner) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
