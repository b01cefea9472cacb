"""The backports' vLLM model modules, imported only by vLLM's model registry (lazily), never by this package."""
