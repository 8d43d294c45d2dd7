"""House rules read from the source: docstrings, backend names, the import graph, generated docs tables."""
