"""An example edgerun architecture provider (see edgerun's docs/providers.md)."""
