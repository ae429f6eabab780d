"""edgerun: Mixture-of-Experts inference for memory-bound edge devices."""

__version__ = "0.1.0"
