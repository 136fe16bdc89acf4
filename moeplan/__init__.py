"""moeplan: a compiler-style planner for training giant Mixture-of-Experts language models."""
__version__ = "0.1.0"
