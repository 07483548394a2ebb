"""A toy model family, to show what adding one takes (docs/architecture.md, "Add a model family"):
this package and a registry entry, nothing in deepinfer/core. The model is a bag of words: a
sequence's state is the sum of the embeddings of every token it has fed (one ring row per sequence
slot in the engine's cache), and the next token's logits are that sum times the head."""

from toy_family.config import ToyConfig
from toy_family.model import ToyModel

__all__ = ["ToyConfig", "ToyModel"]
