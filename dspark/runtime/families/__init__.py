"""Model families with a home of their own: everything of a family that imports torch (model, caches,
metadata, layers per backend, sharding), in one package per family. The dense families (Llama, Qwen3) share
`dspark.runtime.models`. Importing this package imports nothing."""
