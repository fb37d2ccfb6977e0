"""The world and its process groups, sequence parallelism, and the torchrun launcher."""
