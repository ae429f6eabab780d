"""Triton kernels for edgerun, installed as ``edgerun.kernels``; each has a pure-torch reference."""
