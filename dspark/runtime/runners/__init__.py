"""What the generated verify runners share: the eager runner, and the static buffers a captured
graph reads its step from."""
