"""Batch image/video generation with Cosmos3 through a distributed layerwise offload engine."""

__version__ = "0.1.0"
