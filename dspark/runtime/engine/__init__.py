"""The engine: requests, continuous-batching scheduler, and the speculative decode step."""
