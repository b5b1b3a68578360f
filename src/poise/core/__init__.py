"""The shared vocabulary every other package speaks: the cluster (`cluster`) and the named
clusters (`presets`), the model's shape (`spec`), where experts live and where tokens go
(`placement`), errors (`errors`), the parsing of configuration fields (`fields`) and the words
themselves (`glossary`). NumPy only; imports nothing else of Poise."""
