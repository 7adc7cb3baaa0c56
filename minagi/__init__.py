"""minagi: a character-level Mixture-of-Experts language model and its trainer."""

__version__ = "0.1.0"
